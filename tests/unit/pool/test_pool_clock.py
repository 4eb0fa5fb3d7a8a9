"""The pool's timing on a fake clock: minutes of health checks, backoff and deadlines
in milliseconds, and the same every run.

The clients here have no network (``ClockedClient``); the pool under test is the real
one, with its real defaults (3 s between probes, 4 s a probe, 3 failed probes evict,
300 s all-down deadline).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from llm_annotator import ErrorKind, PoolExhaustedError, Response, VLLMQueueAnnotator
from llm_annotator.errors import StatusError
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.health import CANARY_MESSAGES
from tests.unit.fake_clock import ClockedClient, FakeClock, overloaded


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"sample {i}"}] for i in range(n)]


def run(coro: Any) -> Any:
    started = time.process_time()  # CPU, not wall time: a loaded machine must not matter
    result = asyncio.run(coro)
    assert time.process_time() - started < 10, "fake time should cost next to no real time"
    return result


def test_a_hung_member_is_evicted_after_three_failed_probes_and_its_work_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member that stops answering /health (and its requests) at t=5 s is evicted
    after 3 failed probes (3 s apart, 4 s each): at about t=5+3x(3..4) s by the default
    settings, and every sample still completes on the other member."""
    clock = FakeClock()
    good = ClockedClient("http://good:1/v1", clock, latency=0.5)
    hang_at = 5.0
    bad = ClockedClient(
        "http://bad:1/v1",
        clock,
        healthy=lambda now: now < hang_at,
        answer=lambda prompt, now: None if now >= hang_at else Response(text=prompt, server="b"),
        latency=0.5,
    )
    evicted_at: list[float] = []
    original = Effects.evict

    def evict(self: Effects, *args: Any, **kwargs: Any) -> None:
        evicted_at.append(clock.now())
        original(self, *args, **kwargs)

    monkeypatch.setattr(Effects, "evict", evict)

    async def scenario() -> list[Response]:
        async with VLLMQueueAnnotator(clients=[good, bad], batch_size=4, clock=clock) as pool:
            return await pool.abatch_generate(messages=prompts(2000))

    responses = run(scenario())
    assert [r.text for r in responses] == [f"sample {i}" for i in range(2000)]
    print(f"evicted at fake t={evicted_at}")
    assert len(evicted_at) == 1
    assert hang_at + 3 * 3 <= evicted_at[0] <= hang_at + 3 * (3 + 4) + 1


def test_every_member_down_raises_at_the_all_down_deadline() -> None:
    """With no member answering, the call raises PoolExhaustedError once the fake clock
    passes all_down_timeout (300 s by default), and not before."""
    clock = FakeClock()
    dead = [
        ClockedClient(f"http://dead-{i}:1/v1", clock, healthy=lambda now: False) for i in range(2)
    ]

    async def scenario() -> float:
        async with VLLMQueueAnnotator(clients=dead, clock=clock) as pool:
            with pytest.raises(PoolExhaustedError, match="all_down_timeout=300"):
                await pool.abatch_generate(messages=prompts(5))
        return clock.now()

    ended = run(scenario())
    print(f"all-down raised at fake t={ended:.1f}")
    assert 300 <= ended <= 300 + 5


def test_an_overloaded_member_backs_off_longer_each_time() -> None:
    """A member answering 503 is paused 0.5, 1, 2, ... s (jitter aside) between tries;
    the samples finish on the other member meanwhile."""
    clock = FakeClock()
    busy_until = 30.0

    def busy(prompt: str, now: float) -> Response | Any:
        if now < busy_until:
            return overloaded("http://busy:1/v1")
        return Response(text=prompt, server="busy")

    busy_member = ClockedClient("http://busy:1/v1", clock, answer=busy, latency=0.01)
    other = ClockedClient("http://other:1/v1", clock, latency=2.0)

    async def scenario() -> list[Response]:
        async with VLLMQueueAnnotator(
            clients=[busy_member, other],
            batch_size=1,
            max_concurrent_batches_per_client=1,
            clock=clock,
        ) as pool:
            return await pool.abatch_generate(messages=prompts(12))

    responses = run(scenario())
    assert all(r.ok for r in responses)
    gaps = [b - a for a, b in zip(busy_member.sent, busy_member.sent[1:], strict=False)]
    early = [gap for gap, at in zip(gaps, busy_member.sent, strict=False) if at < busy_until]
    print("busy member pauses:", [round(g, 2) for g in early])
    assert len(early) >= 3
    assert early[2] > early[0]  # the pause grows


def test_overloaded_answers_are_retried_until_they_succeed() -> None:
    """A lone member that answers its first 30 requests 503 is backed off, never
    evicted, and every sample succeeds: 50 samples cost exactly 80 requests."""
    clock = FakeClock()
    busy = {"left": 30}

    def sometimes_busy(prompt: str, now: float) -> Response | Any:
        if busy["left"] > 0:
            busy["left"] -= 1
            return overloaded("http://busy:1/v1")
        return Response(text=prompt, server="busy")

    member = ClockedClient("http://busy:1/v1", clock, answer=sometimes_busy)

    async def scenario() -> tuple[list[Response], Any]:
        async with VLLMQueueAnnotator(clients=[member], batch_size=10, clock=clock) as pool:
            responses = await pool.abatch_generate(messages=prompts(50))
            return responses, pool.statistics()

    responses, stats = run(scenario())
    assert [r.text for r in responses] == [f"sample {i}" for i in range(50)]
    assert stats.evictions == 0
    assert len(member.sent) == 80


class DoubtedClient(ClockedClient):
    """The only member: sample 0's first try gets a 500; the test completion sent for
    it (the first, at fake t < 1) answers only after 60 s, with a 500; ``/health``
    fails from 2 s to 25 s, so the member is evicted and back meanwhile."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__("http://doubted:1/v1", clock, healthy=lambda now: not 2 <= now < 25)
        self.tries = 0

    async def asend(self, messages: Any, params: bytes) -> Response | Any:
        prompt = messages[-1]["content"]
        if prompt == CANARY_MESSAGES[-1]["content"] and self.clock.now() < 1:
            await self.clock.sleep(60.0)
            return StatusError("HTTP 500", kind=ErrorKind.SERVER_ERROR, server=self.base_url)
        if prompt == "sample 0":
            self.tries += 1
            if self.tries == 1:
                await self.clock.sleep(0.05)
                return StatusError("HTTP 500", kind=ErrorKind.SERVER_ERROR, server=self.base_url)
        return await super().asend(messages, params)


def test_a_test_completion_that_fails_after_its_member_was_evicted_and_back_is_stale() -> None:
    """A sample held for a test completion, whose member is evicted (its probes fail)
    and re-admitted before the completion fails: that eviction already counted the
    sample, and the member that rejoined is not evicted again for the old completion;
    the sample is sent again and answered."""
    clock = FakeClock()
    client = DoubtedClient(clock)

    async def scenario() -> tuple[list[Response], int]:
        async with VLLMQueueAnnotator(
            clients=[client], clock=clock, batch_size=2, max_sample_retries=0
        ) as pool:
            responses = await pool.abatch_generate(messages=prompts(1))
            return responses, pool.statistics().evictions

    (response,), evictions = run(scenario())
    print(f"ended at fake t={clock.now():.1f}, tries of sample 0: {client.tries}")
    assert response.text == "sample 0"
    assert evictions == 1
    assert clock.now() >= 60  # the sample waited for the old test completion
