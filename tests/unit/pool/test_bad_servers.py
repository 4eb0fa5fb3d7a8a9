"""Bad servers cost seconds, never rows: one good member and one that misbehaves while its
``/health`` says 200.

Every case runs the same call twice, side by side: with the bad member and without it.
With it, every sample must get exactly one successful answer, from the good member; the
bad member must be evicted after ``max_server_faults`` answers (or, hung, after its stall
window) and never re-admitted while it stays bad; with the tail hedge on and off. The
figures (requests the bad member got, extra wall time) are printed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import structlog

from llm_annotator import (
    ErrorKind,
    OpenAIClient,
    PoolExhaustedError,
    ProviderError,
    VLLMQueueAnnotator,
)
from tests.misbehaving import Answer, RawServer, Request, completion_body, head, raw_server, whole

SAMPLES = 300
FAULTS = 3
ANSWER_SECONDS = 0.03
"""The good member's time per answer: the call takes about a second without faults."""


def echo_after(seconds: float) -> Answer:
    """A good server: answers the last message's content back, after ``seconds``."""

    async def answer(writer: asyncio.StreamWriter, request: Request) -> None:
        await asyncio.sleep(seconds)
        content = orjson.loads(request.body)["messages"][-1]["content"]
        body = completion_body(f"echo {content}")
        writer.write(head(200, length=len(body)) + body)
        await writer.drain()

    return answer


async def cut_off(writer: asyncio.StreamWriter, request: Request) -> None:
    body = completion_body("this answer never arrives whole")
    writer.write(head(200, length=len(body)) + body[:20])
    await writer.drain()
    writer.close()


async def never_answers(writer: asyncio.StreamWriter, request: Request) -> None:
    await asyncio.sleep(3600)


async def announced_huge(writer: asyncio.StreamWriter, request: Request) -> None:
    writer.write(head(200, length=200 * 2**20))  # over the cap: refused before reading
    await writer.drain()


def _invalid_utf8() -> bytes:
    return completion_body("x").replace(b'"x"', b'"\xff\xfe"')


BAD: dict[str, Answer] = {
    "not-json": whole(b"<html>502 from the proxy</html>"),
    "wrong-shape": whole(orjson.dumps({"choices": "not a list"})),
    "invalid-utf8": whole(_invalid_utf8()),
    "200-with-error": whole(orjson.dumps({"error": {"message": "engine overloaded"}})),
    "oversized": announced_huge,
    "cut-off": cut_off,
    "500-forever": whole(orjson.dumps({"error": {"message": "Internal Server Error"}}), 500),
    "accepts-never-answers": never_answers,
}


@pytest.fixture
def good() -> Iterator[RawServer]:
    with raw_server(echo_after(ANSWER_SECONDS)) as server:
        yield server


def growing_metrics() -> Answer:
    """A ``/metrics`` page whose generated-token counter grows at every read: a busy
    engine."""
    tokens = {"count": 0}

    async def metrics(writer: asyncio.StreamWriter, request: Request) -> None:
        tokens["count"] += 7
        body = f'vllm:generation_tokens_total{{model_name="m"}} {tokens["count"]}\n'.encode()
        writer.write(head(200, length=len(body)) + body)
        await writer.drain()

    return metrics


def requests_for(content: str, *servers: RawServer) -> list[Request]:
    """The chat requests the servers got whose last message is ``content``."""
    return [
        r
        for s in servers
        for r in s.chat_requests
        if orjson.loads(r.body)["messages"][-1]["content"] == content
    ]


def conversations(samples: int = SAMPLES) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"sample {i}"}] for i in range(samples)]


def run_pool(
    urls: list[str], hedge_tail: bool, samples: int = SAMPLES, **settings: Any
) -> tuple[list[Any], Any, float]:
    started = time.monotonic()
    config: dict[str, Any] = {
        "batch_size": 5,
        "max_concurrent_batches_per_client": 4,
        "health_check_interval": 0.2,
        "health_check_timeout": 0.5,
        "max_server_faults": FAULTS,
        "stall_window": 0.5,
        "all_down_timeout": 5,
        "timeout": 60,
    }
    config.update(settings)
    with VLLMQueueAnnotator(urls, hedge_tail=hedge_tail, **config) as pool:
        responses = pool.batch_generate(messages=conversations(samples))
        stats = pool.statistics()
    return responses, stats, time.monotonic() - started


@pytest.mark.parametrize("hedge_tail", [True, False], ids=["hedge", "no-hedge"])
@pytest.mark.parametrize("defect", list(BAD))
def test_a_bad_member_costs_seconds_never_rows(
    defect: str, hedge_tail: bool, good: RawServer
) -> None:
    # A hung member is found by time: the call must outlast its stall window (three
    # times the longest gap between the good member's answers), else the tail hedge
    # alone answers its samples, as it should.
    samples = 5 * SAMPLES if defect == "accepts-never-answers" else SAMPLES
    with raw_server(BAD[defect]) as bad:
        _, _, alone = run_pool([good.base_url], hedge_tail, samples)
        good.requests.clear()
        with structlog.testing.capture_logs() as logs:
            responses, stats, seconds = run_pool([bad.base_url, good.base_url], hedge_tail, samples)
        sent_to_bad = len(bad.chat_requests)
    member = stats.member(bad.base_url)
    print(
        f"\n{defect} (hedge {'on' if hedge_tail else 'off'}): bad member got {sent_to_bad} "
        f"requests, evicted {member.evictions}x; {seconds:.2f} s against {alone:.2f} s "
        f"without it (+{seconds - alone:.2f} s); last error: {(member.last_error or '')[:120]}"
    )
    assert [r.text for r in responses] == [f"echo sample {i}" for i in range(samples)]
    assert {r.server for r in responses} == {good.base_url}
    assert [r for r in responses if not r.ok] == []
    assert member.evictions == 1, member
    assert member.state == "evicted"
    assert member.completed == 0 and member.errors == 0
    # Never let back in while bad (a first probe slower than its timeout on a loaded
    # machine may mark it down and then admit it once, before it had done anything).
    events = [e["event"] for e in logs if e.get("server") == bad.base_url]
    assert "member_readmitted" not in events[events.index("member_evicted") :], events
    if defect == "accepts-never-answers":
        assert (member.last_error or "").startswith("hung:"), member.last_error
    else:
        assert f"{FAULTS} answers in a row were the server's fault" in (
            member.last_error or ""
        ) or "test completion failed" in (member.last_error or "")
    # Every answer each sample got came from one request of the good member, except the
    # few first tries the bad member spoiled and the tail hedge's duplicates.
    answered = [orjson.loads(r.body)["messages"][-1]["content"] for r in good.chat_requests]
    assert set(answered) >= {f"sample {i}" for i in range(samples)}
    if not hedge_tail:
        assert len(answered) == samples


def test_a_bad_member_is_never_readmitted_while_it_stays_bad(good: RawServer) -> None:
    """Its /health says 200 all along; every test completion it is given fails, and the
    waits between them grow."""
    with raw_server(BAD["500-forever"]) as bad:
        with VLLMQueueAnnotator(
            [bad.base_url, good.base_url],
            batch_size=5,
            health_check_interval=0.05,
            health_check_timeout=0.5,
            hedge_tail=False,
        ) as pool:
            many = [[{"role": "user", "content": f"sample {i}"}] for i in range(1500)]
            responses = pool.batch_generate(messages=many)
            member = pool.statistics().member(bad.base_url)
        canaries = [r for r in bad.chat_requests if orjson.loads(r.body).get("max_tokens") == 1]
    assert all(r.ok for r in responses)
    assert member.evictions == 1 and member.readmissions == 0
    assert 1 <= len(canaries) <= 8  # doubling waits from 0.05 s: 0.05, 0.1, 0.2, ...
    assert "test completion failed" in (member.last_error or "")


def test_a_5xx_storm_is_not_a_result(good: RawServer) -> None:
    """Every member answers 500 while /health says 200: the call stops after
    all_down_timeout and no sample has a final Response; the same call on a good
    server then answers them all."""
    with raw_server(BAD["500-forever"]) as one, raw_server(BAD["500-forever"]) as two:
        started = time.monotonic()
        with (
            VLLMQueueAnnotator(
                [one.base_url, two.base_url],
                batch_size=5,
                health_check_interval=0.2,
                health_check_timeout=0.5,
                all_down_timeout=1,
            ) as pool,
            pytest.raises(PoolExhaustedError) as info,
        ):
            pool.batch_generate(messages=conversations())
        waited = time.monotonic() - started
        stats = pool.statistics()
    assert info.value.responses == [None] * SAMPLES
    assert all(m.evictions == 1 and m.errors == 0 for m in stats.members)
    assert "Internal Server Error" in str(info.value)
    for url in (one.base_url, two.base_url):
        assert f"{url}: {url}" not in str(info.value)  # each server named once
    assert waited < 10
    responses, _, _ = run_pool([good.base_url], hedge_tail=False)
    assert all(r.ok for r in responses)


def test_a_sample_that_breaks_every_member_is_still_bounded(
    good: RawServer,
) -> None:
    """A sample whose every request gets a 500 while other samples succeed: an error row
    after max_sample_retries resends, spread over the members, and no member evicted."""

    async def five_hundred_for_seven(writer: asyncio.StreamWriter, request: Request) -> None:
        if orjson.loads(request.body)["messages"][-1]["content"] == "sample 7":
            await whole(orjson.dumps({"error": {"message": "boom"}}), 500)(writer, request)
            return
        await echo_after(0.0)(writer, request)

    with (
        raw_server(five_hundred_for_seven) as one,
        raw_server(five_hundred_for_seven) as two,
    ):
        responses, stats, _ = run_pool(
            [one.base_url, two.base_url], hedge_tail=False, max_sample_retries=2
        )
        sevens = requests_for("sample 7", one, two)
    assert [i for i, r in enumerate(responses) if not r.ok] == [7]
    assert responses[7].error_type == "server_error"
    assert len(sevens) == 3  # the first try and two resends
    assert stats.evictions == 0


def test_a_slow_member_whose_engine_progresses_is_never_evicted(good: RawServer) -> None:
    """A member that takes 3 s per answer, far past its stall window by the good
    member's pace, while its /metrics counters grow: busy, not hung. It keeps its work."""
    metrics = growing_metrics()

    with raw_server(echo_after(3.0)) as slow:
        slow.routes["/metrics"] = metrics
        with structlog.testing.capture_logs() as logs:
            responses, stats, _ = run_pool([slow.base_url, good.base_url], hedge_tail=False)
    member = stats.member(slow.base_url)
    assert all(r.ok for r in responses)
    assert member.evictions == 0, member.last_error
    assert member.completed > 0
    assert any(e["event"] == "member_busy_not_hung" for e in logs)


def test_clients_must_be_vllm_clients_and_a_closed_pool_takes_no_server() -> None:
    not_a_vllm_client: Any = OpenAIClient(model="m", base_url="http://127.0.0.1:9/v1")
    with pytest.raises(TypeError, match="got OpenAIClient"):
        VLLMQueueAnnotator(clients=[not_a_vllm_client])
    pool = VLLMQueueAnnotator(["http://127.0.0.1:9/v1"])
    pool.close()
    with pytest.raises(RuntimeError, match="the pool is closed"):
        pool.add_server("http://127.0.0.1:10/v1")


def test_one_reset_of_a_members_connections_is_one_fault(good: RawServer) -> None:
    """A live server drops the five connections of its first batch at once (one
    reset): those requests share one health check and count as one fault, so the
    member is not evicted, and every sample is answered."""
    dropped = {"count": 0}

    async def drop_first_five(writer: asyncio.StreamWriter, request: Request) -> None:
        dropped["count"] += 1
        if dropped["count"] <= 5:
            await asyncio.sleep(0.05)
            writer.close()
            return
        await echo_after(0.01)(writer, request)

    with raw_server(drop_first_five) as flaky:
        responses, stats, _ = run_pool(
            [flaky.base_url, good.base_url], hedge_tail=False, max_concurrent_batches_per_client=1
        )
    assert [r.text for r in responses] == [f"echo sample {i}" for i in range(SAMPLES)]
    assert stats.member(flaky.base_url).evictions == 0
    assert stats.member(flaky.base_url).completed > 0


def test_a_timeout_while_the_member_answers_others_is_the_samples() -> None:
    """One sample takes longer than ``timeout`` while the rest of its batch is answered
    (and the engine's counters grow, so the member is busy, not hung): an error row
    (read_timeout) after one request, no member counted against."""
    metrics = growing_metrics()

    async def slow_for_seven(writer: asyncio.StreamWriter, request: Request) -> None:
        if orjson.loads(request.body)["messages"][-1]["content"] == "sample 7":
            await asyncio.sleep(30)
        await echo_after(0.0)(writer, request)

    with raw_server(slow_for_seven) as one, raw_server(slow_for_seven) as two:
        one.routes["/metrics"] = two.routes["/metrics"] = metrics
        responses, stats, _ = run_pool(
            [one.base_url, two.base_url], hedge_tail=False, samples=20, timeout=1.0
        )
        sevens = requests_for("sample 7", one, two)
    assert [i for i, r in enumerate(responses) if not r.ok] == [7]
    assert responses[7].error_type == "read_timeout"
    assert len(sevens) == 1
    assert stats.evictions == 0


@pytest.mark.parametrize(("status", "kind"), [(401, "auth"), (404, "not_found")])
def test_a_member_that_starts_refusing_mid_call_is_disabled(
    status: int, kind: str, good: RawServer
) -> None:
    """A member whose key is revoked (401) or whose model is unloaded (404) in the middle
    of a call: disabled for good, its samples answered by the other member, no error
    rows."""
    served = {"count": 0}

    async def then_refuse(writer: asyncio.StreamWriter, request: Request) -> None:
        served["count"] += 1
        if served["count"] > 30:
            body = orjson.dumps({"error": {"message": "no longer", "type": kind}})
            await whole(body, status)(writer, request)
            return
        await echo_after(ANSWER_SECONDS)(writer, request)

    with raw_server(then_refuse) as turning:
        responses, stats, _ = run_pool([turning.base_url, good.base_url], hedge_tail=False)
    member = stats.member(turning.base_url)
    assert [r.text for r in responses] == [f"echo sample {i}" for i in range(SAMPLES)]
    assert member.state == "disabled" and member.errors == 0
    assert 0 < member.completed <= 30
    assert f"HTTP {status}" in (member.last_error or "")


def test_on_error_raise_raises_the_first_error_row_after_the_call(good: RawServer) -> None:
    """``on_error="raise"``: the call finishes, then raises the first sample-fault error
    as a ProviderError of its kind; a server fault on the way raises nothing."""

    async def bad_request_for_three(writer: asyncio.StreamWriter, request: Request) -> None:
        if orjson.loads(request.body)["messages"][-1]["content"] == "sample 3":
            body = orjson.dumps({"error": {"message": "prompt too long"}})
            await whole(body, 400)(writer, request)
            return
        await echo_after(0.0)(writer, request)

    with raw_server(bad_request_for_three) as server:
        with pytest.raises(ProviderError) as info:
            run_pool([server.base_url], hedge_tail=False, samples=20, on_error="raise")
        assert len(requests_for("sample 3", server)) == 1
    assert info.value.kind is ErrorKind.BAD_REQUEST
    assert "prompt too long" in str(info.value)
    assert info.value.server == server.base_url
    assert str(info.value).count(server.base_url) == 1  # named once
