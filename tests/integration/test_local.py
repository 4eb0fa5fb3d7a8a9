"""Real vLLM servers started, broken and stopped by llm_annotator.local and the CLI."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llm_annotator.errors import ConfigurationError
from llm_annotator.local import (
    COMPLETE_STAMP,
    LocalServer,
    LocalServerError,
    LocalServers,
    ensure_tiny_model,
)

pytestmark = pytest.mark.integration

StartVLLM = Callable[..., LocalServers]

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    with _NO_PROXY.open(url, timeout=timeout) as response:
        return response.status, response.read()


def _post_json(url: str, body: dict[str, object], timeout: float = 30.0) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with _NO_PROXY.open(request, timeout=timeout) as response:
        assert response.status == 200
        result: dict[str, object] = json.loads(response.read())
        return result


def _refuses(port: int) -> bool:
    """Whether a TCP connection to the port on 127.0.0.1 is refused."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0):
            return False
    except ConnectionRefusedError:
        return True


def _group_gone(pgid: int) -> bool:
    """Whether no live (non-zombie) process is left in the process group."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            return False
    return True


def test_tiny_model_is_written_once(vllm_python: str, tmp_path: Path) -> None:
    """The tiny model folder gets its files and stamp; a second call leaves it untouched."""
    target = tmp_path / "tiny"
    assert ensure_tiny_model(target, python=vllm_python) == target
    names = {p.name for p in target.iterdir()}
    assert {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        COMPLETE_STAMP,
    } <= names
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 32
    before = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    assert ensure_tiny_model(target, python=vllm_python) == target
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_tiny_model_is_the_same_every_time(vllm_python: str, tmp_path: Path) -> None:
    """Two separate writes of the tiny model give byte-identical files."""
    first = ensure_tiny_model(tmp_path / "a", python=vllm_python)
    second = ensure_tiny_model(tmp_path / "b", python=vllm_python)
    for path in first.iterdir():
        if path.name != COMPLETE_STAMP:
            assert path.read_bytes() == (second / path.name).read_bytes(), path.name


def test_tiny_model_refuses_a_folder_with_other_files(vllm_python: str, tmp_path: Path) -> None:
    """A non-empty folder that is not a tiny model is not overwritten."""
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigurationError, match="not an empty folder"):
        ensure_tiny_model(tmp_path, python=vllm_python)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_cli_tiny_model_writes_the_folder(vllm_python: str, tmp_path: Path) -> None:
    """`llm-annotator tiny-model DIR` writes the model and prints its folder."""
    command = Path(sys.executable).with_name("llm-annotator")
    result = subprocess.run(
        [str(command), "tiny-model", str(tmp_path / "tiny"), "--python", vllm_python],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "tiny")
    assert (tmp_path / "tiny" / COMPLETE_STAMP).is_file()


def test_servers_are_healthy_and_answer_chat(vllm_servers: LocalServers) -> None:
    """Started servers answer /health 200, list the model and complete a conversation."""
    assert len(vllm_servers) == 2
    assert len({server.port for server in vllm_servers}) == 2
    for server in vllm_servers:
        assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
        assert server.is_running()
        assert _get(f"http://127.0.0.1:{server.port}/health") == (200, b"")
        status, body = _get(f"{server.base_url}/models")
        assert status == 200
        assert [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
        answer = _post_json(
            f"{server.base_url}/chat/completions",
            {
                "model": vllm_servers.model,
                "messages": [
                    {"role": "system", "content": "Label the sentiment."},
                    {"role": "user", "content": "I loved this film!"},
                ],
                "max_tokens": 8,
                "seed": 7,
            },
        )
        choices = answer["choices"]
        assert isinstance(choices, list)
        assert isinstance(choices[0]["message"]["content"], str)
        assert choices[0]["finish_reason"] in ("stop", "length")


def test_pause_makes_health_time_out_and_resume_restores_it(
    vllm_servers: LocalServers,
) -> None:
    """A paused server (engine included) hangs instead of refusing; resumed, it answers."""
    server = vllm_servers[1]
    server.pause()
    try:
        assert "paused" in repr(server)
        start = time.monotonic()
        assert not server.is_healthy(timeout=1.0)
        assert time.monotonic() - start >= 0.9  # a timeout, not a refusal
        assert not _refuses(server.port)
    finally:
        server.resume()
    server.wait_healthy(timeout=30.0)
    assert server.is_healthy()  # it answers again once resumed
    assert "running" in repr(server)


def test_kill_makes_the_port_refuse_and_ends_the_engine(start_vllm: StartVLLM) -> None:
    """kill() ends the server and its engine processes at once; the port then refuses."""
    (server,) = start_vllm(1)
    server.kill()
    assert not server.is_running()
    assert server.returncode == -signal.SIGKILL
    assert _refuses(server.port)
    deadline = time.monotonic() + 10.0
    while not _group_gone(server.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _group_gone(server.pid)


def test_start_one_more_then_stop_ends_every_process_group(start_vllm: StartVLLM) -> None:
    """A server added later is healthy too; stop() shuts down all of them and their engines."""
    servers = start_vllm(1)
    extra = servers.start_one_more()
    assert len(servers) == 2
    assert servers[1] is extra
    assert extra.port != servers[0].port
    assert extra.is_healthy()
    servers.stop(grace=10.0)
    for server in servers:
        assert not server.is_running()
        assert _refuses(server.port)
        assert _group_gone(server.pid)
    servers.stop()  # a second stop is harmless


def test_invalid_argument_fails_start_up_with_the_log(start_vllm: StartVLLM) -> None:
    """A server that exits during start-up raises, quoting its log, and nothing is left."""
    with pytest.raises(LocalServerError, match="no-such-flag") as caught:
        start_vllm(1, extra_args=["--no-such-flag"])
    error = caught.value
    assert "during start-up" in str(error)
    assert error.returncode not in (None, 0)
    assert error.log_path.is_file()


def test_broken_model_folder_fails_start_up_with_the_log(
    start_vllm: StartVLLM, tmp_path: Path
) -> None:
    """A model folder vLLM cannot load makes start-up fail with the log's last lines."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["NoSuchModel"], "model_type": "x"}')
    with pytest.raises(LocalServerError) as caught:
        start_vllm(1, model=broken, startup_timeout=120.0)
    message = str(caught.value)
    assert "during start-up" in message
    assert len(message.splitlines()) > 5


def test_start_up_timeout_stops_the_servers(start_vllm: StartVLLM) -> None:
    """When servers are not healthy in time, start-up raises and stops them all."""
    launched: list[LocalServer] = []
    original = LocalServer.launch

    def recording_launch(*args: Any, **kwargs: Any) -> LocalServer:
        server = original(*args, **kwargs)
        launched.append(server)
        return server

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LocalServer, "launch", recording_launch)
        with pytest.raises(LocalServerError, match="did not become healthy within 2 s"):
            start_vllm(1, startup_timeout=2.0)
    assert len(launched) == 1
    assert not launched[0].is_running()
    assert _group_gone(launched[0].pid)


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    """Read one line of the process's stdout, failing after ``timeout`` seconds."""
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            pytest.fail(f"no output within {timeout} s")
    return process.stdout.readline().strip()


def test_cli_serve_local_prints_urls_and_stops_on_sigterm(
    vllm_python: str, tiny_model: Path, tmp_path: Path
) -> None:
    """serve-local prints a healthy base URL, then SIGTERM stops it and its server cleanly."""
    command = Path(sys.executable).with_name("llm-annotator")
    env = dict(os.environ, LLM_ANNOTATOR_VLLM_PYTHON=vllm_python)
    process = subprocess.Popen(
        [
            str(command),
            "serve-local",
            "--num-servers",
            "1",
            "--model",
            str(tiny_model),
            "--log-dir",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        url = _read_line(process, timeout=240.0)
        assert url.startswith("http://127.0.0.1:")
        assert url.endswith("/v1")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert _get(f"http://127.0.0.1:{port}/health") == (200, b"")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60.0) == 0
        assert _refuses(port)
    finally:
        _end_cli(process)


def _children(pid: int) -> list[int]:
    """The ids of the live processes whose parent is ``pid``."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            children.append(int(stat.parent.name))
    return children


def _end_cli(process: subprocess.Popen[str]) -> None:
    """Make sure the CLI and the servers it started (group leaders) are gone."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            for child in _children(process.pid):
                os.killpg(child, signal.SIGKILL)
            process.kill()
            process.wait()
    assert process.stdout is not None
    process.stdout.close()
