"""The client against servers that misbehave: every answer bounded in time and size and
checked before it is believed.

Each server here is written at the socket level (``tests/misbehaving.py``), so it sends
exactly what a broken server or proxy sends: a body that trickles or never ends, one far
too large with or without a Content-Length, one cut off, one that is not a chat
completion, a redirect to another port.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from llm_annotator import (
    ErrorKind,
    PoolExhaustedError,
    Response,
    VLLMOnlineClient,
    VLLMOnlineRuntimeOptions,
    VLLMQueueAnnotator,
)
from tests.misbehaving import Request, completion_body, head, raw_server, whole

MESSAGES = [{"role": "user", "content": "hi"}]
DEADLINE = 2.0


def client(base_url: str, **kwargs: object) -> VLLMOnlineClient:
    kwargs.setdefault("timeout", 30.0)
    return VLLMOnlineClient(model="fake-model", base_url=base_url, max_retries=0, **kwargs)  # type: ignore[arg-type]


async def ask(base_url: str, **kwargs: object) -> tuple[Response, float]:
    """One request; the Response and the seconds it took."""
    async with client(base_url, **kwargs) as c:
        started = time.monotonic()
        response = await c.agenerate(messages=MESSAGES)
        return response, time.monotonic() - started


# -- one deadline per request ------------------------------------------------------------


async def trickle(writer: asyncio.StreamWriter, request: Request) -> None:
    """Headers, then one byte every 0.2 s: each read arrives well inside any gap timeout."""
    writer.write(head(200, length=100_000))
    for _ in range(600):  # bounded: two minutes at most
        writer.write(b" ")
        await writer.drain()
        await asyncio.sleep(0.2)


async def endless_chunks(writer: asyncio.StreamWriter, request: Request) -> None:
    """A chunked body that never ends, one small chunk every 20 ms."""
    writer.write(head(200, Transfer_Encoding="chunked"))
    for _ in range(6000):  # bounded: two minutes at most
        writer.write(b"10\r\n" + b" " * 16 + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.02)


async def silent(writer: asyncio.StreamWriter, request: Request) -> None:
    """Reads the request and never sends a byte."""
    await asyncio.sleep(120)


@pytest.mark.parametrize(
    ("answer", "deadline"),
    [(trickle, DEADLINE), (endless_chunks, DEADLINE), (silent, DEADLINE), (trickle, 5.0)],
    ids=["trickle", "endless-chunks", "silent", "trickle-5s"],
)
async def test_the_timeout_bounds_the_whole_request(answer: object, deadline: float) -> None:
    """A server that trickles its body, never ends it, or never answers fails with
    read_timeout at the timeout plus at most a second (the deadline sweep runs every
    0.25 s), not at the gap between reads."""
    with raw_server(answer) as server:  # type: ignore[arg-type]
        response, seconds = await ask(server.base_url, timeout=deadline)
    assert response.error_type == ErrorKind.READ_TIMEOUT
    assert deadline - 0.1 <= seconds <= deadline + 1.0, seconds
    assert server.base_url in (response.error or "")


# -- the size cap ----------------------------------------------------------------------


async def announced_huge(writer: asyncio.StreamWriter, request: Request) -> None:
    """Announces 200 MB and sends them slowly."""
    writer.write(head(200, length=200 * 2**20))
    for _ in range(200):
        writer.write(b" " * 2**20)
        await writer.drain()
        await asyncio.sleep(0.05)


def huge_without_length(*, chunked: bool, size: int = 200 * 2**20) -> object:
    async def answer(writer: asyncio.StreamWriter, request: Request) -> None:
        """Sends ``size`` bytes as fast as the client reads, with no Content-Length."""
        piece = b" " * 2**20
        if chunked:
            writer.write(head(200, Transfer_Encoding="chunked"))
            piece = b"%x\r\n" % len(piece) + piece + b"\r\n"
        else:
            writer.write(head(200, Connection="close"))  # read to the end of the stream
        for _ in range(size // 2**20):
            writer.write(piece)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        writer.close()

    return answer


async def test_an_announced_oversized_answer_is_refused_before_reading() -> None:
    """A Content-Length over max_response_bytes is an oversized error at once, naming
    the cap and the server; the body is not read."""
    with raw_server(announced_huge) as server:
        response, seconds = await ask(server.base_url)
    assert response.error_type == ErrorKind.OVERSIZED
    assert seconds < 1.0
    assert f"max_response_bytes={16 * 2**20}" in (response.error or "")
    assert server.base_url in (response.error or "")


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "read-to-close"])
async def test_an_oversized_answer_without_length_is_cut_off_while_reading(chunked: bool) -> None:
    """Without a Content-Length the answer is read in pieces and cut off at the cap."""
    with raw_server(huge_without_length(chunked=chunked)) as server:  # type: ignore[arg-type]
        response, seconds = await ask(server.base_url, max_response_bytes=2**20)
    assert response.error_type == ErrorKind.OVERSIZED
    assert "max_response_bytes=1048576" in (response.error or "")
    assert seconds < 5.0


async def test_an_answer_at_the_cap_is_read() -> None:
    """The cap is inclusive: an answer of exactly max_response_bytes is accepted."""
    body = completion_body("x" * 1000)
    with raw_server(whole(body)) as server:
        response, _ = await ask(server.base_url, max_response_bytes=len(body))
    assert response.ok and response.text == "x" * 1000


_PEAK_CHILD = """
import asyncio, sys, tracemalloc
from llm_annotator import VLLMOnlineClient

async def main(url, cap):
    async with VLLMOnlineClient(model="m", base_url=url, max_retries=0,
                                max_response_bytes=cap) as client:
        await client.agenerate(messages=[{"role": "user", "content": "warm"}])
        tracemalloc.start()
        response = await client.agenerate(messages=[{"role": "user", "content": "x"}])
        peak = tracemalloc.get_traced_memory()[1]
        print(response.error_type, peak // 2**20, "|", response.error)

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def _peak_growth(base_url: str, cap: int) -> tuple[str, int, str]:
    """The kind of the answer, the peak of memory allocated while it was read (MB, as
    tracemalloc counts it: every byte Python holds, whatever the OS does with pages)
    and the error text."""
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_CHILD, base_url, str(cap)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result, error = done.stdout.splitlines()[-1].split(" | ", 1)  # after any log lines
    kind, megabytes = result.split()
    return kind, int(megabytes), error


def test_peak_memory_stays_bounded_by_the_cap() -> None:
    """A 200 MB answer costs the client about the cap in peak memory, not the body:
    measured in a fresh process, side by side with the cap raised above the body."""
    first: list[bool] = []
    sent: list[int] = []

    async def answer(writer: asyncio.StreamWriter, request: Request) -> None:
        if not first:  # the warm-up request
            first.append(True)
            await whole(completion_body())(writer, request)
            return
        first.clear()
        await huge_without_length(chunked=True)(writer, request)  # type: ignore[operator]
        sent.append(200)  # only reached when the whole body was written

    with raw_server(answer) as server:
        capped_kind, capped_mb, capped_error = _peak_growth(server.base_url, 16 * 2**20)
        open_kind, open_mb, open_error = _peak_growth(server.base_url, 2**30)
    print(
        f"peak memory while reading a 200 MB chunked answer: {capped_mb} MB with the 16 MiB "
        f"cap, {open_mb} MB with a 1 GiB cap"
    )
    assert capped_kind == "oversized", capped_error
    assert open_kind == "malformed_response", open_error  # read whole (spaces), then refused
    assert sent == [200], "the server did not send the whole answer to the uncapped client"
    assert capped_mb < 40
    assert open_mb >= 200  # the same answer, held whole


# -- answers checked before they are believed ---------------------------------------------------


def _choice(**fields: object) -> dict[str, object]:
    choice: dict[str, object] = {
        "index": 0,
        "message": {"role": "assistant", "content": "ok"},
        "finish_reason": "stop",
    }
    choice.update(fields)
    return choice


MALFORMED = [
    (b"not json at all", "not JSON"),
    (b'{"choices": [{"message": {"content": "\xff\xfe"}, "finish_reason": "stop"}]}', "not JSON"),
    (b"", "not JSON"),
    (b"[1, 2]", "the body is a list, not an object"),
    (orjson.dumps({"id": "x"}), "'choices' is null, not a list"),
    (completion_body(choices="x"), "'choices' is a string, not a list"),
    (completion_body(choices=[]), "'choices' is empty"),
    (completion_body(choices=[1]), "choices[0] is an integer, not an object"),
    (completion_body(choices=[_choice(message=None)]), "choices[0].message is null"),
    (completion_body(None), "message.content is null, with no reasoning or tool call"),
    (completion_body(5), "message.content is an integer, not a string"),
    (completion_body(["a"]), "message.content is a list, not a string"),
    (completion_body(choices=[_choice(finish_reason=None)]), "finish_reason is null"),
    (completion_body(choices=[_choice(finish_reason=7)]), "finish_reason is an integer"),
    (completion_body(usage="x"), "'usage' is a string, not an object"),
    (completion_body(usage={"completion_tokens": "5"}), "usage.completion_tokens is '5'"),
    (completion_body(usage={"completion_tokens": -1}), "usage.completion_tokens is -1"),
    (completion_body(usage={"prompt_tokens": 1.5}), "usage.prompt_tokens is 1.5"),
    (completion_body(usage={"prompt_tokens": True}), "usage.prompt_tokens is True"),
    (
        orjson.dumps({"error": {"message": "engine hiccup", "type": "InternalServerError"}}),
        "it is an error: InternalServerError: engine hiccup",
    ),
]


@pytest.mark.parametrize(("body", "defect"), MALFORMED, ids=[d for _, d in MALFORMED])
async def test_a_wrong_answer_is_malformed_with_the_defect_named(body: bytes, defect: str) -> None:
    """A 200 whose body is not a chat completion is malformed_response naming the defect."""
    with raw_server(whole(body)) as server:
        response, _ = await ask(server.base_url)
    assert response.error_type == ErrorKind.MALFORMED, response
    assert defect in (response.error or ""), response.error


@pytest.mark.parametrize(
    ("body", "text", "reasoning"),
    [
        (completion_body(None, usage=None), None, "thought"),
        (completion_body("answer", usage=None), "answer", None),
    ],
    ids=["null-content-with-reasoning", "no-usage"],
)
async def test_lawful_variations_are_accepted(
    body: bytes, text: str | None, reasoning: str | None
) -> None:
    """content null with a reasoning text is an answer; usage may be missing."""
    if reasoning is not None:
        data = orjson.loads(body)
        data["choices"][0]["message"]["reasoning_content"] = reasoning
        body = orjson.dumps(data)
    with raw_server(whole(body)) as server:
        response, _ = await ask(server.base_url)
    assert response.ok, response.error
    assert (response.text, response.reasoning) == (text, reasoning)
    assert response.num_output_tokens is None


async def test_a_body_cut_off_midway_is_disconnected() -> None:
    """A connection closed before the announced length arrived is 'disconnected'."""

    async def cut(writer: asyncio.StreamWriter, request: Request) -> None:
        writer.write(head(200, length=1000) + completion_body()[:50])
        await writer.drain()
        writer.close()

    with raw_server(cut) as server:
        response, seconds = await ask(server.base_url)
    assert response.error_type == ErrorKind.DISCONNECTED
    assert seconds < 2.0


async def test_an_answer_that_is_not_http_is_an_error() -> None:
    """Bytes that are not an HTTP response are a transport error, not an exception."""

    async def garbage(writer: asyncio.StreamWriter, request: Request) -> None:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        writer.close()

    with raw_server(garbage) as server:
        response, _ = await ask(server.base_url)
    assert response.error_type == ErrorKind.DISCONNECTED
    assert response.error


# -- redirects --------------------------------------------------------------------------


@pytest.mark.parametrize("status", [302, 307])
async def test_a_redirect_is_not_followed(status: int) -> None:
    """A 3xx is a redirect error naming the Location; the prompt never goes there."""
    with raw_server(whole(completion_body("foreign"))) as elsewhere:
        location = f"http://127.0.0.1:{elsewhere.port}/v1/chat/completions"
        with raw_server(whole(b"", status, Location=location)) as server:
            response, _ = await ask(server.base_url)
    assert response.error_type == ErrorKind.REDIRECT
    assert location in (response.error or "")
    assert f"HTTP {status}" in (response.error or "")
    assert elsewhere.chat_requests == []


# -- nothing from a body escapes -------------------------------------------------------------


@pytest.fixture
def wrong_counts() -> Iterator[str]:
    """A server whose token counts are strings: once a TypeError deep in annotate."""
    body = completion_body(usage={"prompt_tokens": "5", "completion_tokens": "2"})
    with raw_server(whole(body)) as server:
        yield server.base_url


def test_a_job_over_a_server_of_wrong_answers_stops_and_writes_no_final_row(
    wrong_counts: str, tmp_path: Path
) -> None:
    """A job over a server whose every answer is malformed: the server is at fault, not
    the rows, so it is evicted, no test completion re-admits it, and the job stops after
    all_down_timeout naming the defect, with no row written as final: the same call on
    a good server then answers them all."""
    rows = [{"text": f"row {i}"} for i in range(10)]
    with VLLMQueueAnnotator([wrong_counts], batch_size=4, all_down_timeout=1) as pool:
        with pytest.raises(PoolExhaustedError) as info:
            pool.annotate(rows, "Label: {text}", tmp_path / "run", progress=False)
        member = pool.statistics().member(wrong_counts)
    assert "usage.prompt_tokens is '5'" in str(info.value)
    assert member.evictions == 1 and member.readmissions == 0
    assert member.completed == 0 and member.errors == 0
    written = [
        line
        for shard in (tmp_path / "run" / "shards").glob("*.jsonl")
        for line in shard.read_text().splitlines()
    ]
    assert written == []
    with (
        raw_server(whole(completion_body("fine"))) as good,
        VLLMQueueAnnotator([good.base_url], batch_size=4) as pool,
    ):
        result = pool.annotate(rows, "Label: {text}", tmp_path / "run", progress=False)
    assert (result.num_rows, result.num_failed) == (10, 0)  # the same call, resumed


# -- an answer longer than its request allows ---------------------------------------------


def long_answer(text: int = 0, reasoning: int = 0, tokens: int = 2) -> bytes:
    """A chat completion of ``text`` and ``reasoning`` characters and ``tokens``
    completion tokens."""
    message = {"role": "assistant", "content": "x" * text, "reasoning_content": "r" * reasoning}
    choice = {"index": 0, "message": message, "finish_reason": "length"}
    usage = {"prompt_tokens": 5, "completion_tokens": tokens, "total_tokens": 5 + tokens}
    return completion_body(choices=[choice], usage=usage)


TEN_MB = 10_000_000


@pytest.mark.parametrize(
    ("body", "asked", "defect"),
    [
        (long_answer(text=TEN_MB), {"max_tokens": 8}, "10000000 characters of text and reasoning"),
        (long_answer(reasoning=TEN_MB), {"max_tokens": 8}, "10000000 characters"),
        (long_answer(text=8, reasoning=12_281), {"max_tokens": 8}, "12289 characters"),
        (long_answer(text=5, tokens=9), {"max_tokens": 8}, "usage.completion_tokens is 9"),
        (
            long_answer(text=20_000),
            {"max_completion_tokens": 4, "max_tokens": 64},  # the server reads the first
            "20000 characters of text and reasoning, more than 4 tokens can hold",
        ),
    ],
    ids=["10MB-text", "10MB-reasoning", "one-over", "tokens-over", "max-completion-first"],
)
async def test_an_answer_longer_than_its_token_limit_is_malformed(
    body: bytes, asked: dict[str, int], defect: str
) -> None:
    """An answer the engine could not have produced under the request's token limit
    (more completion tokens, or more text and reasoning than 1024 characters a token
    plus 4096) is a lying server: malformed, the defect named, never a row's text."""
    with raw_server(whole(body)) as server:
        async with client(server.base_url) as c:
            response = await c.agenerate(messages=MESSAGES, gen_kwargs=asked)
    assert response.error_type == ErrorKind.MALFORMED.value
    assert defect in (response.error or "")
    assert response.text is None


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        (long_answer(text=8 * 1024 + 4096, tokens=8), {"max_tokens": 8}),  # at the bound
        (long_answer(text=TEN_MB), {}),  # no limit asked: only the size cap applies
        (long_answer(text=TEN_MB), {"max_tokens": 20_000}),
        (long_answer(text=TEN_MB), {"max_tokens": 8, "echo": True}),  # the prompt comes back
    ],
    ids=["at-the-bound", "no-limit", "large-limit", "echo"],
)
async def test_an_answer_within_its_token_limit_is_accepted(
    body: bytes, asked: dict[str, int]
) -> None:
    with raw_server(whole(body)) as server:
        async with client(server.base_url) as c:
            response = await c.agenerate(messages=MESSAGES, gen_kwargs=asked)
    assert response.ok, response.error
    assert len(response.text or "") + len(response.reasoning or "") == len(
        orjson.loads(body)["choices"][0]["message"]["content"]
    ) + len(orjson.loads(body)["choices"][0]["message"]["reasoning_content"])


def test_a_member_answering_10_mb_to_8_tokens_is_evicted_and_its_rows_go_elsewhere(
    tmp_path: Path,
) -> None:
    """A job asking for 8 tokens over a good server and one that answers 10 MB of text:
    the liar is evicted, never readmitted, and every row is the good server's answer."""
    rows = [{"text": f"row {i}"} for i in range(12)]
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=8)
    with (
        raw_server(whole(long_answer(text=TEN_MB))) as liar,
        raw_server(whole(completion_body("fine"))) as good,
        VLLMQueueAnnotator([liar.base_url, good.base_url], batch_size=2) as pool,
    ):
        result = pool.annotate(
            rows, "Label: {text}", tmp_path / "run", progress=False, options=options
        )
        lying = pool.statistics().member(liar.base_url)
        asked = [orjson.loads(r.body).get("max_tokens") for r in liar.chat_requests]
    assert (result.num_rows, result.num_failed) == (12, 0)
    assert lying.evictions >= 1 and lying.completed == 0
    assert asked and set(asked) <= {1, 8}  # the canary asks for 1 token, the rows for 8
    table = pq.read_table(tmp_path / "run" / "annotations.parquet")
    assert table.column("response").to_pylist() == ["fine"] * 12


async def test_a_redirect_on_model_discovery_names_the_location() -> None:
    """GET /v1/models answered with a redirect: a redirect error with the Location."""
    with raw_server() as server:
        server.routes["/v1/models"] = whole(b"", 301, Location="http://elsewhere:1/v1/models")
        async with VLLMOnlineClient(base_url=server.base_url, max_retries=0) as c:
            response = await c.agenerate(messages=MESSAGES)
    assert response.error_type == ErrorKind.REDIRECT, response.error
    assert "http://elsewhere:1/v1/models" in (response.error or "")


@pytest.mark.parametrize("setting", ["timeout", "connect_timeout"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), 0, -1])
def test_a_deadline_must_be_finite_and_positive(setting: str, value: float) -> None:
    """An infinite or NaN deadline would crash every request later: refused at once."""
    from llm_annotator import ConfigurationError

    settings: dict[str, Any] = {setting: value}
    with pytest.raises(ConfigurationError, match=setting):
        VLLMOnlineClient(base_url="http://127.0.0.1:1/v1", **settings)


async def test_a_callers_cancellation_stays_a_cancellation() -> None:
    """Only the deadline's own cancellation becomes read_timeout: a request cancelled by
    its caller (a pool evicting the server) ends as cancelled, at once."""
    with raw_server(silent) as server:
        async with client(server.base_url, timeout=DEADLINE) as c:
            request = asyncio.ensure_future(c.agenerate(messages=MESSAGES))
            await asyncio.sleep(0.3)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
            response, seconds = await ask(server.base_url, timeout=DEADLINE)  # still works
    assert response.error_type == ErrorKind.READ_TIMEOUT
    assert seconds <= DEADLINE + 1.0
