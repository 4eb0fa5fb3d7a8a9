"""API keys: which key goes to which server, a refused key stops a job before anything is
sent, and a key never shows in any output, even when a server quotes it back.

The servers are the socket-level fakes of ``tests/misbehaving.py``, which check the
``Authorization`` header the way vLLM started with ``--api-key`` does.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import structlog

from llm_annotator import (
    OpenAIClient,
    ServersUnusableError,
    VLLMOnlineClient,
    VLLMQueueAnnotator,
)
from llm_annotator.pool.discovery import FileSource, ServerDiscovery
from tests.misbehaving import RawServer, completion_body, raw_server, whole

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))
MESSAGES = [{"role": "user", "content": "hi"}]
PLANTED = "sk-planted-7f3a9c1e5b"


@pytest.fixture
def servers() -> Iterator[list[RawServer]]:
    """Three answering servers, each expecting no key until a test sets one."""
    with (
        raw_server(whole(completion_body("ok"))) as a,
        raw_server(whole(completion_body("ok"))) as b,
        raw_server(whole(completion_body("ok"))) as c,
    ):
        yield [a, b, c]


def keys_seen(server: RawServer) -> set[str | None]:
    return {r.headers.get("authorization") for r in server.chat_requests}


def test_vllm_client_reads_vllm_api_key_and_never_openai_api_key(
    servers: list[RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """VLLMOnlineClient takes VLLM_API_KEY (what vLLM's server reads); OPENAI_API_KEY,
    meant for another service, is never sent to a vLLM server."""
    server = servers[0]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    with VLLMOnlineClient(model="m", base_url=server.base_url) as client:
        client.generate(messages=MESSAGES)
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    with VLLMOnlineClient(model="m", base_url=server.base_url) as client:
        client.generate(messages=MESSAGES)
    with VLLMOnlineClient(model="m", base_url=server.base_url, api_key="given") as client:
        client.generate(messages=MESSAGES)
    assert [r.headers.get("authorization") for r in server.chat_requests] == [
        None,
        "Bearer vllm-key",
        "Bearer given",
    ]


def test_openai_client_keeps_openai_api_key(
    servers: list[RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenAIClient, for OpenAI-compatible services, still reads OPENAI_API_KEY."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    monkeypatch.setenv("VLLM_API_KEY", "vllm-key")
    with OpenAIClient(model="m", base_url=servers[0].base_url) as client:
        client.generate(messages=MESSAGES)
    assert keys_seen(servers[0]) == {"Bearer sk-openai"}


def test_pool_sends_one_key_to_all_or_each_server_its_own(
    servers: list[RawServer], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """api_key= is one key for every server, or a mapping from base URL to key; a server
    the mapping does not name (here a discovered one) gets VLLM_API_KEY."""
    a, b, c = servers
    with VLLMQueueAnnotator([a.base_url, b.base_url], api_key="one", batch_size=4) as pool:
        pool.batch_generate(messages=[MESSAGES] * 16)
    assert keys_seen(a) == keys_seen(b) == {"Bearer one"}

    for server in servers:
        server.requests.clear()
    monkeypatch.setenv("VLLM_API_KEY", "env-default")
    listed = tmp_path / "servers.txt"
    listed.write_text(c.base_url + "\n", encoding="utf-8")
    keys = {a.base_url + "/": "key-a", b.base_url: "key-b"}  # any spelling of the URL
    with VLLMQueueAnnotator(
        [a.base_url, b.base_url],
        api_key=keys,
        batch_size=2,
        discovery=ServerDiscovery([FileSource(listed)], interval=0.2),
    ) as pool:
        deadline = time.monotonic() + 20
        while not c.chat_requests and time.monotonic() < deadline:
            pool.batch_generate(messages=[MESSAGES] * 40)
    assert keys_seen(a) == {"Bearer key-a"}
    assert keys_seen(b) == {"Bearer key-b"}
    assert keys_seen(c) == {"Bearer env-default"}


@pytest.mark.parametrize("given", [None, "wrong-key"], ids=["no-key", "wrong-key"])
@pytest.mark.parametrize("model", [None, "fake-model"], ids=["discovered", "named"])
def test_a_refused_key_stops_the_pool_at_once_naming_the_server(
    servers: list[RawServer], given: str | None, model: str | None
) -> None:
    """A 401 on /v1/models, whether the model is asked for or named, stops the call
    within seconds with ServersUnusableError naming the server; no prompt is sent."""
    server = servers[0]
    server.api_key = "right-key"
    started = time.monotonic()
    with (
        VLLMQueueAnnotator([server.base_url], api_key=given, model=model) as pool,
        pytest.raises(ServersUnusableError, match="HTTP 401") as caught,
    ):
        pool.batch_generate(messages=[MESSAGES] * 4)
    assert time.monotonic() - started < 5
    assert server.base_url in str(caught.value)
    assert "API key" in str(caught.value)
    assert server.chat_requests == []


def test_one_refused_server_is_disabled_and_the_rest_work(servers: list[RawServer]) -> None:
    """In a pool where only one server refuses the key, that one is disabled (logged as
    an error) and the others do the work."""
    good, bad, _ = servers
    bad.api_key = "another-key"
    with (
        structlog.testing.capture_logs() as logs,
        VLLMQueueAnnotator([good.base_url, bad.base_url], api_key="k", batch_size=4) as pool,
    ):
        responses = pool.batch_generate(messages=[MESSAGES] * 12)
        state = pool.statistics().member(bad.base_url).state
    assert all(r.ok for r in responses)
    assert state == "disabled"
    assert bad.chat_requests == []
    assert any(e["event"] == "member_disabled" and e["server"] == bad.base_url for e in logs)


def quoting_server_answer(status: int) -> object:
    """An answer that quotes the Authorization header back, as some proxies do."""

    async def answer(writer: object, request: object) -> None:
        from tests.misbehaving import head

        header = request.headers.get("authorization", "")  # type: ignore[attr-defined]
        if status == 200:
            data = b'{"choices": "not a list", "echo": "' + header.encode() + b'"}'
        else:
            data = orjson.dumps({"error": {"message": f"rejected header {header!r}"}})
        writer.write(head(status, length=len(data)) + data)  # type: ignore[attr-defined]

    return answer


@pytest.mark.parametrize("status", [400, 500, 200], ids=["400", "500", "200-malformed"])
def test_a_key_quoted_back_never_reaches_any_output(
    status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that quotes the key in its error bodies: the key is in no log line, no
    line of the command's output, no file of the run directory, no repr and no error."""
    monkeypatch.setenv("ANNOTATOR_TEST_KEY", PLANTED)
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"text": f"t{i}"}) + b"\n" for i in range(6)))
    with raw_server(quoting_server_answer(status)) as server:  # type: ignore[arg-type]
        done = subprocess.run(
            [
                COMMAND,
                "run",
                "--servers",
                server.base_url,
                "--input",
                str(data),
                "--prompt-template",
                "Label: {text}",
                "--output-dir",
                str(tmp_path / "run"),
                "--api-key-env",
                "ANNOTATOR_TEST_KEY",
                "--log-format",
                "json",
                "--jsonl",
            ],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        quoted = [r for r in server.chat_requests if PLANTED in r.headers["authorization"]]
        with VLLMQueueAnnotator([server.base_url], api_key=PLANTED) as pool:
            with structlog.testing.capture_logs() as logs:
                responses = pool.batch_generate(messages=[MESSAGES] * 2)
            shown = [
                repr(pool),
                str(pool.statistics()),
                repr(pool._members[server.base_url].client),
            ]
    assert quoted, "the server never saw the key, so nothing was planted"
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "[redacted]" in done.stderr + (tmp_path / "run" / "annotations.jsonl").read_text()
    outputs = {"stdout": done.stdout, "stderr": done.stderr}
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            outputs[str(path)] = path.read_bytes().decode("utf-8", errors="replace")
    outputs["logs"] = repr(logs)
    outputs["responses"] = repr(responses)
    outputs["reprs"] = " ".join(shown)
    leaked = [where for where, text in outputs.items() if PLANTED in text]
    assert leaked == []
    assert {r.error_type for r in responses} == {
        "malformed_response"
        if status == 200
        else "bad_request"
        if status == 400
        else "server_error"
    }


def test_the_command_stops_on_a_refused_key_naming_the_server(
    servers: list[RawServer], tmp_path: Path
) -> None:
    """`llm-annotator run` with a key the server refuses exits 1 before anything is
    sent, names the server and the fix, and prints no traceback."""
    server = servers[0]
    server.api_key = "right"
    key_file = tmp_path / "key"
    key_file.write_text("wrong\n", encoding="utf-8")
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"text": "a"}\n')
    done = subprocess.run(
        [
            COMMAND,
            "run",
            "--servers",
            server.base_url,
            "--input",
            str(data),
            "--prompt-template",
            "{text}",
            "--output-dir",
            str(tmp_path / "run"),
            "--api-key-file",
            str(key_file),
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert server.base_url in done.stderr and "HTTP 401" in done.stderr
    assert "--api-key-file" in done.stderr
    assert server.chat_requests == []
