"""``llm-annotator run``: an annotation job from flags, a TOML file, or both.

Every flag has a key of the same name in the file (``--max-completion-tokens`` is
``max_completion_tokens``); a flag given on the command line wins over the file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import signal
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_annotator import _constants as default
from llm_annotator._validate import size_in_bytes
from llm_annotator.cli._logging import HumanLines, LogPlan
from llm_annotator.errors import (
    ConfigurationError,
    PoolExhaustedError,
    RunInterruptedError,
    ServersUnusableError,
)

# The clients, the pool and the job layer are imported by the functions that use them,
# not here: declaring the command (its --help) loads none of them.
if TYPE_CHECKING:
    from llm_annotator.annotator import VLLMQueueAnnotator
    from llm_annotator.clients.base import Client
    from llm_annotator.clients.tls import Verify
    from llm_annotator.pool.discovery import ServerDiscovery


@dataclass(frozen=True, slots=True)
class _Setting:
    flag: str
    kind: Callable[[Any], Any]
    help: str
    default: Any = None
    nargs: str | None = None


class _BadValue(argparse.ArgumentTypeError, ValueError):
    """A value a setting cannot take; argparse prints it as it is, TOML wraps it."""


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise _BadValue(f"expected true or false, got {value!r}")


def _text(value: Any) -> str:
    if isinstance(value, str) and value:
        return value
    raise _BadValue(f"expected a non-empty string, got {value!r}")


def _processes(value: Any) -> int | str:
    if value == "auto":
        return "auto"
    try:
        return int(_POSITIVE_INT(value))
    except _BadValue:
        raise _BadValue(f"expected auto or an integer >= 1, got {value!r}") from None


def _paths(value: Any) -> list[str]:
    paths = _strings(value)
    if not paths or not all(paths):
        raise _BadValue(f"expected one or more paths, got {value!r}")
    return paths


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise _BadValue(f"expected a list of strings, got {value!r}")


def _number(
    *, integer: bool, low: float, high: float | None = None, low_open: bool = False
) -> Callable[[Any], Any]:
    """A converter for a number in a range, from a flag's text or a TOML value."""
    what = "an integer" if integer else "a number"
    bound = f"> {low:g}" if low_open else f">= {low:g}"
    if high is not None:
        bound += f" and <= {high:g}"

    def convert(value: Any) -> int | float:
        number: int | float | None = None
        if isinstance(value, str):
            try:
                number = int(value) if integer else float(value)
            except ValueError:
                number = None
        elif isinstance(value, int | float) and not isinstance(value, bool):
            number = value if (not integer or isinstance(value, int)) else None
        ok = number is not None and math.isfinite(number)
        if ok and number is not None:
            ok = (number > low if low_open else number >= low) and (high is None or number <= high)
        if not ok or number is None:
            raise _BadValue(f"expected {what} {bound}, got {value!r}")
        return number

    return convert


_POSITIVE_INT = _number(integer=True, low=1)
_COUNT = _number(integer=True, low=0)
_SEED = _number(integer=True, low=-(2**63))
_SECONDS = _number(integer=False, low=0, low_open=True)


def _size(value: Any) -> int:
    """A size in bytes, from a flag's text or a TOML value (``4096``, ``"64M"``)."""
    try:
        return size_in_bytes("the size", value)
    except ConfigurationError:
        raise _BadValue(f"expected a size in bytes (4096, 64M, 1G), got {value!r}") from None


_GRACE = _number(integer=False, low=0)


def _retry_errors(value: Any) -> bool | list[str]:
    """``retry_errors``: true or false, or a list of error types (an empty one: none)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise _BadValue(f"expected true, false or a list of error types, got {value!r}")


def _log_format(value: Any) -> str:
    if value in ("json", "console"):
        return str(value)
    raise _BadValue(f"expected json or console, got {value!r}")


_SETTINGS: tuple[_Setting, ...] = (
    _Setting("servers", _strings, "vLLM base URLs (http://host:port/v1)", nargs="+"),
    _Setting("servers_file", _text, "a file of base URLs, one a line, re-read during the run"),
    _Setting("servers_dir", _text, "a folder where each server writes <name>.url when healthy"),
    _Setting("servers_dns", _text, "NAME:PORT, a DNS name resolving to every server"),
    _Setting(
        "offline_model",
        _text,
        "a model folder to run in this process with vLLM instead of servers (needs "
        "vLLM in this Python: pip install 'llm-annotator[offline]')",
    ),
    _Setting("tensor_parallel_size", _POSITIVE_INT, "with --offline-model: GPUs per model"),
    _Setting("max_model_len", _POSITIVE_INT, "with --offline-model: the context length"),
    _Setting("dtype", _text, "with --offline-model: auto, bfloat16, float32, ..."),
    _Setting("max_num_seqs", _POSITIVE_INT, "with --offline-model: most sequences run at once"),
    _Setting(
        "enforce_eager",
        _bool,
        "with --offline-model: no compiling and no CUDA graphs (a faster start, a slower "
        "decode on GPUs)",
    ),
    _Setting(
        "gpu_memory_utilization",
        _number(integer=False, low=0, high=1, low_open=True),
        "with --offline-model: share of each GPU's memory the engine may take",
    ),
    _Setting(
        "input",
        _paths,
        "the dataset: a .jsonl, .parquet, .csv or .arrow file (JSONL and CSV also .gz, "
        ".zst, .bz2, .xz); or a corpus: a directory, a quoted glob ('crawl/*.parquet'), "
        "several paths, or a datasets save_to_disk folder",
        nargs="+",
    ),
    _Setting(
        "skip_bad_files",
        _bool,
        "in a corpus, leave out a file that cannot be read, listed in the manifest",
        False,
    ),
    _Setting("prompt_template", _text, "the user message, with {column} fields"),
    _Setting("output_dir", _text, "the run directory; run again to resume"),
    _Setting("id_column", _text, "column with each row's id (default: the row's position)"),
    _Setting("system_message", _text, "a system message for every row"),
    _Setting("columns", _strings, "input columns to keep in the output (default: all)", nargs="+"),
    _Setting("model", _text, "model name (default: what the servers serve)"),
    _Setting(
        "batch_size",
        _POSITIVE_INT,
        f"rows per batch (default {default.BATCH_SIZE})",
        default.BATCH_SIZE,
    ),
    _Setting(
        "max_concurrent_batches_per_client",
        _POSITIVE_INT,
        f"batches in flight per server (default {default.MAX_CONCURRENT_BATCHES})",
        default.MAX_CONCURRENT_BATCHES,
    ),
    _Setting("max_completion_tokens", _POSITIVE_INT, "upper bound on generated tokens"),
    _Setting(
        "temperature", _number(integer=False, low=0), "sampling temperature (default: the model's)"
    ),
    _Setting(
        "top_p",
        _number(integer=False, low=0, high=1, low_open=True),
        "nucleus sampling (default: the model's)",
    ),
    _Setting("seed", _SEED, "random seed for reproducible sampling"),
    _Setting("output_schema", _text, "JSON schema file the answers must follow"),
    _Setting(
        "max_regenerations",
        _COUNT,
        f"with a schema: retries of invalid answers (default {default.MAX_REGENERATIONS})",
        default.MAX_REGENERATIONS,
    ),
    _Setting(
        "retry_errors",
        _retry_errors,
        "send again the rows that ended in error; with TYPEs (read_timeout server_error "
        "...) only those whose error type is one of them",
        False,
        nargs="*",
    ),
    _Setting("limit", _POSITIVE_INT, "a trial run: annotate only the first LIMIT rows"),
    _Setting(
        "shuffle_seed", _SEED, "with --limit: draw the rows with this seed, not the first ones"
    ),
    _Setting(
        "validate",
        _text,
        "MODULE:FUNCTION or FILE.py:FUNCTION, your answer check: it gets the answer text "
        "and returns the parsed value (a dict becomes columns) or raises (the answer is "
        "generated again, then an invalid_output error row)",
    ),
    _Setting("force", _bool, "resume even if the directory was made with other settings", False),
    _Setting("jsonl", _bool, "also write annotations.jsonl", False),
    _Setting("hedge_tail", _bool, "near the end, also send slow servers' work to idle ones", True),
    _Setting(
        "adaptive",
        _bool,
        "size what each server holds from its /metrics, so none queues work another could "
        "start sooner; default off: what each server holds grows with its answers up to "
        "batch_size x batches",
        False,
    ),
    _Setting(
        "prefix_affinity",
        _bool,
        "send rows that share a prompt prefix (one --group-by value) to one server while "
        "it has room, so its prefix cache holds the shared part; each server first gets "
        "the template's text before its first field once",
        False,
    ),
    _Setting(
        "group_by",
        _text,
        "with --prefix-affinity: the column that groups rows sharing a long prefix (a "
        "document id); default: the value of the template's first field",
    ),
    _Setting(
        "api_key_file",
        _text,
        "a file holding the servers' API key (for vLLM started with --api-key); "
        "default: $VLLM_API_KEY if set",
    ),
    _Setting("api_key_env", _text, "the name of an environment variable holding the API key"),
    _Setting(
        "ca_bundle", _text, "a PEM file of the authority that signed the servers' TLS certificates"
    ),
    _Setting(
        "verify_tls",
        _bool,
        "check https servers' certificates (default); --no-verify-tls skips the check",
        True,
    ),
    _Setting(
        "timeout",
        _SECONDS,
        f"seconds one request may take, answer included (default {default.TIMEOUT:g})",
        default.TIMEOUT,
    ),
    _Setting(
        "max_response_bytes",
        _POSITIVE_INT,
        "largest answer read from a server, in bytes (default 16 MiB)",
        default.MAX_RESPONSE_BYTES,
    ),
    _Setting(
        "max_server_faults",
        _POSITIVE_INT,
        "answers in a row that are a server's fault (garbage, 5xx, cut off) that evict it "
        f"(default {default.MAX_SERVER_FAULTS})",
        default.MAX_SERVER_FAULTS,
    ),
    _Setting(
        "stall_window",
        _SECONDS,
        "least seconds a server may hold requests and answer none before it is taken for "
        f"hung (default {default.STALL_WINDOW:g})",
        default.STALL_WINDOW,
    ),
    _Setting(
        "stop_grace",
        _GRACE,
        f"seconds in-flight requests get after a signal (default {default.STOP_GRACE:g})",
        default.STOP_GRACE,
    ),
    _Setting(
        "all_down_timeout",
        _SECONDS,
        f"seconds to wait when every server is down (default {default.ALL_DOWN_TIMEOUT:g})",
        default.ALL_DOWN_TIMEOUT,
    ),
    _Setting(
        "log_format",
        _log_format,
        "json or console: every log record on stderr in this format (default: stderr has "
        "the progress and, in words, the warnings only); with --log-file, the file's format",
    ),
    _Setting(
        "log_file",
        _text,
        "append every log record to this file (JSON unless --log-format console); stderr "
        "keeps the progress and the warnings in words",
    ),
    _Setting(
        "shard",
        _text,
        "take only this shard's rows: INDEX/COUNT, auto (a SLURM array task) or auto/COUNT "
        "(a Kubernetes Indexed Job); the last shard to finish merges them. For a corpus, "
        "also claim: any number of workers take its units one at a time",
    ),
    _Setting(
        "processes",
        _processes,
        "for a corpus: worker processes on this machine, which take its units by claims "
        "and share each server's in-flight budget (default auto: one per 8 servers, at "
        "most one per core)",
    ),
    _Setting(
        "unit_size",
        _size,
        "for a corpus, or one file with --shard claim: files larger than this (bytes, or "
        "64M, 1G) are cut into units: Parquet by row groups, uncompressed JSONL with an "
        "--id-column by byte ranges, each read alone (default 256M)",
    ),
    _Setting(
        "claim_lease",
        _SECONDS,
        "with --shard claim: seconds a worker's claim on a unit lasts unrenewed before "
        "another worker takes the unit over (default 60)",
    ),
    _Setting(
        "metrics_port",
        _number(integer=True, low=0, high=65535),
        "serve live Prometheus metrics of the job on this port (0: any free port)",
    ),
    _Setting(
        "metrics_host",
        _text,
        "the address of --metrics-port (default 127.0.0.1; 0.0.0.0 for other hosts)",
    ),
)
_REQUIRED = ("input", "prompt_template", "output_dir")

HUMAN_LINES = HumanLines(
    shown=frozenset({"progress", "metrics_serving", "step_started"}),
    said=frozenset({"job_interrupted", "pool_exhausted"}),
)
"""What ``run`` and ``pipeline run`` show people on stderr besides warnings: the
progress where no bar is drawn, the port of live metrics, each step as it begins; what
their closing lines say already: a stop by a signal, every server gone."""


def add_run(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator run`` on its parser."""
    parser.description = (
        "Annotate every row of a dataset over a pool of vLLM servers into an output "
        "directory. Results are written as they arrive; running the same command "
        "again resumes the job. A TOML file given with --config sets the same "
        "settings (flag names with underscores); flags override it."
    )
    parser.add_argument("--config", default=None, help="a TOML job file")
    for setting in _SETTINGS:
        flag = "--" + setting.flag.replace("_", "-")
        if setting.kind is _bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=setting.help
            )
        elif setting.kind is _retry_errors:
            parser.add_argument(flag, nargs="*", default=None, metavar="TYPE", help=setting.help)
            parser.add_argument(
                "--no-" + flag[2:],
                dest=setting.flag,
                action="store_const",
                const=False,
                help="(the default) keep error rows as they are",
            )
        elif setting.nargs:
            parser.add_argument(flag, nargs=setting.nargs, default=None, help=setting.help)
        else:
            parser.add_argument(flag, type=setting.kind, default=None, help=setting.help)
    parser.set_defaults(handler=run_command, human_lines=HUMAN_LINES)


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """The job's settings: the TOML file's, overridden by the flags given.

    Raises:
        ConfigurationError: An unreadable file, an unknown key, a value of the wrong
            type, or a required setting missing.
    """
    from llm_annotator.cli._offline import SERVER_SETTINGS, check_offline_settings

    known = {s.flag: s for s in _SETTINGS}
    merged: dict[str, Any] = {s.flag: s.default for s in _SETTINGS}
    if args.config is not None:
        path = Path(args.config)
        try:
            table = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigurationError(f"cannot read the job file {path}: {exc}") from exc
        for key, value in table.items():
            name = key.replace("-", "_")
            if name not in known:
                raise ConfigurationError(
                    f"{path}: unknown setting {key!r}; known settings: {', '.join(known)}"
                )
            merged[name] = converted(known[name], value, f"{path}: setting {key!r}")
    for name in known:
        value = getattr(args, name, None)
        if value is not None:
            # A bare --retry-errors (no types) retries every error row.
            merged[name] = True if value == [] and name == "retry_errors" else value
    missing = [name for name in _REQUIRED if not merged.get(name)]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ConfigurationError(f"missing {flags} (give the flags or set them in --config)")
    check_offline_settings(merged, {s.flag: s.default for s in _SETTINGS})
    if not merged["offline_model"] and not any(merged.get(k) for k in SERVER_SETTINGS):
        raise ConfigurationError(
            "give the servers: --servers URL [URL ...], --servers-file FILE, "
            "--servers-dir DIR or --servers-dns NAME:PORT; or --offline-model DIR to run "
            "the model in this process"
        )
    if merged["api_key_file"] and merged["api_key_env"]:
        raise ConfigurationError("give --api-key-file or --api-key-env, not both")
    if merged["metrics_host"] and merged["metrics_port"] is None:
        raise ConfigurationError("--metrics-host needs --metrics-port (the port to serve on)")
    if merged["ca_bundle"] and not merged["verify_tls"]:
        raise ConfigurationError("give --ca-bundle or --no-verify-tls, not both")
    return merged


def converted(setting: _Setting, value: Any, said: str) -> Any:
    """A file's value for ``setting``, converted as its flag's would be.

    Raises:
        ConfigurationError: The value is of the wrong type or out of range; the
            message begins with ``said`` (the file and the key).
    """
    try:
        return setting.kind(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigurationError(f"{said}: {exc}") from None


def api_key_from(settings: dict[str, Any]) -> str | None:
    """The API key that ``--api-key-file`` or ``--api-key-env`` names, if either.

    The key itself is never taken from the command line, where other users of the
    machine would see it.

    Raises:
        ConfigurationError: If the file cannot be read or is empty, or the variable
            is not set; the message names the flag and never shows the key.
    """
    if settings["api_key_file"]:
        path = Path(settings["api_key_file"])
        try:
            key = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"--api-key-file {path}: cannot read it ({exc.__class__.__name__}: "
                f"{getattr(exc, 'strerror', None) or exc})"
            ) from None
        if not key or "\n" in key:
            raise ConfigurationError(
                f"--api-key-file {path}: expected the key alone on one line"
                + (", the file is empty" if not key else "")
            )
        return key
    if settings["api_key_env"]:
        name = settings["api_key_env"]
        key = os.environ.get(name, "").strip()
        if not key:
            raise ConfigurationError(
                f"--api-key-env {name}: the environment variable {name} is not set or empty"
            )
        return key
    return None


def verify_from(settings: dict[str, Any]) -> Verify:
    """``verify=`` for the pool: ``--ca-bundle``, ``--no-verify-tls`` or the default.

    Raises:
        ConfigurationError: If the CA bundle cannot be read.
    """
    from llm_annotator.clients.tls import ssl_setting

    if settings["ca_bundle"]:
        bundle = settings["ca_bundle"]
        try:
            ssl_setting(bundle)
        except ConfigurationError as exc:
            raise ConfigurationError(f"--ca-bundle {bundle}: {exc}") from None
        return str(bundle)
    return bool(settings["verify_tls"])


def run_command(args: argparse.Namespace) -> int:
    """Run the job; the exit status is 0 when it finished, 128+signal when stopped."""
    from llm_annotator.cli._offline import offline_client
    from llm_annotator.jobs.annotate import Annotator
    from llm_annotator.jobs.rows.corpus import is_corpus, list_corpus
    from llm_annotator.jobs.rows.inputs import open_input
    from llm_annotator.jobs.shards.shard import Shard

    settings = settings_from(args)
    validate = load_validator(settings["validate"]) if settings["validate"] else None
    options = options_from(settings)
    data: str | list[str] = (
        settings["input"][0] if len(settings["input"]) == 1 else settings["input"]
    )
    processes = _how_many_processes(settings, is_corpus(data))
    if processes > 1:
        from llm_annotator.cli._workers import run_workers

        code = run_workers(args.argv, processes, settings)
        if code == 0:
            _print_corpus(Path(settings["output_dir"]))
        return code
    if settings["offline_model"]:
        # The input's path and format first: loading a model takes minutes on GPUs.
        if is_corpus(data):
            list_corpus(data, skip_bad_files=settings["skip_bad_files"])
        else:
            open_input(data, id_column=settings["id_column"])
        client: Client[Any] = offline_client(settings)
        batch_size = settings["batch_size"]
        batches = settings["max_concurrent_batches_per_client"]
    else:
        client = _pool(settings)
        batch_size, batches = default.BATCH_SIZE, default.MAX_CONCURRENT_BATCHES
    try:  # from here on, the client (an engine in this process, say) is always closed
        annotator = Annotator(
            client,
            batch_size=batch_size,
            max_concurrent_batches=batches,
            stop_grace=settings["stop_grace"],
            metrics_port=settings["metrics_port"],
            metrics_host=settings["metrics_host"] or "127.0.0.1",
            progress=progress_display(args),
        )
        result = annotator.annotate(
            data,
            settings["prompt_template"],
            settings["output_dir"],
            system_message=settings["system_message"],
            id_column=settings["id_column"],
            options=options,
            columns=settings["columns"],
            retry_errors=settings["retry_errors"],
            force=settings["force"],
            write_jsonl=settings["jsonl"],
            max_regenerations=settings["max_regenerations"],
            limit=settings["limit"],
            shuffle_seed=settings["shuffle_seed"],
            validate=validate,
            shard=_shard(settings["shard"], Shard),
            skip_bad_files=settings["skip_bad_files"],
            claim_lease=settings["claim_lease"],
            unit_size=settings["unit_size"],
            group_by=settings["group_by"],
        )
    except RunInterruptedError as stopped:
        print(f"llm-annotator run: {stopped}", file=sys.stderr, flush=True)
        return 128 + (stopped.signum or int(signal.SIGINT))
    except ServersUnusableError as unusable:
        print(
            f"llm-annotator run: error: {unusable}\nFix the settings named above and run "
            "the same command again; rows already written are kept and not sent again.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except PoolExhaustedError as exhausted:
        print(
            f"llm-annotator run: {exhausted}\nEverything completed is written in "
            f"{settings['output_dir']}; run the same command again to resume.",
            file=sys.stderr,
            flush=True,
        )
        return 3
    finally:
        client.close()
    print(f"annotations: {result.output_path}")
    if result.merged_path is not None and result.merged_path != result.output_path:
        print(f"all shards merged: {result.merged_path}")
    if result.jsonl_path is not None:
        print(f"annotations (JSONL): {result.jsonl_path}")
    print(f"report: {result.report_path}")
    print(
        f"rows: {result.num_rows} ({result.num_succeeded} succeeded, {result.num_failed} "
        f"failed); this run sent {result.num_sent}, resumed {result.num_resumed}, "
        f"in {result.seconds:.1f} s"
    )
    if result.num_left_out:
        print(
            f"left out: {result.num_left_out} results of rows that are not in this input "
            "(from a run over another input; they stay in the run directory's shards)"
        )
    return 0


def progress_display(args: argparse.Namespace) -> bool | None:
    """The job's ``progress``: a bar on a terminal (None), unless every log record
    goes to stderr (False: the progress is one of them)."""
    plan: LogPlan | None = getattr(args, "log_plan", None)
    return False if plan is not None and plan.records_on_stderr else None


def options_from(settings: dict[str, Any]) -> Any:
    """The runtime options the settings name (sampling, the output schema), for
    servers or for the model in this process.

    Raises:
        ConfigurationError: The output schema file cannot be read or is not a schema.
    """
    from llm_annotator.clients.vllm_offline_client import VLLMOfflineRuntimeOptions
    from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions
    from llm_annotator.jobs.answers.schema import OutputSchema

    schema = None
    if settings["output_schema"]:
        schema = OutputSchema.from_file(settings["output_schema"]).schema
    option_type = (
        VLLMOfflineRuntimeOptions if settings["offline_model"] else VLLMOnlineRuntimeOptions
    )
    return option_type(
        max_completion_tokens=settings["max_completion_tokens"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        seed=settings["seed"],
        output_schema=schema,
    )


def _how_many_processes(settings: dict[str, Any], corpus: bool) -> int:
    """How many worker processes ``--processes`` asks for (1: this one alone).

    Raises:
        ConfigurationError: More than one for a static shard or the model in this
            process. Several share one input file as they share a corpus: by claims on
            its units (``auto`` keeps one file in one process).
    """
    from llm_annotator.cli._workers import default_processes

    asked: int | str = settings["processes"] or "auto"
    shard = (settings["shard"] or "").strip()
    if isinstance(asked, str):  # auto
        alone = not corpus or shard not in ("", "claim") or settings["offline_model"]
        if not alone and not shard:  # a run begun in one process stays in one
            from llm_annotator.jobs.rundir.partitions import read_corpus_record

            begun = read_corpus_record(Path(settings["output_dir"]))
            alone = begun is not None and begun.get("mode") != "claim"
        return 1 if alone else default_processes(len(settings["servers"] or []))
    if asked > 1 and (shard not in ("", "claim") or settings["offline_model"]):
        raise ConfigurationError(
            "--processes: workers take a corpus's units by claims; leave out --shard "
            "INDEX/COUNT and --offline-model"
        )
    return asked


def _print_corpus(run_dir: Path) -> None:
    """What a corpus job's workers made, from its manifest."""
    from llm_annotator.jobs.rundir.partitions import ANNOTATIONS_DIR, read_manifest

    manifest = read_manifest(run_dir) or {}
    print(f"annotations: {run_dir / ANNOTATIONS_DIR}")
    print(
        f"rows: {manifest.get('rows')} ({manifest.get('succeeded')} succeeded, "
        f"{manifest.get('failed')} failed) in {manifest.get('units_done')} of "
        f"{manifest.get('units')} units"
    )


def _shard(text: str | None, shard: Any) -> Any:
    """``--shard``: None, ``claim``, or a static shard (parsed, so that a bad one is
    said before any server is asked)."""
    if not text:
        return None
    return "claim" if text.strip() == "claim" else shard.parse(text)


def _pool(settings: dict[str, Any]) -> VLLMQueueAnnotator:
    """The pool of servers the settings name."""
    from llm_annotator.annotator import VLLMQueueAnnotator
    from llm_annotator.clients.urls import normalize_base_url

    for url in settings["servers"] or []:
        try:
            normalize_base_url(url)
        except ConfigurationError as exc:
            raise ConfigurationError(f"--servers: {exc}") from None
    return VLLMQueueAnnotator(
        settings["servers"] or [],
        discovery=_discovery(settings),
        model=settings["model"],
        batch_size=settings["batch_size"],
        max_concurrent_batches_per_client=settings["max_concurrent_batches_per_client"],
        timeout=settings["timeout"],
        all_down_timeout=settings["all_down_timeout"],
        hedge_tail=settings["hedge_tail"],
        adaptive=settings["adaptive"],
        prefix_affinity=settings["prefix_affinity"],
        api_key=api_key_from(settings),
        verify=verify_from(settings),
        max_response_bytes=settings["max_response_bytes"],
        max_server_faults=settings["max_server_faults"],
        stall_window=settings["stall_window"],
    )


def load_validator(spec: str, flag: str = "--validate") -> Callable[..., Any]:
    """The callable that ``--validate`` (or another ``flag``: a pipeline's hooks) names:
    ``module:function`` (the module found from the working directory too) or
    ``path/to/file.py:function``.

    Raises:
        ConfigurationError: The module cannot be imported, has no such name, or the
            name is not callable; the message says which.

    Examples:
        >>> load_validator("json:loads")('{"a": 1}')
        {'a': 1}
        >>> load_validator("json")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: --validate 'json': expected MODULE:FUNCTION ...
    """
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigurationError(
            f"{flag} {spec!r}: expected MODULE:FUNCTION (my_checks:parse_label) or FILE.py:FUNCTION"
        )
    try:
        if where.endswith(".py"):
            path = Path(where)
            private = f"_llm_annotator_validate_{path.stem}"  # never shadows a real module
            loader = importlib.util.spec_from_file_location(private, path)
            if loader is None or loader.loader is None or not path.is_file():
                raise ConfigurationError(f"{flag} {spec!r}: no file {where}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[loader.name] = module
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would find it
            module = importlib.import_module(where)
    except ConfigurationError:
        raise
    except Exception as error:  # the user's module: any failure is theirs to see
        raise ConfigurationError(
            f"{flag} {spec!r}: cannot import {where}: {type(error).__name__}: {error}"
        ) from error
    found = getattr(module, name, None)
    if found is None:
        raise ConfigurationError(f"{flag} {spec!r}: {where} has no {name!r}")
    if not callable(found):
        raise ConfigurationError(f"{flag} {spec!r}: {where}.{name} is not callable")
    validate: Callable[..., Any] = found
    return validate


def _discovery(settings: dict[str, Any]) -> ServerDiscovery | None:
    """The server sources the settings name, re-read during the run."""
    from llm_annotator.pool.discovery import (
        DirectorySource,
        DnsSource,
        FileSource,
        ServerDiscovery,
        ServerSource,
    )

    sources: list[ServerSource] = []
    if settings["servers_file"]:
        sources.append(FileSource(Path(settings["servers_file"])))
    if settings["servers_dir"]:
        sources.append(DirectorySource(Path(settings["servers_dir"])))
    if settings["servers_dns"]:
        sources.append(DnsSource.parse(settings["servers_dns"]))
    return ServerDiscovery(sources) if sources else None
