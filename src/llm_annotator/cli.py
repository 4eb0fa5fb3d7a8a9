"""The ``llm-annotator`` command.

Subcommands:

``run``
    Annotate a dataset over vLLM servers into an output directory, resumably.
``serve-local``
    Start local vLLM servers (on CPUs, or pinned to the GPUs of one node), print one
    base URL per line once all are healthy, and serve until SIGINT or SIGTERM.
``tiny-model``
    Write the tiny test model (no download) into a folder.
``demo``
    Annotate a built-in dataset with local servers on the tiny model.

Each subcommand is one ``_add_*`` function that declares its arguments and sets the
handler (``args.handler(args) -> int``); add a subcommand by adding such a function to
``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn, cast

import structlog

from llm_annotator._run_command import add_run
from llm_annotator.errors import LLMAnnotatorError
from llm_annotator.local import LocalServer, ensure_tiny_model, start_local_servers

log = structlog.get_logger(__name__)

Handler = Callable[[argparse.Namespace], int]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit status 1, like every other
    bad setting of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Interrupted(BaseException):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """Turn the first SIGINT or SIGTERM into :class:`_Interrupted` while the block runs.

    Later ones are ignored, so that a second Ctrl-C cannot cut the shutdown short.
    """
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if not received:
            received.append(signum)
            raise _Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM while the block runs (a shutdown in progress)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _serve_local(args: argparse.Namespace) -> int:
    ports = None
    if args.port_base is not None:
        ports = [args.port_base + i for i in range(args.num_servers)]
    servers = None
    with _signals_interrupt():
        try:
            servers = start_local_servers(
                args.num_servers,
                args.model,
                served_model_name=args.served_model_name,
                host=args.host,
                ports=ports,
                max_model_len=args.max_model_len,
                kv_cache_gib=args.kv_cache_gib,
                startup_timeout=args.startup_timeout,
                extra_args=args.vllm_arg,
                python=args.python,
                log_dir=args.log_dir,
                gpus_per_server=args.gpus_per_server,
                dtype=args.dtype,
                enforce_eager=args.enforce_eager,
                servers_dir=args.servers_dir,
            )
            for url in servers.base_urls:
                print(url, flush=True)
            _watch(servers.servers)
        except _Interrupted as interrupted:
            log.info("stopping_local_servers", signal=signal.Signals(interrupted.signum).name)
            return 0
        finally:
            if servers is not None:
                with _signals_ignored():
                    servers.stop()
    log.error("every_local_server_exited")
    return 1


def _watch(servers: Sequence[LocalServer]) -> None:
    """Block until a signal arrives or every server has exited.

    A server that exits is withdrawn at once (its URL file removed, so that an annotator
    following the folder stops sending it work), and its exit is logged.
    """
    alive = list(servers)
    tick = threading.Event()
    while alive:
        tick.wait(1.0)
        for server in list(alive):
            if not server.is_running():
                alive.remove(server)
                server.withdraw()
                log.warning(
                    "local_server_exited",
                    server=server.base_url,
                    returncode=server.returncode,
                    log=str(server.log_path),
                )


def _tiny_model(args: argparse.Namespace) -> int:
    path = ensure_tiny_model(args.directory, python=args.python)
    print(path, flush=True)
    return 0


def _model_len(text: str) -> int | None:
    """``--max-model-len``: a positive number of tokens, or ``auto`` (vLLM's default)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return value


def _add_serve_local(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve-local",
        help="start local vLLM servers and print their base URLs",
        description=(
            "Start vLLM servers on this machine, print one base URL per line once all "
            "are healthy, and serve until SIGINT or SIGTERM, then stop them. The defaults "
            "suit CPUs and the tiny test model; on a GPU node give --gpus-per-server, "
            "--dtype auto, --no-enforce-eager and --max-model-len auto."
        ),
    )
    parser.add_argument("--num-servers", type=int, default=1, help="how many (default 1)")
    parser.add_argument(
        "--model", default=None, help="model folder or name (default: the tiny test model)"
    )
    parser.add_argument("--served-model-name", default="tiny", help="default: tiny")
    parser.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    parser.add_argument(
        "--port-base", type=int, default=None, help="ports P, P+1, ... (default: free ports)"
    )
    parser.add_argument(
        "--max-model-len",
        type=_model_len,
        default=512,
        metavar="N|auto",
        help="context length in tokens (default 512); auto: the model's (GPU nodes)",
    )
    parser.add_argument(
        "--kv-cache-gib", type=int, default=1, help="per CPU server (default 1); CPU only"
    )
    parser.add_argument(
        "--gpus-per-server",
        type=int,
        default=None,
        metavar="K",
        help=(
            "GPU nodes: server i gets GPUs i*K .. i*K+K-1 (CUDA_VISIBLE_DEVICES), and "
            "tensor parallelism when K > 1 (default: CPU servers)"
        ),
    )
    parser.add_argument(
        "--dtype", default="float32", help="vLLM --dtype (default float32; GPU nodes: auto)"
    )
    parser.add_argument(
        "--no-enforce-eager",
        dest="enforce_eager",
        action="store_false",
        help="GPU nodes: let vLLM compile and use CUDA graphs (slower start, faster serving)",
    )
    parser.add_argument(
        "--servers-dir",
        default=None,
        metavar="DIR",
        help=(
            "for GPU nodes: announce each healthy server in DIR/local-<i>-port<port>.url, "
            "removed when it stops, for `llm-annotator run --servers-dir DIR`"
        ),
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--log-dir", default=None, help="default: a new temporary folder")
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra vLLM argument, repeatable (write --vllm-arg=--flag)",
    )
    _add_python(parser)
    parser.set_defaults(handler=_serve_local)


def _add_tiny_model(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "tiny-model",
        help="write the tiny test model into a folder",
        description="Write a tiny Llama (config, tokenizer, chat template; no weights).",
    )
    parser.add_argument(
        "directory", nargs="?", default=None, help="target folder (default: in the cache)"
    )
    _add_python(parser)
    parser.set_defaults(handler=_tiny_model)


def _add_python(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--python",
        default=None,
        help="Python with vLLM (default: $LLM_ANNOTATOR_VLLM_PYTHON or the cached env)",
    )


def _demo(args: argparse.Namespace) -> int:
    from llm_annotator.demo import run_demo

    # SIGTERM as SIGINT: the servers the demo started are stopped on the way out, not
    # left running (the job inside installs its own handlers while it runs).
    with _signals_interrupt():
        try:
            return run_demo(
                num_servers=args.num_servers,
                num_rows=args.rows,
                out=sys.stdout,
                base_urls=args.servers,
                output_dir=args.output_dir,
            )
        except _Interrupted as interrupted:
            print(
                f"llm-annotator demo: stopped by {signal.Signals(interrupted.signum).name}",
                file=sys.stderr,
            )
            return 128 + interrupted.signum


def _add_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="annotate a built-in dataset with local vLLM servers on the tiny model",
        description=(
            "Start local vLLM servers on the tiny model (or use --servers), send a built-in "
            "dataset through the pool, and print a sample of the answers and the figures."
        ),
    )
    parser.add_argument("--num-servers", type=int, default=2, help="default: 2")
    parser.add_argument("--rows", type=int, default=2000, help="rows to annotate (default 2000)")
    parser.add_argument(
        "--servers", nargs="+", default=[], metavar="URL", help="use running servers instead"
    )
    parser.add_argument(
        "--output-dir", default=None, help="run directory (default: a new temporary one)"
    )
    parser.set_defaults(handler=_demo)


_SUBCOMMANDS = (add_run, _add_demo, _add_serve_local, _add_tiny_model)


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
