"""API keys: which key goes to which server, a refused key stops a job before anything is
sent, and a key never shows in any output, even when a server quotes it back.

The servers are the socket-level fakes of ``tests/misbehaving.py``, which check the
``Authorization`` header the way vLLM started with ``--api-key`` does.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog

from llm_annotator import (
    OpenAIClient,
    PoolExhaustedError,
    ServersUnusableError,
    VLLMOnlineClient,
    VLLMQueueAnnotator,
)
from llm_annotator.pool.discovery import FileSource, ServerDiscovery
from tests.cli import run_job
from tests.misbehaving import RawServer, completion_body, head, raw_server, whole

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
    client: OpenAIClient[Any]
    with OpenAIClient(model="m", base_url=servers[0].base_url) as client:
        client.generate(messages=MESSAGES)
    assert keys_seen(servers[0]) == {"Bearer sk-openai"}


def test_pool_sends_one_key_to_all_or_each_server_its_own(
    servers: list[RawServer], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """api_key= is one key for every server, or a mapping from base URL to key; a server
    the mapping does not name (here a discovered one) gets VLLM_API_KEY."""
    a, b, c = servers
    # No tail hedging here: a losing duplicate could still reach a server after the call.
    # A member takes work as soon as it joins: call again until both have had some.
    with VLLMQueueAnnotator(
        [a.base_url, b.base_url], api_key="one", batch_size=4, hedge_tail=False
    ) as pool:
        deadline = time.monotonic() + 60
        while not (a.chat_requests and b.chat_requests) and time.monotonic() < deadline:
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
        deadline = time.monotonic() + 60  # bounded; discovery adds c within a second or two
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

        header = request.headers.get("authorization", "")  # type: ignore[attr-defined]
        if status == 200:
            data = b'{"choices": "not a list", "echo": "' + header.encode() + b'"}'
        else:
            data = orjson.dumps({"error": {"message": f"rejected header {header!r}"}})
        writer.write(head(status, length=len(data)) + data)  # type: ignore[attr-defined]

    return answer


def run_with_key_from_env(
    server: RawServer, tmp_path: Path, rows: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    """``llm-annotator run`` of ``rows`` rows against ``server`` into ``tmp_path/run``,
    the key taken from ``ANNOTATOR_TEST_KEY``."""
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"text": f"t{i}"}) + b"\n" for i in range(rows)))
    key_from_env = ("--api-key-env", "ANNOTATOR_TEST_KEY", "--jsonl", *extra)
    return run_job(server.base_url, data, tmp_path / "run", *key_from_env, timeout=120)


def places_holding(
    key: str, done: subprocess.CompletedProcess[str], run_dir: Path, shown: dict[str, str]
) -> list[str]:
    """Where ``key`` appears in clear: the command's stdout or stderr, any file of the
    run directory, or one of the ``shown`` texts (logs, reprs, responses)."""
    outputs = {"stdout": done.stdout, "stderr": done.stderr, **shown}
    for path in run_dir.rglob("*"):
        if path.is_file():
            outputs[str(path)] = path.read_bytes().decode("utf-8", errors="replace")
    return [where for where, text in outputs.items() if key in text]


@pytest.mark.parametrize("status", [400, 500, 200], ids=["400", "500", "200-malformed"])
def test_a_key_quoted_back_never_reaches_any_output(
    status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that quotes the key in its error bodies: the key is in no log line, no
    line of the command's output, no file of the run directory, no repr and no error.

    A 400 is the sample's fault: error rows. A 500 or a malformed 200 is the server's:
    the only member is evicted, the job stops after all_down_timeout with nothing
    written as a final row (a resume sends the rows again)."""
    servers_fault = status != 400
    monkeypatch.setenv("ANNOTATOR_TEST_KEY", PLANTED)
    with raw_server(quoting_server_answer(status)) as server:  # type: ignore[arg-type]
        done = run_with_key_from_env(server, tmp_path, 6, "--all-down-timeout", "1")
        quoted = [r for r in server.chat_requests if PLANTED in r.headers["authorization"]]
        with VLLMQueueAnnotator([server.base_url], api_key=PLANTED, all_down_timeout=1) as pool:
            with structlog.testing.capture_logs() as logs:
                try:
                    responses: list[object] = list(pool.batch_generate(messages=[MESSAGES] * 2))
                except PoolExhaustedError as exc:
                    assert servers_fault
                    responses = [str(exc), exc.servers, exc.responses]
            shown = [
                repr(pool),
                str(pool.statistics()),
                repr(pool._state.members[server.base_url].client),
            ]
    assert quoted, "the server never saw the key, so nothing was planted"
    assert done.returncode == (3 if servers_fault else 0), done.stderr[-3000:]  # 3: exhausted
    assert "Traceback" not in done.stderr
    rows = tmp_path / "run" / "annotations.jsonl"
    assert "[redacted]" in done.stderr + (rows.read_text() if rows.exists() else "")
    shown_outputs = {"logs": repr(logs), "responses": repr(responses), "reprs": " ".join(shown)}
    assert places_holding(PLANTED, done, tmp_path / "run", shown_outputs) == []
    if servers_fault:
        assert responses[2] == [None, None]  # nothing final: the servers were at fault
        assert "no server of the pool could take work" in str(responses[0])
    else:
        assert {r.error_type for r in responses} == {"bad_request"}  # type: ignore[attr-defined]


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
    done = run_job(
        server.base_url,
        data,
        tmp_path / "run",
        "--api-key-file",
        str(key_file),
        template="{text}",
        timeout=60,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    final = [line for line in done.stderr.splitlines() if line.startswith("llm-annotator run:")]
    assert len(final) == 1, done.stderr[-2000:]  # one error line, beside the JSON logs
    assert server.base_url in final[0] and "HTTP 401" in final[0]
    assert "--api-key-file" in final[0]
    assert server.chat_requests == []


def echo_key(kind: str, padding: int) -> object:
    """A server that quotes the Authorization header back, after ``padding`` bytes."""

    async def answer(writer: object, request: object) -> None:

        header = request.headers.get("authorization", "")  # type: ignore[attr-defined]
        quoted = "p" * padding + header
        if kind == "garbage":  # not HTTP at all: the parser's error quotes the bytes
            writer.write(f"HTTP/1.1 {quoted}\r\n\r\n".encode())  # type: ignore[attr-defined]
            writer.close()  # type: ignore[attr-defined]
            return
        if kind == "success":
            data = completion_body(f"your header was {quoted}")
        else:
            data = orjson.dumps({"error": {"message": quoted, "type": "BadRequestError"}})
        status = 200 if kind == "success" else 400
        writer.write(head(status, length=len(data)) + data)  # type: ignore[attr-defined]

    return answer


@pytest.mark.parametrize("padding", [0, 180, 470, 3000], ids=lambda n: f"at-{n}")
@pytest.mark.parametrize("kind", ["error", "success", "garbage"])
async def test_a_quoted_key_is_redacted_wherever_it_falls(kind: str, padding: int) -> None:
    """Wherever a server puts the key (an error body, a successful answer, bytes that are
    not HTTP), at whatever offset (across the points where messages are cut), it is in
    no Response, error message or traceback: the body is redacted before it is read."""
    import traceback

    from llm_annotator import ProviderError

    with raw_server(echo_key(kind, padding)) as server:  # type: ignore[arg-type]
        async with VLLMOnlineClient(
            model="m", base_url=server.base_url, api_key=PLANTED, max_retries=0
        ) as client:
            response = await client.agenerate(messages=MESSAGES)
        async with VLLMOnlineClient(
            model="m", base_url=server.base_url, api_key=PLANTED, max_retries=0, on_error="raise"
        ) as client:
            try:
                await client.agenerate(messages=MESSAGES)
            except ProviderError as error:
                shown = "".join(traceback.format_exception(error))
            else:
                shown = ""
        assert server.chat_requests, "nothing was planted"
    assert PLANTED not in repr(response)
    assert PLANTED not in shown
    assert PLANTED[:12] not in repr(response) + shown  # no half of it either
    if kind == "success":
        assert response.ok and "[redacted]" in (response.text or "")
    else:
        assert not response.ok


def test_credentials_in_a_url_are_refused_without_showing_them() -> None:
    """http://user:password@host is refused (the password would be in every log line and
    result row), and the message does not repeat the password."""
    from llm_annotator import ConfigurationError

    with pytest.raises(ConfigurationError, match="api_key") as caught:
        VLLMOnlineClient(base_url="http://user:hunter2@127.0.0.1:8000/v1")
    assert "hunter2" not in str(caught.value)
    with pytest.raises(ConfigurationError):
        VLLMQueueAnnotator(["http://user:hunter2@127.0.0.1:8000/v1"])


@pytest.mark.parametrize("key", ["sk-abc\n", "sk abc", "sk-ключ", "sk\x00"])
def test_a_key_that_cannot_be_a_header_is_refused_at_once(key: str) -> None:
    """A key with a newline (a key file's last line), a space, or a non-ASCII character is
    refused when the client is made, without showing the key, not at every request."""
    from llm_annotator import ConfigurationError

    with pytest.raises(ConfigurationError, match="API key") as caught:
        VLLMOnlineClient(base_url="http://127.0.0.1:8000/v1", api_key=key)
    assert key not in str(caught.value)


def test_the_environment_key_may_end_in_a_newline(
    servers: list[RawServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """VLLM_API_KEY from a secret file often ends in a newline: it is stripped."""
    monkeypatch.setenv("VLLM_API_KEY", "from-secret\n")
    with VLLMOnlineClient(model="m", base_url=servers[0].base_url) as client:
        assert client.generate(messages=MESSAGES).ok
    assert keys_seen(servers[0]) == {"Bearer from-secret"}


def json_spellings(key: str) -> list[bytes]:
    """The key as a server may spell it inside a JSON string: all escaped, every other
    character escaped (upper-case hex), and only its first character escaped."""
    every = b"".join(b"\\u%04x" % ord(c) for c in key)
    mixed = b"".join(b"\\u%04X" % ord(c) if i % 2 else c.encode() for i, c in enumerate(key))
    first = b"\\u%04x" % ord(key[0]) + key[1:].encode()
    return [every, mixed, first]


def escaping_server_answer(status: int) -> object:
    """Answers that quote the key back JSON-escaped: in a 200's text and reasoning, or
    in a 400's error message."""

    async def answer(writer: object, request: object) -> None:
        every, mixed, first = json_spellings(PLANTED)
        if status == 200:
            data = completion_body("@CONTENT@").replace(
                b'"@CONTENT@"', b'"your key: ' + every + b'", "reasoning_content": "' + mixed + b'"'
            )
        else:
            data = b'{"error": {"message": "rejected key ' + first + b'"}}'
        writer.write(head(status, length=len(data)) + data)  # type: ignore[attr-defined]

    return answer


@pytest.mark.parametrize("status", [200, 400], ids=["200-text-and-reasoning", "400-message"])
def test_a_key_quoted_back_json_escaped_is_redacted_from_decoded_values(
    status: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key a server quotes back in JSON escapes (``\\u0073\\u006b...``, any mix of
    escaped and plain characters, hex in either case) is in no answer's text, reasoning
    or error, no file of the run directory and no log line."""
    monkeypatch.setenv("ANNOTATOR_TEST_KEY", PLANTED)
    with raw_server(escaping_server_answer(status)) as server:  # type: ignore[arg-type]
        done = run_with_key_from_env(server, tmp_path, 4)
        with (
            structlog.testing.capture_logs() as logs,
            VLLMQueueAnnotator([server.base_url], api_key=PLANTED) as pool,
        ):
            responses = pool.batch_generate(messages=[MESSAGES] * 2)
    assert done.returncode == 0, done.stderr[-3000:]
    decoded = [(r.text, r.reasoning, r.error) for r in responses]
    if status == 200:
        assert all(r.ok for r in responses)
        assert all(text == "your key: [redacted]" for text, _, _ in decoded)
        assert all(reasoning == "[redacted]" for _, reasoning, _ in decoded)
    else:
        assert all("[redacted]" in str(error) for _, _, error in decoded)
    rows = (tmp_path / "run" / "annotations.jsonl").read_text()
    assert "[redacted]" in rows
    shown_outputs = {"logs": repr(logs), "responses": repr(decoded)}
    assert places_holding(PLANTED, done, tmp_path / "run", shown_outputs) == []
