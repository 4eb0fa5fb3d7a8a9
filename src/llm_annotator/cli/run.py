"""``llm-annotator run``: an annotation job from flags, a TOML file, or both.

Every flag has a key of the same name in the file (``--max-completion-tokens`` is
``max_completion_tokens``); a flag given on the command line wins over the file. The job
options' flags are built from their declarations (see :mod:`llm_annotator.cli.settings`).
"""

from __future__ import annotations

import argparse
import tomllib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_annotator import _constants as default
from llm_annotator.cli._logging import HumanLines, LogPlan
from llm_annotator.cli.settings import (
    ENDINGS,
    GRACE,
    POSITIVE_INT,
    SECONDS,
    SEED,
    BadValue,
    Setting,
    add_settings,
    boolean,
    exit_code,
    job_keywords,
    job_settings,
    number,
    paths,
    pool_from,
    strings,
    text,
)
from llm_annotator.errors import ConfigurationError

# The clients, the pool and the job layer are imported by the functions that use them,
# not here: declaring the command (its --help) loads none of them.
if TYPE_CHECKING:
    from llm_annotator.clients.base import Client

__all__ = [
    "HUMAN_LINES",
    "SETTINGS",
    "add_run",
    "progress_display",
    "run_command",
    "settings_from",
]


def _processes(value: Any) -> int | str:
    if value == "auto":
        return "auto"
    try:
        return int(POSITIVE_INT(value))
    except BadValue:
        raise BadValue(f"expected auto or an integer >= 1, got {value!r}") from None


def _log_format(value: Any) -> str:
    if value in ("json", "console"):
        return str(value)
    raise BadValue(f"expected json or console, got {value!r}")


SETTINGS: tuple[Setting, ...] = (
    Setting("servers", strings, "vLLM base URLs (http://host:port/v1)", nargs="+"),
    Setting("servers_file", text, "a file of base URLs, one a line, re-read during the run"),
    Setting("servers_dir", text, "a folder where each server writes <name>.url when healthy"),
    Setting("servers_dns", text, "NAME:PORT, a DNS name resolving to every server"),
    Setting(
        "offline_model",
        text,
        "a model folder to run in this process with vLLM instead of servers (needs "
        "vLLM in this Python: pip install 'llm-annotator[offline]')",
    ),
    Setting("tensor_parallel_size", POSITIVE_INT, "with --offline-model: GPUs per model"),
    Setting("max_model_len", POSITIVE_INT, "with --offline-model: the context length"),
    Setting("dtype", text, "with --offline-model: auto, bfloat16, float32, ..."),
    Setting("max_num_seqs", POSITIVE_INT, "with --offline-model: most sequences run at once"),
    Setting(
        "enforce_eager",
        boolean,
        "with --offline-model: no compiling and no CUDA graphs (a faster start, a slower "
        "decode on GPUs)",
    ),
    Setting(
        "gpu_memory_utilization",
        number(integer=False, low=0, high=1, low_open=True),
        "with --offline-model: share of each GPU's memory the engine may take",
    ),
    Setting(
        "input",
        paths,
        "the dataset: a .jsonl, .csv, .parquet or .arrow file (JSONL and CSV may be compressed: "
        ".gz, .zst, .bz2, .xz); or a corpus: a directory, a quoted glob ('crawl/*.parquet'), "
        "several paths, or a datasets save_to_disk folder",
        nargs="+",
    ),
    Setting("prompt_template", text, "the user message, with {column} fields"),
    Setting("output_dir", text, "the run directory; run again to resume"),
    *job_settings(),  # the job options, from their declarations
    Setting("model", text, "model name (default: what the servers serve)"),
    Setting(
        "batch_size",
        POSITIVE_INT,
        f"rows per batch (default {default.BATCH_SIZE})",
        default.BATCH_SIZE,
    ),
    Setting(
        "max_concurrent_batches_per_client",
        POSITIVE_INT,
        f"batches in flight per server (default {default.MAX_CONCURRENT_BATCHES})",
        default.MAX_CONCURRENT_BATCHES,
    ),
    Setting("max_completion_tokens", POSITIVE_INT, "upper bound on generated tokens"),
    Setting(
        "temperature", number(integer=False, low=0), "sampling temperature (default: the model's)"
    ),
    Setting(
        "top_p",
        number(integer=False, low=0, high=1, low_open=True),
        "nucleus sampling (default: the model's)",
    ),
    Setting("seed", SEED, "random seed for reproducible sampling"),
    Setting("output_schema", text, "JSON schema file the answers must follow"),
    Setting("hedge_tail", boolean, "near the end, also send slow servers' work to idle ones", True),
    Setting(
        "adaptive",
        boolean,
        "size what each server holds from its /metrics, so none queues work another could "
        "start sooner; default off: what each server holds grows with its answers up to "
        "batch_size x batches",
        False,
    ),
    Setting(
        "prefix_affinity",
        boolean,
        "send rows that share a prompt prefix (one --group-by value) to one server while "
        "it has room, so its prefix cache holds the shared part; each server first gets "
        "the template's text before its first field once",
        False,
    ),
    Setting(
        "api_key_file",
        text,
        "a file holding the servers' API key (for vLLM started with --api-key); "
        "default: $VLLM_API_KEY if set",
    ),
    Setting("api_key_env", text, "the name of an environment variable holding the API key"),
    Setting(
        "ca_bundle", text, "a PEM file of the authority that signed the servers' TLS certificates"
    ),
    Setting(
        "verify_tls",
        boolean,
        "check https servers' certificates (default); --no-verify-tls skips the check",
        True,
    ),
    Setting(
        "timeout",
        SECONDS,
        f"seconds one request may take, answer included (default {default.TIMEOUT:g})",
        default.TIMEOUT,
    ),
    Setting(
        "max_response_bytes",
        POSITIVE_INT,
        "largest answer read from a server, in bytes (default 16 MiB)",
        default.MAX_RESPONSE_BYTES,
    ),
    Setting(
        "max_server_faults",
        POSITIVE_INT,
        "answers in a row that are a server's fault (garbage, 5xx, cut off) that evict it "
        f"(default {default.MAX_SERVER_FAULTS})",
        default.MAX_SERVER_FAULTS,
    ),
    Setting(
        "stall_window",
        SECONDS,
        "least seconds a server may hold requests and answer none before it is taken for "
        f"hung (default {default.STALL_WINDOW:g})",
        default.STALL_WINDOW,
    ),
    Setting(
        "stop_grace",
        GRACE,
        f"seconds in-flight requests get after a signal (default {default.STOP_GRACE:g})",
        default.STOP_GRACE,
    ),
    Setting(
        "all_down_timeout",
        SECONDS,
        f"seconds to wait when every server is down (default {default.ALL_DOWN_TIMEOUT:g})",
        default.ALL_DOWN_TIMEOUT,
    ),
    Setting(
        "log_format",
        _log_format,
        "json or console: every log record on stderr in this format (default: stderr has "
        "the progress and, in words, the warnings only); with --log-file, the file's format",
    ),
    Setting(
        "log_file",
        text,
        "append every log record to this file (JSON unless --log-format console); stderr "
        "keeps the progress and the warnings in words",
    ),
    Setting(
        "processes",
        _processes,
        "for a corpus: worker processes on this machine, which take its units by claims "
        "and share each server's in-flight budget (default auto: one per 8 servers, at "
        "most one per core)",
    ),
    Setting(
        "metrics_port",
        number(integer=True, low=0, high=65535),
        "serve live Prometheus metrics of the job on this port (0: any free port)",
    ),
    Setting(
        "metrics_host",
        text,
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
    add_settings(parser, SETTINGS)
    parser.set_defaults(handler=run_command, human_lines=HUMAN_LINES)


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """The job's settings: the TOML file's, overridden by the flags given.

    Raises:
        ConfigurationError: An unreadable file, an unknown key, a value of the wrong
            type, or a required setting missing.
    """
    from llm_annotator.cli._offline import SERVER_SETTINGS, check_offline_settings
    from llm_annotator.cli.settings import converted

    known = {s.flag: s for s in SETTINGS}
    merged: dict[str, Any] = {s.flag: s.default for s in SETTINGS}
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
    check_offline_settings(merged, {s.flag: s.default for s in SETTINGS})
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


def run_command(args: argparse.Namespace) -> int:
    """Run the job; the exit status is 0 when it finished, 128+signal when stopped."""
    from llm_annotator.cli._offline import offline_client
    from llm_annotator.jobs.annotate import Annotator
    from llm_annotator.jobs.rows.corpus import is_corpus, list_corpus
    from llm_annotator.jobs.rows.inputs import open_input

    settings = settings_from(args)
    job = job_keywords(settings)  # a bad schema, hook or shard is said before any server
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
        client = pool_from(settings)
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
            data, settings["prompt_template"], settings["output_dir"], **job
        )
    except ENDINGS as error:
        kept = "rows already written are kept and not sent again"
        return exit_code(error, command="run", output_dir=settings["output_dir"], kept=kept)
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
            from llm_annotator.jobs.run_directory import RunDirectory

            mode = RunDirectory.open(settings["output_dir"]).corpus_mode()
            alone = mode is not None and mode != "claim"
        return 1 if alone else default_processes(len(settings["servers"] or []))
    if asked > 1 and (shard not in ("", "claim") or settings["offline_model"]):
        raise ConfigurationError(
            "--processes: workers take a corpus's units by claims; leave out --shard "
            "INDEX/COUNT and --offline-model"
        )
    return asked


def _print_corpus(run_dir: Path) -> None:
    """What a corpus job's workers made, from its manifest."""
    from llm_annotator.jobs.run_directory import RunDirectory

    directory = RunDirectory.open(run_dir)
    manifest = directory.manifest() or {}
    print(f"annotations: {directory.output}")
    print(
        f"rows: {manifest.get('rows')} ({manifest.get('succeeded')} succeeded, "
        f"{manifest.get('failed')} failed) in {manifest.get('units_done')} of "
        f"{manifest.get('units')} units"
    )


_MOVED = {
    "converted": "llm_annotator.cli.settings.converted",
    "options_from": "llm_annotator.cli.settings.options_from",
    "load_validator": "llm_annotator.cli.settings.load_validator",
    "api_key_from": "llm_annotator.cli.settings.api_key_from",
    "verify_from": "llm_annotator.cli.settings.verify_from",
    "_pool": "llm_annotator.cli.settings.pool_from",
    "_SETTINGS": "llm_annotator.cli.run.SETTINGS",
}
"""The names this module had that live elsewhere now, each with its new path."""


def __getattr__(name: str) -> Any:
    """A name of :data:`_MOVED` at its old path, for a release, with a
    :class:`DeprecationWarning`."""
    moved = _MOVED.get(name)
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"{__name__}.{name} moved to {moved}; the old path goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    if moved == f"{__name__}.SETTINGS":
        return SETTINGS
    from llm_annotator.cli import settings

    return getattr(settings, moved.rpartition(".")[2])
