"""Work-conserving dispatch: slots refill as answers arrive, and each member's window
follows its server's load.

The window decision is a pure function, tested as a table; the pool's use of it, the
refill and the hedge's cancelling run on the fake clock (clients that report a chosen
engine load, or take a chosen time per sample). ``benchmarks/pool_efficiency.py``
measures what it is worth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from llm_annotator import ConfigurationError, ErrorKind, ProviderError, Response, VLLMQueueAnnotator
from llm_annotator.clients.metrics import EngineLoad, engine_load
from llm_annotator.pool import dispatch, window
from llm_annotator.pool.window import next_window, waiting_target
from tests.unit.fake_clock import ClockedClient, FakeClock
from tests.unit.helpers import assert_all_answered_in_order, conversations


def load(running: float, waiting: float) -> EngineLoad:
    return EngineLoad(running=running, waiting=waiting)


@pytest.mark.parametrize(
    ("was", "engine", "holding", "preempted", "rate", "new"),
    [
        # No /metrics: the whole window at once.
        (64, None, 10, False, 0.0, 1024),
        # Nothing waits and the window is full: double it.
        (64, load(64, 0), 64, False, 0.0, 128),
        (64, load(64, 0), 57, False, 0.0, 128),  # within an eighth counts as full
        # A few wait (no more than the target): grow by a quarter.
        (64, load(64, 2), 64, False, 0.0, 80),
        # The member does not fill its window (the queue ran dry): unchanged.
        (64, load(20, 0), 30, False, 0.0, 64),
        # A queue longer than the target: shrink by the excess.
        (64, load(16, 48), 64, False, 0.0, 18),
        # ... of what the member holds, if it holds less than its window.
        (64, load(16, 30), 40, False, 0.0, 12),
        # A fast server may keep what it answers in 0.1 s waiting: 1,000/s -> 100, so
        # 90 waiting is not too many (the window still grows by a quarter) ...
        (256, load(32, 90), 256, False, 1000.0, 320),
        (256, load(32, 150), 256, False, 1000.0, 206),
        # Preemptions: a little under what it ran, whatever waits.
        (256, load(200, 0), 256, True, 0.0, 180),
        # Always within the floor and the ceiling.
        (8, load(2, 500), 8, False, 0.0, window.MIN_WINDOW),
        (768, load(1000, 0), 768, False, 0.0, 1024),
    ],
)
def test_what_a_members_window_becomes(
    was: int,
    engine: EngineLoad | None,
    holding: int,
    preempted: bool,
    rate: float,
    new: int,
) -> None:
    got = next_window(was, engine, holding=holding, preempted=preempted, ceiling=1024, rate=rate)
    assert got == new


def test_the_waiting_target_grows_with_what_the_server_runs_and_answers() -> None:
    assert waiting_target(0) == window.MIN_WAITING
    assert waiting_target(100) == 10
    assert waiting_target(10, rate=45.0) == 5


def test_engine_load_reads_vllms_gauges_over_all_engines() -> None:
    body = (
        b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        b"# TYPE vllm:num_requests_running gauge\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 7.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 5.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_waiting{engine="1",model_name="m"} 0.0\n'
        b'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
    )
    assert engine_load(body) == EngineLoad(running=12, waiting=3, preemptions=2, kv_cache=0.5)
    assert engine_load(b'vllm:num_requests_running{engine="0"} 1\n') is None
    assert engine_load(b"<html>404</html>") is None


class LoadedClient(ClockedClient):
    """A clocked client whose ``/metrics`` report ``engine`` (None: unreadable), and
    that records how many requests it held at each fake moment."""

    def __init__(self, url: str, clock: FakeClock, engine: EngineLoad | None) -> None:
        super().__init__(url, clock, latency=0.5)
        self.engine = engine
        self.holding = 0
        self.held: list[tuple[float, int]] = []

    async def aengine_load(self, timeout: float = 5.0) -> EngineLoad | None:
        await self.clock.sleep(0.001)
        return self.engine

    async def asend(self, messages: Any, params: bytes) -> Response | Any:
        self.holding += 1
        self.held.append((self.clock.now(), self.holding))
        try:
            return await super().asend(messages, params)
        finally:
            self.holding -= 1

    def most_held(self, start: float, end: float = float("inf")) -> int:
        return max((n for t, n in self.held if start <= t < end), default=0)


def run_on(client: LoadedClient, clock: FakeClock, samples: int, **settings: Any) -> None:
    settings.setdefault("adaptive", True)

    async def scenario() -> list[Response]:
        async with VLLMQueueAnnotator(clients=[client], clock=clock, **settings) as pool:
            return await pool.abatch_generate(messages=conversations(samples))

    responses = asyncio.run(scenario())
    assert_all_answered_in_order(responses, samples)


def test_a_server_that_queues_gets_a_smaller_window() -> None:
    """A member starts at the start window; once its server reports a long queue it holds
    no more than the floor, and every sample is still answered."""
    clock = FakeClock()
    client = LoadedClient("http://queued:1/v1", clock, load(running=2, waiting=500))
    run_on(client, clock, 600, batch_size=64, max_concurrent_batches_per_client=4)
    assert client.most_held(0.0, 1.0) == window.START_WINDOW
    assert client.most_held(2.5) <= window.MIN_WINDOW


def test_a_server_without_metrics_gets_the_whole_window() -> None:
    clock = FakeClock()
    client = LoadedClient("http://plain:1/v1", clock, None)
    run_on(client, clock, 2000, batch_size=64, max_concurrent_batches_per_client=4)
    assert client.most_held(0.0, 1.0) == window.START_WINDOW
    assert client.most_held(1.5) == 64 * 4


def test_a_server_that_keeps_up_grows_its_window_up_to_the_ceiling() -> None:
    clock = FakeClock()
    client = LoadedClient("http://roomy:1/v1", clock, load(running=10, waiting=0))
    run_on(client, clock, 3000, batch_size=64, max_concurrent_batches_per_client=4)
    assert client.most_held(1.5, 2.0) == 2 * window.START_WINDOW
    assert client.most_held(2.5) == 64 * 4


def test_adaptive_false_starts_small_and_grows_with_each_answer_to_the_whole_window() -> None:
    """Without ``adaptive`` a member starts at the start window and gains one place per
    answer (a round of answers doubles it) up to ``batch_size x batches``, whatever its
    ``/metrics`` say."""
    clock = FakeClock()
    client = LoadedClient("http://fixed:1/v1", clock, load(running=2, waiting=500))
    run_on(client, clock, 1200, batch_size=64, max_concurrent_batches_per_client=4, adaptive=False)
    assert client.most_held(0.0, 0.5) == window.START_WINDOW
    assert client.most_held(0.5, 1.0) == 2 * window.START_WINDOW
    assert client.most_held(1.0) == 64 * 4


class LineClient(LoadedClient):
    """A clocked client (no /metrics) whose server serves ``capacity`` requests at once,
    each for ``service`` fake seconds, the rest waiting in line in order, as a
    continuous-batching server does; it answers ``capacity / service`` a second at most.
    """

    def __init__(self, url: str, clock: FakeClock, capacity: int, service: float) -> None:
        super().__init__(url, clock, None)
        self.service = service
        self.line = asyncio.Semaphore(capacity)
        self.answers = 0

    async def asend(self, messages: Any, params: bytes) -> Response | Any:
        self.holding += 1
        self.held.append((self.clock.now(), self.holding))
        try:
            async with self.line:
                await self.clock.sleep(self.service)
        finally:
            self.holding -= 1
        self.answers += 1
        return Response(text=messages[-1]["content"], finish_reason="stop", server=self.base_url)


def test_a_slow_server_holds_only_its_share_of_the_end_of_a_call() -> None:
    """A server eight times slower than the other, both offered a window of 256: once the
    source is done each holds its part of what is left by its pace, so both finish
    together and the call ends within a few percent of the work-conserving bound, with
    no hedge to rescue it. With an even share of the queue per slot (the rule before)
    the slow server ended the call alone on its line (1.41 x the bound)."""
    clock = FakeClock()
    fast = LineClient("http://fast:1/v1", clock, capacity=32, service=0.1)
    slow = LineClient("http://slow:1/v1", clock, capacity=4, service=0.1)
    samples = 3600
    bound = samples / (320 + 40)

    async def scenario() -> list[Response]:
        async with VLLMQueueAnnotator(
            clients=[fast, slow],
            clock=clock,
            batch_size=64,
            max_concurrent_batches_per_client=4,
            hedge_tail=False,
        ) as pool:
            return await pool.abatch_generate(messages=conversations(samples))

    responses = asyncio.run(scenario())
    assert_all_answered_in_order(responses, samples)
    assert clock.now() <= 1.05 * bound, (clock.now(), bound, fast.answers, slow.answers)
    assert slow.answers < samples * 40 / 360 * 1.05


class SlowSampleClient(LoadedClient):
    """A clocked client (no /metrics) on which the samples in ``slow`` take ``seconds``
    fake seconds and the others ``latency``; it records which requests were cancelled."""

    def __init__(
        self, url: str, clock: FakeClock, slow: set[str], seconds: float, latency: float
    ) -> None:
        super().__init__(url, clock, None)
        self.slow, self.seconds, self.latency = slow, seconds, latency
        self.prompts: list[str] = []
        self.cancelled: dict[str, float] = {}
        self.answered: dict[str, float] = {}

    async def asend(self, messages: Any, params: bytes) -> Response | Any:
        prompt = messages[-1]["content"]
        self.prompts.append(prompt)
        self.holding += 1
        self.held.append((self.clock.now(), self.holding))
        try:
            await self.clock.sleep(self.seconds if prompt in self.slow else self.latency)
        except asyncio.CancelledError:
            self.cancelled[prompt] = self.clock.now()
            raise
        finally:
            self.holding -= 1
        self.answered[prompt] = self.clock.now()
        return Response(text=prompt, finish_reason="stop", server=self.base_url)


def test_a_slot_refills_as_answers_arrive_instead_of_waiting_for_its_slowest() -> None:
    """One slot of four: while sample 0 takes 20 s, the slot keeps sending the others as
    its fast answers arrive, so all of them are sent (and answered) before sample 0
    is; the slot never holds more than its batch."""
    clock = FakeClock()
    client = SlowSampleClient("http://one:1/v1", clock, {"sample 0"}, 20.0, 0.1)
    run_on(
        client,
        clock,
        40,
        batch_size=4,
        max_concurrent_batches_per_client=1,
        hedge_tail=False,
        adaptive=False,
    )
    sent_at = [t for t, _ in client.held]
    assert len(sent_at) == 40
    assert max(sent_at) < 20.0  # all 39 others went out while sample 0 was held
    assert client.most_held(0.0) == 4


@pytest.mark.parametrize(
    ("batch_size", "batches", "long", "samples"),
    [
        # Two slots a member: the fast member's idle slot hedges.
        (4, 2, 39, 40),
    ],
    ids=["idle-slot"],
)
def test_the_first_answer_of_a_hedged_sample_cancels_its_other_copy(
    batch_size: int, batches: int, long: int, samples: int
) -> None:
    """Near the end the fast member sends again what the slow one still holds (samples 0
    to 3 take 600 s there); each first answer cancels the slow member's copy at once (so
    its server stops spending time on it), not when the call ends. Sample ``long`` takes
    20 s on the fast member (under the 30 s in which a quiet member counts as hung) and
    600 s on the slow one, so the call goes on long after the hedges are answered, and
    no member is evicted."""
    clock = FakeClock()
    stuck = {f"sample {i}" for i in range(4)}
    slow = SlowSampleClient("http://slow:1/v1", clock, stuck | {f"sample {long}"}, 600.0, 0.1)
    fast = SlowSampleClient("http://fast:1/v1", clock, {f"sample {long}"}, 20.0, 0.1)

    async def scenario() -> tuple[list[Response], int]:
        async with VLLMQueueAnnotator(
            clients=[slow, fast],
            clock=clock,
            batch_size=batch_size,
            max_concurrent_batches_per_client=batches,
        ) as pool:
            responses = await pool.abatch_generate(messages=conversations(samples))
            return responses, pool.statistics().evictions

    responses, evictions = asyncio.run(scenario())
    assert_all_answered_in_order(responses, samples)
    assert evictions == 0
    rescued = {p: t for p, t in fast.answered.items() if p in stuck}
    assert rescued.keys() == stuck, "the fast member did not hedge every stuck sample"
    assert max(rescued.values()) < 5.0  # hedged early, not once sample `long` was done
    assert clock.now() >= 20.0  # the call outlived the hedges
    for prompt, answered_at in rescued.items():
        assert 0 <= slow.cancelled[prompt] - answered_at < 1.0, prompt


def test_a_slot_that_still_holds_a_request_hedges_from_its_refill() -> None:
    """One slot a member, so no slot is ever idle: the fast member's slot holds sample
    399 for 20 s while the slow member holds samples 0 to 11 for 600 s. Once the queue
    is empty the fast slot has room, and sends them again from its refill, long before
    sample 399 is answered (no idle slot could have)."""
    clock = FakeClock()
    stuck = {f"sample {i}" for i in range(12)}
    slow = SlowSampleClient("http://slow:1/v1", clock, stuck, 600.0, 0.1)
    fast = SlowSampleClient("http://fast:1/v1", clock, {"sample 399"}, 20.0, 0.1)

    async def scenario() -> list[Response]:
        async with VLLMQueueAnnotator(
            clients=[slow, fast], clock=clock, batch_size=16, max_concurrent_batches_per_client=1
        ) as pool:
            return await pool.abatch_generate(messages=conversations(400))

    responses = asyncio.run(scenario())
    assert_all_answered_in_order(responses, 400)
    rescued = {p: t for p, t in fast.answered.items() if p in stuck}
    assert len(rescued) >= dispatch.HEDGE_ROOM, rescued
    assert max(sorted(rescued.values())[: dispatch.HEDGE_ROOM]) < 10.0


def test_a_hedge_cancelled_before_it_is_sent_is_not_counted_as_hedged() -> None:
    """Two members answer every request in 1 s; at 2 s each has one sample left (6 and
    7), answered at the same moment. The member whose answer is settled first has room
    and hedges the other's sample, whose answer, settled right after, cancels that copy
    before it was sent. No duplicate reached a server, so ``hedged`` counts none: it
    counts the hedge requests sent, not the ones picked."""
    clock = FakeClock()
    first = ClockedClient("http://first:1/v1", clock, latency=1.0)
    second = ClockedClient("http://second:1/v1", clock, latency=1.0)

    async def scenario() -> tuple[list[Response], int]:
        async with VLLMQueueAnnotator(
            clients=[first, second],
            clock=clock,
            batch_size=8,
            max_concurrent_batches_per_client=1,
            adaptive=False,
        ) as pool:
            responses = await pool.abatch_generate(messages=conversations(8))
            return responses, pool.statistics().hedged

    with structlog.testing.capture_logs() as logs:
        responses, hedged = asyncio.run(scenario())
    assert_all_answered_in_order(responses, 8)
    picked = sum(e["samples"] for e in logs if e["event"] == "samples_hedged")
    assert picked == 1, "no hedge was picked: the scenario did not happen"
    sent = len(first.sent) + len(second.sent)
    assert sent == 8  # the copy was cancelled before it was sent
    assert hedged == 0


class ErringClient(LoadedClient):
    """A clocked client (no /metrics) whose every answer is the sample's fault."""

    async def asend(self, messages: Any, params: bytes) -> Response | Any:
        self.holding += 1
        self.held.append((self.clock.now(), self.holding))
        try:
            await self.clock.sleep(0.5)
        finally:
            self.holding -= 1
        return ProviderError("HTTP 400: bad", kind=ErrorKind.BAD_REQUEST, server=self.base_url)


def test_error_answers_do_not_grow_a_window() -> None:
    """A server that answers every sample with an error (the samples' fault, so it is
    never evicted) keeps its start window: only good answers show it can hold more."""
    clock = FakeClock()
    client = ErringClient("http://erring:1/v1", clock, None)

    async def scenario() -> list[Response]:
        async with VLLMQueueAnnotator(
            clients=[client], clock=clock, batch_size=64, max_concurrent_batches_per_client=4
        ) as pool:
            return await pool.abatch_generate(messages=conversations(600))

    responses = asyncio.run(scenario())
    assert [r.error_type for r in responses] == ["bad_request"] * 600
    assert client.most_held(0.0) == window.START_WINDOW


class FlakyClient(LoadedClient):
    """A recording clocked client (no /metrics) with ``ClockedClient``'s ``latency``,
    ``healthy`` and ``answer``."""

    def __init__(
        self,
        url: str,
        clock: FakeClock,
        latency: float,
        healthy: Callable[[float], bool] = lambda now: True,
        answer: Callable[[str, float], Response | None] | None = None,
    ) -> None:
        super().__init__(url, clock, None)
        self.latency, self.healthy = latency, healthy
        if answer is not None:
            self.answer = answer


def test_a_member_that_rejoins_starts_its_window_again() -> None:
    """A member that grew its window to the whole 256, then hung (its /health and its
    requests) from 2 s to 25 s and was evicted, gets the start window again when it
    rejoins: the server that came back may be a restarted one, or another GPU."""
    clock = FakeClock()
    down = (2.0, 25.0)

    def healthy(now: float) -> bool:
        return not down[0] <= now < down[1]

    def answer(prompt: str, now: float) -> Response | None:
        return None if down[0] <= now < down[1] else Response(text=prompt, finish_reason="stop")

    steady = FlakyClient("http://steady:1/v1", clock, latency=5.0)
    flaky = FlakyClient("http://flaky:1/v1", clock, latency=0.5, healthy=healthy, answer=answer)

    async def scenario() -> tuple[list[Response], int]:
        async with VLLMQueueAnnotator(
            clients=[steady, flaky], clock=clock, batch_size=64, max_concurrent_batches_per_client=4
        ) as pool:
            responses = await pool.abatch_generate(messages=conversations(4000))
            return responses, pool.statistics().member("http://flaky:1/v1").readmissions

    responses, readmissions = asyncio.run(scenario())
    assert_all_answered_in_order(responses, 4000)
    assert readmissions == 1
    assert max(n for t, n in flaky.held if t < down[0]) == 64 * 4
    test_completion, *sent = (t for t, _ in flaky.held if t >= down[1])
    back = min(t for t in sent if t > test_completion)
    assert flaky.most_held(back, back + 0.4) == window.START_WINDOW


@pytest.mark.parametrize("adaptive", [False, True])
def test_a_pool_that_shares_its_servers_holds_its_share_and_follows_changes(
    adaptive: bool,
) -> None:
    """One of four processes sharing a server holds a quarter of the budget of 256; when
    the others leave (at 2 s) its window grows back to the whole budget, and when eight
    share it (at 5 s) it shrinks to 32 once what was in flight is answered. Every sample
    is answered once, in order, either way."""
    clock = FakeClock()
    client = LineClient("http://shared:1/v1", clock, capacity=32, service=0.1)
    samples = 3000

    async def scenario() -> list[Response]:
        async with VLLMQueueAnnotator(
            clients=[client],
            clock=clock,
            batch_size=64,
            max_concurrent_batches_per_client=4,
            hedge_tail=False,
            adaptive=adaptive,
        ) as pool:
            pool.share_servers(4)
            assert pool.sharing == 4

            async def others() -> None:
                await clock.sleep(2.0)
                pool.share_servers(1)
                await clock.sleep(3.0)
                pool.share_servers(8)

            changes = asyncio.ensure_future(others())
            try:
                return await pool.abatch_generate(messages=conversations(samples))
            finally:
                await changes

    responses = asyncio.run(scenario())
    assert_all_answered_in_order(responses, samples)
    assert client.most_held(0.0, 2.0) == 64
    assert client.most_held(2.0, 5.0) == 64 * 4
    assert client.most_held(5.5) == 32


def test_sharing_a_pools_servers_takes_a_number_of_workers() -> None:
    clock = FakeClock()
    pool = VLLMQueueAnnotator(clients=[ClockedClient("http://a:1/v1", clock)], clock=clock)
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ConfigurationError, match="workers must be an int >= 1"):
            pool.share_servers(bad)  # type: ignore[arg-type]
    assert pool.sharing == 1


def test_rows_that_come_a_batch_at_a_time_start_on_every_server_first() -> None:
    """Eight servers, each allowed four batches of four: rows that come four at a time
    (a corpus job's first units, read between sends) go one batch to each server before
    any server gets a second; the slots used to fill the first two servers' every
    batch (16 + 16) while six servers waited, and on slow servers those six started a
    whole round late."""
    clock = FakeClock()
    clients = [LineClient(f"http://s{i}:1/v1", clock, capacity=4, service=10.0) for i in range(8)]

    async def source() -> Any:
        for group in range(8):
            for i in range(4):
                yield f"k{group}-{i}", [{"role": "user", "content": f"p{group}-{i}"}]
            await clock.sleep(0.5)

    async def scenario() -> list[int]:
        async with VLLMQueueAnnotator(
            clients=clients, clock=clock, batch_size=4, max_concurrent_batches_per_client=4
        ) as pool:
            done = 0
            async for _key, _response in pool.astream(source()):
                done += 1
            assert done == 32
        # before the source ends (4.0): then idle slots hedge what the others hold
        return [sum(1 for at, _ in client.held if at < 3.9) for client in clients]

    assert asyncio.run(scenario()) == [4] * 8


def test_a_stream_reads_ahead_only_what_its_share_of_the_servers_can_start_soon() -> None:
    """A worker that shares its two servers with three others reads no further ahead
    than twice its share of their windows (2 x 2 x 64/4 rows), not twice the whole
    budget: a worker of a corpus job claims no unit it cannot start soon."""
    clock = FakeClock()
    clients = [LineClient(f"http://s{i}:1/v1", clock, capacity=8, service=0.1) for i in range(2)]
    pulled: list[int] = []
    most_ahead = [0]

    def source() -> Any:
        for i in range(400):
            pulled.append(i)
            yield f"k{i}", [{"role": "user", "content": f"p{i}"}]

    async def scenario() -> int:
        async with VLLMQueueAnnotator(
            clients=clients, clock=clock, batch_size=16, max_concurrent_batches_per_client=4
        ) as pool:
            pool.share_servers(4)
            done = 0
            async for _key, _response in pool.astream(source()):
                done += 1
                most_ahead[0] = max(most_ahead[0], len(pulled) - done)
            return done

    assert asyncio.run(scenario()) == 400
    assert 16 <= most_ahead[0] <= 2 * 2 * 16 + 1
