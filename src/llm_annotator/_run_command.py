"""``llm-annotator run``: an annotation job from flags, a TOML file, or both.

Every flag has a key of the same name in the file (``--max-completion-tokens`` is
``max_completion_tokens``); a flag given on the command line wins over the file.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions
from llm_annotator.errors import (
    ConfigurationError,
    PoolExhaustedError,
    RunInterruptedError,
)
from llm_annotator.jobs.schema import OutputSchema
from llm_annotator.pool.discovery import (
    DirectorySource,
    DnsSource,
    FileSource,
    ServerDiscovery,
    ServerSource,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _Setting:
    flag: str
    kind: Callable[[Any], Any]
    help: str
    default: Any = None
    nargs: str | None = None


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigurationError(f"expected true or false, got {value!r}")


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise ConfigurationError(f"expected a list of strings, got {value!r}")


_SETTINGS: tuple[_Setting, ...] = (
    _Setting("servers", _strings, "vLLM base URLs (http://host:port/v1)", nargs="+"),
    _Setting("servers_file", str, "a file of base URLs, one a line, re-read during the run"),
    _Setting("servers_dir", str, "a folder where each server writes <name>.url when healthy"),
    _Setting("servers_dns", str, "NAME:PORT, a DNS name resolving to every server"),
    _Setting("input", str, "the dataset: .jsonl, .parquet or .csv"),
    _Setting("prompt_template", str, "the user message, with {column} fields"),
    _Setting("output_dir", str, "the run directory; run again to resume"),
    _Setting("id_column", str, "column with each row's id (default: the row's position)"),
    _Setting("system_message", str, "a system message for every row"),
    _Setting("columns", _strings, "input columns to keep in the output (default: all)", nargs="+"),
    _Setting("model", str, "model name (default: what the servers serve)"),
    _Setting("batch_size", int, "rows per batch (default 256)", 256),
    _Setting(
        "max_concurrent_batches_per_client", int, "batches in flight per server (default 4)", 4
    ),
    _Setting("max_completion_tokens", int, "upper bound on generated tokens"),
    _Setting("temperature", float, "sampling temperature (default: the model's)"),
    _Setting("top_p", float, "nucleus sampling (default: the model's)"),
    _Setting("seed", int, "random seed for reproducible sampling"),
    _Setting("output_schema", str, "JSON schema file the answers must follow"),
    _Setting("max_regenerations", int, "with a schema: retries of invalid answers (default 2)", 2),
    _Setting("retry_errors", _bool, "send again the rows that ended in error", False),
    _Setting("force", _bool, "resume even if the directory was made with other settings", False),
    _Setting("jsonl", _bool, "also write annotations.jsonl", False),
    _Setting("hedge_tail", _bool, "near the end, also send slow servers' work to idle ones", True),
    _Setting(
        "stop_grace", float, "seconds in-flight requests get after a signal (default 30)", 30.0
    ),
    _Setting(
        "all_down_timeout", float, "seconds to wait when every server is down (default 300)", 300.0
    ),
    _Setting("log_format", str, "json or console (default: console on a terminal)"),
)
_REQUIRED = ("input", "prompt_template", "output_dir")


def add_run(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Declare ``llm-annotator run``."""
    parser = subparsers.add_parser(
        "run",
        help="annotate a dataset over vLLM servers (resumable)",
        description=(
            "Annotate every row of a dataset over a pool of vLLM servers into an output "
            "directory. Results are written as they arrive; running the same command "
            "again resumes the job. A TOML file given with --config sets the same "
            "settings (flag names with underscores); flags override it."
        ),
    )
    parser.add_argument("--config", default=None, help="a TOML job file")
    for setting in _SETTINGS:
        flag = "--" + setting.flag.replace("_", "-")
        if setting.kind is _bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=setting.help
            )
        elif setting.nargs:
            parser.add_argument(flag, nargs=setting.nargs, default=None, help=setting.help)
        else:
            parser.add_argument(flag, type=setting.kind, default=None, help=setting.help)
    parser.set_defaults(handler=run_command)


def settings_from(args: argparse.Namespace) -> dict[str, Any]:
    """The job's settings: the TOML file's, overridden by the flags given.

    Raises:
        ConfigurationError: An unreadable file, an unknown key, a value of the wrong
            type, or a required setting missing.
    """
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
            try:
                merged[name] = known[name].kind(value)
            except (TypeError, ValueError) as exc:
                raise ConfigurationError(f"{path}: setting {key!r}: {exc}") from exc
    for name in known:
        value = getattr(args, name, None)
        if value is not None:
            merged[name] = value
    missing = [name for name in _REQUIRED if not merged.get(name)]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ConfigurationError(f"missing {flags} (give the flags or set them in --config)")
    if not any(merged.get(k) for k in ("servers", "servers_file", "servers_dir", "servers_dns")):
        raise ConfigurationError(
            "give the servers: --servers URL [URL ...], --servers-file FILE, "
            "--servers-dir DIR or --servers-dns NAME:PORT"
        )
    if merged["log_format"] not in (None, "json", "console"):
        raise ConfigurationError(
            f"--log-format must be json or console, got {merged['log_format']!r}"
        )
    return merged


def run_command(args: argparse.Namespace) -> int:
    """Run the job; the exit status is 0 when it finished, 128+signal when stopped."""
    from llm_annotator.jobs.annotate import Annotator
    from llm_annotator.pool.annotator import VLLMQueueAnnotator

    settings = settings_from(args)
    schema = None
    if settings["output_schema"]:
        schema = OutputSchema.from_file(settings["output_schema"]).schema
    options = VLLMOnlineRuntimeOptions(
        max_completion_tokens=settings["max_completion_tokens"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        seed=settings["seed"],
        output_schema=schema,
    )
    pool = VLLMQueueAnnotator(
        settings["servers"] or [],
        discovery=_discovery(settings),
        model=settings["model"],
        batch_size=settings["batch_size"],
        max_concurrent_batches_per_client=settings["max_concurrent_batches_per_client"],
        all_down_timeout=settings["all_down_timeout"],
        hedge_tail=settings["hedge_tail"],
    )
    annotator = Annotator(pool, stop_grace=settings["stop_grace"])
    try:
        result = annotator.annotate(
            settings["input"],
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
        )
    except RunInterruptedError as stopped:
        print(f"llm-annotator run: {stopped}", file=sys.stderr, flush=True)
        return 128 + (stopped.signum or int(signal.SIGINT))
    except PoolExhaustedError as exhausted:
        print(
            f"llm-annotator run: {exhausted}\nEverything completed is written in "
            f"{settings['output_dir']}; run the same command again to resume.",
            file=sys.stderr,
            flush=True,
        )
        return 3
    finally:
        pool.close()
    print(f"annotations: {result.output_path}")
    if result.jsonl_path is not None:
        print(f"annotations (JSONL): {result.jsonl_path}")
    print(f"report: {result.report_path}")
    print(
        f"rows: {result.num_rows} ({result.num_succeeded} succeeded, {result.num_failed} "
        f"failed); this run sent {result.num_sent}, resumed {result.num_resumed}, "
        f"in {result.seconds:.1f} s"
    )
    return 0


def _discovery(settings: dict[str, Any]) -> ServerDiscovery | None:
    """The server sources the settings name, re-read during the run."""
    sources: list[ServerSource] = []
    if settings["servers_file"]:
        sources.append(FileSource(Path(settings["servers_file"])))
    if settings["servers_dir"]:
        sources.append(DirectorySource(Path(settings["servers_dir"])))
    if settings["servers_dns"]:
        sources.append(DnsSource.parse(settings["servers_dns"]))
    return ServerDiscovery(sources) if sources else None
