"""VLLMQueueAnnotator over fake servers: spreading work, eviction, requeueing, poison."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import structlog
from aiohttp import web

from llm_annotator import (
    PoolExhaustedError,
    PoolStatistics,
    VLLMQueueAnnotator,
)
from llm_annotator.clients._protocol import parse_completion
from llm_annotator.pool.run import Run
from llm_annotator.response import Response
from tests.unit.conftest import FakeServer, completion, echo, error, sleep_forever
from tests.unit.helpers import (
    FAST,
    assert_all_answered_in_order,
    conversations,
    delayed_echo,
    index_of,
)

FakeServers = Callable[[int], list[FakeServer]]


def always_500_for(index: int) -> Any:
    """A handler that answers sample ``index`` with a plain 500 and echoes the rest."""

    async def handle(request: dict[str, Any]) -> web.StreamResponse:
        if index_of(request) == index:
            return error(500, "something broke", "InternalServerError")
        return await echo(request)

    return handle


def test_work_spreads_over_members_and_comes_back_in_order(fake_servers: FakeServers) -> None:
    """Every member gets work; results are in input order and name their server."""
    servers = fake_servers(3)
    with VLLMQueueAnnotator([s.base_url for s in servers], batch_size=16, **FAST) as pool:
        responses = pool.batch_generate(messages=conversations(600))
        stats = pool.statistics()
    assert_all_answered_in_order(responses, 600)
    by_server = Counter(r.server for r in responses)
    assert set(by_server) == {s.base_url for s in servers}
    assert stats.completed == 600
    assert {m.server: m.completed for m in stats.members} == dict(by_server)
    assert stats.evictions == 0
    sent = sum(len(s.requests) for s in servers)
    assert 600 <= sent <= 600 + stats.hedged  # tail duplicates (some cut off on the way)


def test_a_faster_member_gets_more_work(fake_servers: FakeServers) -> None:
    """A member that answers ten times faster takes most of the batches."""
    fast, slow = fake_servers(2)

    sluggish = delayed_echo(0.1)

    quick = delayed_echo(0.01)

    fast.handler, slow.handler = quick, sluggish
    with VLLMQueueAnnotator(
        [fast.base_url, slow.base_url], batch_size=10, max_concurrent_batches_per_client=1, **FAST
    ) as pool:
        responses = pool.batch_generate(messages=conversations(400))
    assert_all_answered_in_order(responses, 400)
    assert len(fast.requests) > 3 * len(slow.requests)


def test_member_slots_bound_batches_in_flight(fake_servers: FakeServers) -> None:
    """A member holds at most batch_size x max_concurrent_batches_per_client requests."""
    (server,) = fake_servers(1)

    slow = delayed_echo(0.02)

    server.handler = slow
    with VLLMQueueAnnotator(
        [server.base_url], batch_size=8, max_concurrent_batches_per_client=3, **FAST
    ) as pool:
        responses = pool.batch_generate(messages=conversations(200))
    assert_all_answered_in_order(responses, 200)
    assert 8 < server.max_in_flight <= 24


def test_refused_member_is_not_fatal(fake_servers: FakeServers, refused_url: str) -> None:
    """A URL where nothing listens is down from the start; the others do all the work."""
    (server,) = fake_servers(1)
    with VLLMQueueAnnotator([refused_url, server.base_url], batch_size=20, **FAST) as pool:
        responses = pool.batch_generate(messages=conversations(200))
        stats = pool.statistics()
    assert_all_answered_in_order(responses, 200)
    assert stats.member(refused_url).state == "evicted"
    assert stats.member(refused_url).completed == 0
    assert stats.member(server.base_url).completed == 200


def test_member_that_dies_mid_run_loses_no_sample(fake_servers: FakeServers) -> None:
    """When a member starts refusing connections, its samples go to the other member:
    no error rows, one eviction, and samples counted as requeued."""
    dying, healthy = fake_servers(2)
    answered = 0

    async def then_die(request: dict[str, Any]) -> web.StreamResponse:
        nonlocal answered
        answered += 1
        if answered > 40:
            await asyncio.sleep(0.05)
            return error(
                500, "EngineCore encountered an issue. See stack trace", "InternalServerError"
            )
        return await echo(request)

    async def steady(request: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(0.01)
        return await echo(request)

    dying.handler, healthy.handler = then_die, steady
    with VLLMQueueAnnotator([dying.base_url, healthy.base_url], batch_size=10, **FAST) as pool:
        responses = pool.batch_generate(messages=conversations(300))
        stats = pool.statistics()
    assert_all_answered_in_order(responses, 300)
    dead = stats.member(dying.base_url)
    assert dead.evictions >= 1
    assert dead.requeued >= 1
    assert "EngineCore" in (dead.last_error or "")


def test_bad_samples_are_error_rows_and_never_evict(fake_servers: FakeServers) -> None:
    """400s stay error rows of their samples; the member keeps working."""
    (server,) = fake_servers(1)

    async def reject_tens(request: dict[str, Any]) -> web.StreamResponse:
        if index_of(request) % 10 == 0:
            return error(400, "This model's maximum context length is 512 tokens.")
        return await echo(request)

    server.handler = reject_tens
    with VLLMQueueAnnotator([server.base_url], batch_size=25, on_error="ignore", **FAST) as pool:
        responses = pool.batch_generate(messages=conversations(100))
        stats = pool.statistics()
    assert [r.ok for r in responses] == [i % 10 != 0 for i in range(100)]
    assert {r.error_type for r in responses if not r.ok} == {"bad_request"}
    assert stats.evictions == 0
    assert stats.errors == 10
    assert len(server.requests) == 100  # never retried


def test_transient_server_errors_are_retried_then_kept(fake_servers: FakeServers) -> None:
    """A sample that always gets a plain 500 ends as an error row after its retries."""
    (server,) = fake_servers(1)
    server.handler = always_500_for(7)
    with VLLMQueueAnnotator(
        [server.base_url], batch_size=10, max_sample_retries=2, on_error="ignore", **FAST
    ) as pool:
        responses = pool.batch_generate(messages=conversations(20))
    assert [r.ok for r in responses] == [i != 7 for i in range(20)]
    assert responses[7].error_type == "server_error"
    sevens = [r for r in server.requests if index_of(r) == 7]
    # One try more if its last came while nothing else was answered (after the test
    # completion that then shows the server works).
    assert len(sevens) == 3 + sum(index_of(r) == -1 for r in server.requests) <= 4


def test_hung_member_is_evicted_and_its_samples_move(fake_servers: FakeServers) -> None:
    """A member that accepts but never answers (requests nor /health) is evicted after
    failed health checks, and its samples are answered by the other member."""
    hung, healthy = fake_servers(2)
    hung.handler = sleep_forever
    started = time.monotonic()
    with VLLMQueueAnnotator(
        [hung.base_url, healthy.base_url],
        batch_size=10,
        health_check_interval=0.2,
        health_check_timeout=0.3,
        max_failed_health_checks=2,
        hedge_tail=False,  # else the tail hedge answers its samples before the eviction
    ) as pool:
        # /health hangs only once the run is going, like a server stopped mid-run.
        threading.Timer(0.3, lambda: setattr(hung, "health_delay", 3600.0)).start()
        responses = pool.batch_generate(messages=conversations(100))
        stats = pool.statistics()
    assert_all_answered_in_order(responses, 100)
    assert stats.member(hung.base_url).evictions == 1
    assert "health checks" in (stats.member(hung.base_url).last_error or "")
    assert time.monotonic() - started < 10


def test_all_members_down_raises_with_completed_responses(fake_servers: FakeServers) -> None:
    """When every member dies, the call waits all_down_timeout, then raises
    PoolExhaustedError naming the servers and holding every completed Response."""
    (server,) = fake_servers(1)
    served = {"count": 0}

    async def die_after_30(request: dict[str, Any]) -> web.StreamResponse:
        served["count"] += 1
        if served["count"] > 30:
            server.health_status = 503
            return error(500, "EngineCore encountered an issue.", "InternalServerError")
        return await echo(request)

    server.handler = die_after_30
    started = time.monotonic()
    with (
        VLLMQueueAnnotator(
            [server.base_url],
            batch_size=10,
            max_concurrent_batches_per_client=1,
            all_down_timeout=1.0,
            **FAST,
        ) as pool,
        pytest.raises(PoolExhaustedError) as info,
    ):
        pool.batch_generate(messages=conversations(100))
    assert time.monotonic() - started < 10
    exc = info.value
    assert server.base_url in str(exc)
    assert "EngineCore" in exc.servers[server.base_url]
    done = [r for r in exc.responses if r is not None]
    assert len(exc.responses) == 100
    assert len(done) == 30
    assert all(r.ok for r in done)


def test_poison_sample_becomes_an_error_row(fake_servers: FakeServers) -> None:
    """A sample whose request kills every engine it reaches is stopped after
    max_sample_evictions; the other samples all succeed."""
    servers = fake_servers(3)

    async def poisoned(request: dict[str, Any]) -> web.StreamResponse:
        if index_of(request) == 13:
            return error(500, "EngineCore encountered an issue.", "InternalServerError")
        return await echo(request)

    for server in servers:
        server.handler = poisoned
    with VLLMQueueAnnotator(
        [s.base_url for s in servers],
        batch_size=5,
        max_sample_evictions=2,
        on_error="ignore",
        hedge_tail=False,  # a hedge may carry the poison to a third server first
        **FAST,
    ) as pool:
        responses = pool.batch_generate(messages=conversations(60))
    assert responses[13].error_type == "poison_sample"
    assert "evicted" in (responses[13].error or "")
    assert sum(index_of(r) == 13 for s in servers for r in s.requests) == 2
    # By the rule, samples that shared both evicted servers with sample 13 are poison
    # too; they are bounded by what one member holds (batch_size x 4 slots).
    failed = [i for i, r in enumerate(responses) if not r.ok]
    assert {responses[i].error_type for i in failed} == {"poison_sample"}
    assert len(failed) <= 5 * 4


def test_late_member_joins_and_takes_work(fake_servers: FakeServers) -> None:
    """A server added during a call is probed and then receives batches."""
    first, late = fake_servers(2)

    slow = delayed_echo(0.05)

    first.handler = slow
    late.handler = slow
    with VLLMQueueAnnotator(
        [first.base_url], batch_size=5, max_concurrent_batches_per_client=1, **FAST
    ) as pool:
        threading.Timer(0.3, pool.add_server, args=(late.base_url,)).start()
        responses = pool.batch_generate(messages=conversations(200))
        stats = pool.statistics()
    assert_all_answered_in_order(responses, 200)
    assert stats.member(late.base_url).completed > 20


def test_a_server_another_process_found_dead_leaves_at_once_and_rejoins_if_it_answers(
    fake_servers: FakeServers,
) -> None:
    """suspect_server during a call evicts a healthy member (its requests in flight go
    back on the queue, answered once each); it answers its probe and test completion
    here, so it rejoins and takes work again; told the same again, it stays. Outside a
    call, or for a server the pool does not hold, nothing changes."""
    other, suspected = fake_servers(2)
    other.handler = suspected.handler = delayed_echo(0.05)
    said: list[bool] = []
    with VLLMQueueAnnotator(
        [other.base_url, suspected.base_url],
        batch_size=5,
        max_concurrent_batches_per_client=1,
        **FAST,
    ) as pool:
        assert pool.suspect_server(suspected.base_url, "before the call") is False

        def suspect_once_it_works() -> None:
            deadline = time.monotonic() + 10
            while suspected.in_flight == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            said.append(pool.suspect_server(suspected.base_url, "found dead by worker w"))
            said.append(pool.suspect_server("http://127.0.0.1:9/v1", "not a member"))
            sent = len(suspected.requests)
            while len(suspected.requests) <= sent + 5 and time.monotonic() < deadline:
                time.sleep(0.01)  # it rejoined and takes work again
            # the same word again (another job of the same worker reads it): acted on once
            said.append(pool.suspect_server(suspected.base_url, "found dead by worker w"))

        suspecter = threading.Thread(target=suspect_once_it_works)
        suspecter.start()
        responses = pool.batch_generate(messages=conversations(300))
        suspecter.join()
        stats = pool.statistics().member(suspected.base_url)
    assert said == [True, False, False]
    assert_all_answered_in_order(responses, 300)
    assert stats.evictions == 1 and stats.readmissions == 1
    canaries = [r for r in suspected.requests if index_of(r) == -1]
    assert len(canaries) == 1  # it proved itself with one test completion


def test_removed_member_drains_and_leaves(fake_servers: FakeServers) -> None:
    """remove_server during a call: the member finishes what it holds, takes nothing new."""
    keep, leave = fake_servers(2)

    slow = delayed_echo(0.05)

    keep.handler = leave.handler = slow
    with VLLMQueueAnnotator(
        [keep.base_url, leave.base_url], batch_size=5, max_concurrent_batches_per_client=1, **FAST
    ) as pool:

        def remove_once_it_works() -> None:
            deadline = time.monotonic() + 10
            while not leave.requests and time.monotonic() < deadline:
                time.sleep(0.01)
            pool.remove_server(leave.base_url)

        remover = threading.Thread(target=remove_once_it_works)
        remover.start()
        responses = pool.batch_generate(messages=conversations(200))
        remover.join()
        assert pool.base_urls == [keep.base_url]
    assert_all_answered_in_order(responses, 200)
    assert 0 < len(leave.requests) < 60


def test_unknown_model_disables_member_and_fails_fast(fake_servers: FakeServers) -> None:
    """A pool asking for a model no server serves stops at once, saying what they serve."""
    (server,) = fake_servers(1)
    started = time.monotonic()
    with VLLMQueueAnnotator([server.base_url], model="missing", **FAST) as pool:
        with pytest.raises(PoolExhaustedError, match="does not serve model 'missing'"):
            pool.batch_generate(messages=conversations(3))
        assert pool.statistics().members[0].state == "disabled"
    assert time.monotonic() - started < 5
    assert server.requests == []


def test_model_is_discovered_per_member(fake_servers: FakeServers) -> None:
    """With model=None each member asks its server which model it serves."""
    (server,) = fake_servers(1)
    server.models = ["served"]
    with VLLMQueueAnnotator([server.base_url], **FAST) as pool:
        pool.batch_generate(messages=conversations(3))
    assert {r["model"] for r in server.requests} == {"served"}


def test_statistics_snapshot_is_frozen(fake_servers: FakeServers) -> None:
    """statistics() returns a frozen snapshot; later work does not change it."""
    (server,) = fake_servers(1)
    with VLLMQueueAnnotator([server.base_url], **FAST) as pool:
        pool.batch_generate(messages=conversations(5))
        before = pool.statistics()
        pool.batch_generate(messages=conversations(5))
        after = pool.statistics()
    assert isinstance(before, PoolStatistics)
    assert (before.completed, after.completed) == (5, 10)
    with pytest.raises(AttributeError):
        before.healthy = 3  # type: ignore[misc]
    assert "healthy=1" in repr(pool)


def test_generate_and_async_twin(fake_servers: FakeServers) -> None:
    """The pool meets the Client contract: generate, agenerate, is_healthy."""
    (server,) = fake_servers(1)
    with VLLMQueueAnnotator([server.base_url], **FAST) as pool:
        assert pool.generate(messages=[{"role": "user", "content": "one"}]).text == "one"
        assert pool.is_healthy()

    async def twin() -> str | None:
        async with VLLMQueueAnnotator([server.base_url], **FAST) as pool:
            return (await pool.agenerate(messages=[{"role": "user", "content": "two"}])).text

    assert asyncio.run(twin()) == "two"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"max_concurrent_batches_per_client": 0}, "max_concurrent_batches_per_client"),
        ({"max_sample_evictions": 0}, "max_sample_evictions"),
        ({"health_check_interval": 0}, "health_check_interval"),
        ({"all_down_timeout": -1}, "all_down_timeout"),
        ({"on_error": "explode"}, "on_error"),
    ],
)
def test_bad_pool_settings_raise(kwargs: dict[str, Any], field: str) -> None:
    """A pool setting out of range is refused, naming the setting."""
    with pytest.raises(ValueError, match=field):
        VLLMQueueAnnotator(["http://127.0.0.1:1/v1"], **kwargs)


def test_pool_needs_distinct_servers() -> None:
    """No servers, a bare string, or one server twice is a clear error."""
    with pytest.raises(ValueError, match="at least one server"):
        VLLMQueueAnnotator([])
    with pytest.raises(ValueError, match="list of URLs"):
        VLLMQueueAnnotator("http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="twice"):
        VLLMQueueAnnotator(["http://127.0.0.1:1/v1", "http://127.0.0.1:1/v1/"])


def test_the_fakes_completion_is_a_chat_completion() -> None:
    """The fake servers' answer parses as the client parses a real one (guards the
    fakes: a broken body would make every pool test here test garbage handling)."""
    answer = completion("x", prompt_tokens=5, completion_tokens=2)
    assert isinstance(answer.body, bytes)
    parsed = parse_completion(answer.body, server="http://fake:1/v1", provider="vllm_online")
    assert (parsed.text, parsed.finish_reason) == ("x", "stop")
    assert (parsed.num_prompt_tokens, parsed.num_output_tokens) == (5, 2)


def test_requeued_samples_travel_in_full_batches() -> None:
    """Samples put back after an eviction are cut into full batches again, in order."""

    async def scenario() -> None:
        run = Run(batch_size=10, deliver=lambda index, response: None)
        for i in range(100):
            run.admit(i, [{"role": "user", "content": str(i)}])
        first = run.take()
        second = run.take()
        assert first == list(range(10))
        assert second == list(range(10, 20))
        assert run.requeue([*first, *second]) == 20
        assert run.take() == list(range(10))
        assert run.take() == list(range(10, 20))
        assert run.take() == list(range(20, 30))

    asyncio.run(scenario())


def test_what_befell_a_sample_lives_while_it_is_open_and_goes_with_it() -> None:
    """One SampleState per open sample: a fault sends the sample to another member, and
    once stored nothing of it is left (nothing grows with the samples delivered)."""

    async def scenario() -> None:
        run = Run(batch_size=4, deliver=lambda index, response: None)
        for i in range(2):
            run.admit(i, [{"role": "user", "content": str(i)}])
        assert run.note_fault(0, "http://a") == 1
        assert run.avoiding == 1 and run.open[0].avoid == "http://a"
        assert run.take(avoid="http://a") == [1]  # 0 waits for another member
        assert run.take(avoid="http://b") == [0]
        assert run.store(0, Response(text="a"))
        assert run.avoiding == 0 and list(run.open) == [1]
        assert run.note_fault(0, "http://a") == 0  # closed: nothing to count

    asyncio.run(scenario())


def test_run_delivers_each_sample_once_and_ends_when_the_source_is_done() -> None:
    """A sample stored twice is delivered once; the run ends only after the source is
    closed and every admitted sample is delivered; a stopping run hands out no work."""

    async def scenario() -> None:
        delivered: list[int] = []
        run = Run(batch_size=4, deliver=lambda index, response: delivered.append(index))
        for i in range(3):
            run.admit(i, [{"role": "user", "content": str(i)}])
        assert run.take() == [0, 1, 2]
        assert run.store(0, Response(text="a"))
        assert not run.store(0, Response(text="again"))
        assert run.store(1, Response(text="b"))
        assert run.store(2, Response(text="c"))
        assert not run.finished  # the source may still admit samples
        run.admit(3, [{"role": "user", "content": "3"}])
        run.close_source()
        assert not run.finished
        run.stop = asyncio.Event()
        run.stop.set()
        assert run.take() is None
        assert run.store(3, Response(text="d"))
        assert run.done.is_set()  # finished (mypy took run.finished for False above)
        assert delivered == [0, 1, 2, 3]
        assert run.requeue([0, 1]) == 0  # delivered samples never go back on the queue

    asyncio.run(scenario())


def dying_handler(server: FakeServer, trigger: int, down_for: float) -> Any:
    """A handler whose server 'dies' (drops connections, /health 503) when it receives
    sample ``trigger``, and 'restarts' ``down_for`` seconds later."""
    state = {"dead_until": 0.0}

    async def handle(request: dict[str, Any], raw: web.Request) -> web.StreamResponse:
        now = time.monotonic()
        if index_of(request) == trigger:
            state["dead_until"] = now + down_for
            server.health_status = 503
        if now < state["dead_until"] or index_of(request) == trigger:
            assert raw.transport is not None
            raw.transport.abort()
            await asyncio.sleep(0.1)
            raise web.HTTPServiceUnavailable()
        server.health_status = 200
        await asyncio.sleep(0.02)
        return await echo(request)

    return handle


@pytest.mark.timeout(40)
def test_sample_that_kills_servers_by_reset_is_poison(fake_servers: FakeServers) -> None:
    """A sample whose request makes each server drop every connection (as a SIGKILL
    does) is marked poison after max_sample_evictions; every other sample succeeds."""
    servers = fake_servers(3)
    for server in servers:
        server.raw_handler = dying_handler(server, trigger=13, down_for=0.5)
    with VLLMQueueAnnotator(
        [s.base_url for s in servers],
        batch_size=5,
        max_sample_evictions=2,
        on_error="ignore",
        hedge_tail=False,  # a hedge may carry the poison to a third server first
        **FAST,
    ) as pool:
        responses = pool.batch_generate(messages=conversations(120))
    assert responses[13].error_type == "poison_sample"
    failed = [i for i, r in enumerate(responses) if not r.ok]
    assert {responses[i].error_type for i in failed} == {"poison_sample"}
    assert len(failed) <= 5 * 4  # bystanders of both evictions, at most one member's load


def test_sample_whose_connection_always_drops_ends_as_an_error_row(
    fake_servers: FakeServers,
) -> None:
    """A live server that always cuts one sample's answer does not loop forever: the
    sample is retried max_sample_retries times, then kept as an error row (one try
    more if its last came while nothing else was answered: a test completion then
    shows that the server works, and the sample's next fault ends it)."""
    (server,) = fake_servers(1)

    async def cut_seven(request: dict[str, Any], raw: web.Request) -> web.StreamResponse:
        if index_of(request) == 7:
            assert raw.transport is not None
            raw.transport.abort()
            raise web.HTTPServiceUnavailable()
        return await echo(request)

    server.raw_handler = cut_seven
    with VLLMQueueAnnotator(
        [server.base_url], batch_size=10, max_sample_retries=2, on_error="ignore", **FAST
    ) as pool:
        responses = pool.batch_generate(messages=conversations(20))
        stats = pool.statistics()
    assert [r.ok for r in responses] == [i != 7 for i in range(20)]
    assert responses[7].error_type == "disconnected"
    tests = sum(index_of(r) == -1 for r in server.requests)  # see the docstring
    assert sum(index_of(r) == 7 for r in server.requests) == 3 + tests <= 4
    assert stats.evictions == 0


def test_a_short_burst_of_500s_on_the_only_server_costs_no_sample(
    fake_servers: FakeServers,
) -> None:
    """The only server answers its first two requests 500 and then works: with
    max_sample_retries=0 nothing else is answered when the samples fail, so a test
    completion is sent; it succeeds, and each sample is sent once more and answered
    (not ended as an error row without a real retry)."""
    (server,) = fake_servers(1)
    failed: list[int] = []

    async def two_500s_first(request: dict[str, Any]) -> web.StreamResponse:
        if index_of(request) >= 0 and len(failed) < 2:
            failed.append(index_of(request))
            return error(500, "Internal Server Error", "InternalServerError")
        return await echo(request)

    server.handler = two_500s_first
    with VLLMQueueAnnotator(
        [server.base_url], batch_size=2, max_sample_retries=0, on_error="ignore", **FAST
    ) as pool:
        responses = pool.batch_generate(messages=conversations(2))
        stats = pool.statistics()
    assert sorted(failed) == [0, 1]
    assert [r.text for r in responses] == ["sample 0", "sample 1"]
    assert any(index_of(r) == -1 for r in server.requests)  # the test completion
    assert stats.evictions == 0


def test_a_sample_the_only_server_always_fails_ends_after_its_test_completion(
    fake_servers: FakeServers,
) -> None:
    """A one-sample job whose sample always gets a 500 from a server that answers
    everything else: it is tried, the test completion succeeds, it is tried once more
    and ends as an error row; the server is not evicted."""
    (server,) = fake_servers(1)
    server.handler = always_500_for(0)
    with VLLMQueueAnnotator(
        [server.base_url], batch_size=2, max_sample_retries=0, on_error="ignore", **FAST
    ) as pool:
        (response,) = pool.batch_generate(messages=conversations(1))
        stats = pool.statistics()
    assert response.error_type == "server_error"
    assert [index_of(r) for r in server.requests if index_of(r) != -1] == [0, 0]
    assert sum(index_of(r) == -1 for r in server.requests) == 1
    assert stats.evictions == 0


def test_removed_member_that_fails_does_not_come_back(fake_servers: FakeServers) -> None:
    """A member removed during a call whose engine then dies (its requests in flight
    answer EngineCore 500) is evicted and forgotten at once, not drained or re-admitted;
    its samples finish on the other member."""
    keep, leave = fake_servers(2)
    removed = threading.Event()

    async def held_then_dead(request: dict[str, Any]) -> web.StreamResponse:
        # Requests already on `leave` wait here until it is removed, then its engine dies.
        await asyncio.to_thread(removed.wait, 10)  # bounded
        return error(500, "EngineCore encountered an issue.", "InternalServerError")

    keep.handler, leave.handler = delayed_echo(0.02), held_then_dead
    with (
        structlog.testing.capture_logs() as logs,
        VLLMQueueAnnotator(
            [keep.base_url, leave.base_url],
            batch_size=5,
            max_concurrent_batches_per_client=1,
            **FAST,
        ) as pool,
    ):

        def remove_then_fail() -> None:
            deadline = time.monotonic() + 10
            while not leave.in_flight and time.monotonic() < deadline:
                time.sleep(0.01)  # bounded: wait until `leave` holds a batch
            pool.remove_server(leave.base_url)
            removed.set()

        threading.Thread(target=remove_then_fail, daemon=True).start()
        responses = pool.batch_generate(messages=conversations(150))
        assert pool.base_urls == [keep.base_url]
    assert_all_answered_in_order(responses, 150)
    events = [(e["event"], e.get("server")) for e in logs]
    assert ("member_removed", leave.base_url) in events
    assert ("member_evicted", leave.base_url) in events  # it died while draining
    assert ("member_readmitted", leave.base_url) not in events
    assert 1 <= len(leave.requests) <= 5  # only (part of) the batch it held when removed


def test_tail_hedge_rescues_samples_stuck_on_a_slow_member(fake_servers: FakeServers) -> None:
    """When the queue is empty, an idle member also sends the samples still in flight on
    a much slower member; the first answer is kept, each sample is answered once, and
    the duplicates are counted."""
    slow, fast = fake_servers(2)
    slow.handler = delayed_echo(30.0)
    started = time.monotonic()
    with VLLMQueueAnnotator(
        [slow.base_url, fast.base_url], batch_size=10, max_concurrent_batches_per_client=2, **FAST
    ) as pool:
        responses = pool.batch_generate(messages=conversations(200))
        stats = pool.statistics()
    assert_all_answered_in_order(responses, 200)
    assert time.monotonic() - started < 10  # not the slow member's 30 s
    assert {r.server for r in responses} == {fast.base_url}
    assert stats.member(fast.base_url).hedged == len(slow.requests) > 0
    assert stats.member(slow.base_url).completed == 0


def test_last_batches_shrink_to_an_even_share_of_the_queue() -> None:
    """Once the source is done, a batch is at most the queue's share per working slot."""

    async def scenario() -> list[int]:
        run = Run(batch_size=10, deliver=lambda index, response: None)
        for i in range(25):
            run.admit(i, [{"role": "user", "content": str(i)}])
        run.close_source()
        sizes = []
        while (batch := run.take(slots=4)) is not None:
            sizes.append(len(batch))
        return sizes

    assert asyncio.run(scenario()) == [7, 5, 4, 3, 2, 1, 1, 1, 1]


def test_every_setting_is_an_argument_with_the_same_default() -> None:
    """Each PoolConfig field is an argument of VLLMQueueAnnotator with the config's
    default, and reads back from the pool as given."""
    import dataclasses
    import inspect

    from llm_annotator.pool.config import PoolConfig

    parameters = inspect.signature(VLLMQueueAnnotator).parameters
    for field in dataclasses.fields(PoolConfig):
        assert parameters[field.name].default == field.default, field.name
    pool = VLLMQueueAnnotator(["http://127.0.0.1:9/v1"], batch_size=7, stall_window=45)
    assert (pool.batch_size, pool.stall_window, pool.config.batch_size) == (7, 45.0, 7)
    pool.close()


@pytest.mark.parametrize(
    ("name", "value"), [("batch_size", 8), ("max_sample_retries", 0), ("timeout", 5.0)]
)
def test_a_setting_is_fixed_when_the_pool_is_made(
    fake_servers: FakeServers, name: str, value: object
) -> None:
    """Assigning a setting raises AttributeError saying to build a new pool, and
    changes nothing: the pool reads one config, the one it was made with."""
    (server,) = fake_servers(1)
    with VLLMQueueAnnotator([server.base_url], batch_size=4) as pool:
        before = pool.config
        with pytest.raises(AttributeError, match=rf"{name} is fixed when a pool is made: build"):
            setattr(pool, name, value)
        assert pool.config is before and pool.config is pool._state.config
        with pytest.raises(AttributeError):
            pool.config = before  # type: ignore[misc]
        pool.batch_generate(messages=conversations(10))
    assert (pool.batch_size, pool.config.batch_size) == (4, 4)
