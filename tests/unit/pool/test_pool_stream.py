"""VLLMQueueAnnotator.astream: samples in as a stream, results out as they complete."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from llm_annotator import VLLMQueueAnnotator
from tests.unit.conftest import FakeServer
from tests.unit.helpers import FAST, delayed_echo

FakeServers = Callable[[int], list[FakeServer]]
Pair = tuple[str, list[dict[str, str]]]
T = TypeVar("T")


async def closing(pool: VLLMQueueAnnotator, scenario: Coroutine[Any, Any, T]) -> T:
    """Run ``scenario`` (30 s at most), then close the pool on the same loop."""
    try:
        return await asyncio.wait_for(scenario, 30)
    finally:
        await pool.aclose()


def pairs(n: int, pulled: list[int] | None = None) -> Iterator[Pair]:
    for i in range(n):
        if pulled is not None:
            pulled.append(i)
        yield f"key-{i}", [{"role": "user", "content": f"sample {i}"}]


def test_stream_yields_every_key_once_and_reads_the_source_lazily(
    fake_servers: FakeServers,
) -> None:
    """Each key comes back once with its own answer, and the source is read only a
    bounded window ahead of what has completed."""
    servers = fake_servers(2)
    for server in servers:
        server.handler = delayed_echo(0.01)
    pulled: list[int] = []
    pulled_at_first_result: list[int] = []

    async def scenario(pool: VLLMQueueAnnotator) -> list[tuple[str, str | None]]:
        seen: list[tuple[str, str | None]] = []
        async for key, response in pool.astream(pairs(2000, pulled)):
            if not seen:
                pulled_at_first_result.append(len(pulled))
            seen.append((key, response.text))
        return seen

    pool = VLLMQueueAnnotator(
        [s.base_url for s in servers], batch_size=8, max_concurrent_batches_per_client=2, **FAST
    )
    seen = asyncio.run(closing(pool, scenario(pool)))
    keys = Counter(key for key, _ in seen)
    assert len(keys) == 2000
    assert max(keys.values()) == 1
    assert all(text == f"sample {key.split('-')[1]}" for key, text in seen)
    window = 2 * 8 * 2 * 2  # 2 x batch_size x slots x members
    assert pulled_at_first_result[0] <= window + 1


def test_async_source_and_a_pool_that_runs_again(fake_servers: FakeServers) -> None:
    """An async iterable works as a source, and the pool takes another call after a
    consumer that stops reading early."""
    servers = fake_servers(2)

    async def source(n: int) -> AsyncIterator[Pair]:
        for pair in pairs(n):
            await asyncio.sleep(0)
            yield pair

    async def scenario(pool: VLLMQueueAnnotator) -> tuple[int, int]:
        first = 0
        async with contextlib.aclosing(pool.astream(source(500))) as stream:
            async for _key, _response in stream:
                first += 1
                if first == 10:
                    break
        second = [r async for r in pool.astream(source(300))]
        return first, len(second)

    pool = VLLMQueueAnnotator([s.base_url for s in servers], batch_size=16, **FAST)
    first, second = asyncio.run(closing(pool, scenario(pool)))
    assert pool.statistics().in_flight == 0
    assert (first, second) == (10, 300)


def test_stop_lets_requests_in_flight_finish_and_sends_nothing_new(
    fake_servers: FakeServers,
) -> None:
    """After stop is set, the requests in flight still come back, nothing new is sent,
    and the stream ends."""
    servers = fake_servers(2)
    for server in servers:
        server.handler = delayed_echo(0.2)

    async def scenario(pool: VLLMQueueAnnotator) -> tuple[int, int]:
        stop = asyncio.Event()
        got = 0
        sent_at_stop = 0
        async for _key, response in pool.astream(pairs(5000), stop=stop):
            assert response.ok
            got += 1
            if got == 20:
                stats = pool.statistics()
                sent_at_stop = stats.completed + stats.in_flight
                stop.set()
        return got, sent_at_stop

    pool = VLLMQueueAnnotator(
        [s.base_url for s in servers], batch_size=10, max_concurrent_batches_per_client=2, **FAST
    )
    got, sent_at_stop = asyncio.run(closing(pool, scenario(pool)))
    sent = sum(len(s.requests) for s in servers)
    assert sent == sent_at_stop  # nothing new after the stop
    assert got == sent  # every request in flight came back
    assert got < 5000


def test_a_failing_source_ends_the_stream_with_its_error(fake_servers: FakeServers) -> None:
    """An exception raised by the source reaches the consumer, after the results
    completed before it."""
    servers = fake_servers(1)

    def broken() -> Iterator[Pair]:
        yield from pairs(5)
        raise OSError("disk gone")

    async def scenario(pool: VLLMQueueAnnotator) -> bool:
        with pytest.raises(OSError, match="disk gone"):
            async for _ in pool.astream(broken()):
                pass
        again = await pool.abatch_generate(messages=[[{"role": "user", "content": "sample 1"}]])
        return again[0].ok

    pool = VLLMQueueAnnotator([servers[0].base_url], **FAST)
    assert asyncio.run(closing(pool, scenario(pool)))
