"""Nothing outlives a pool call: no task is left running after a call ends, however it
ends (all answered, a stream closed early, a stop, every server down), and closing the
pool closes every connection (an unclosed session would fail the test: warnings are
errors here)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable

import pytest

from llm_annotator import PoolExhaustedError, VLLMQueueAnnotator
from llm_annotator.clients._deadline import SWEEP_INTERVAL
from tests.unit.conftest import FakeServer
from tests.unit.fake_clock import ClockedClient, FakeClock
from tests.unit.helpers import FAST, conversations, delayed_echo

FakeServers = Callable[[int], list[FakeServer]]


def others() -> set[asyncio.Task[object]]:
    """The tasks of this loop besides the running one."""
    return asyncio.all_tasks() - {asyncio.current_task()}


async def settled(idle: float = 0.0) -> set[asyncio.Task[object]]:
    """The tasks left once the loop has had a few turns to finish what was cancelled,
    and ``idle`` seconds for a client's deadline sweeper to see it has nothing to do."""
    await asyncio.sleep(idle)
    for _ in range(20):
        await asyncio.sleep(0)
    return others()


IDLE = 2 * SWEEP_INTERVAL
"""A client's deadline sweeper outlives its last request by at most one interval."""


def test_no_task_outlives_a_call_however_it_ends(fake_servers: FakeServers) -> None:
    """After each kind of end, the loop holds no task of the pool or its clients (the
    deadline sweeper within a moment); after the pool closes, none at once."""
    servers = fake_servers(2)
    for server in servers:
        server.handler = delayed_echo(0.01)

    async def scenario() -> None:
        before = others()
        async with VLLMQueueAnnotator([s.base_url for s in servers], batch_size=8, **FAST) as pool:
            # All answered.
            responses = await pool.abatch_generate(messages=conversations(200))
            assert len(responses) == 200
            assert await settled(IDLE) == before
            # A stream closed after 10 answers, with work still in flight.
            pairs = ((i, m) for i, m in enumerate(conversations(500)))
            async with contextlib.aclosing(pool.astream(pairs)) as stream:
                seen = 0
                async for _ in stream:
                    seen += 1
                    if seen == 10:
                        break
            assert await settled(IDLE) == before
            # A stream stopped by its caller.
            stop = asyncio.Event()
            got = 0
            async for _ in pool.astream(enumerate(conversations(500)), stop=stop):
                got += 1
                stop.set()
            assert 1 <= got < 500
            assert await settled(IDLE) == before
            # The pool is free for its next call.
            assert len(await pool.abatch_generate(messages=conversations(5))) == 5
        assert await settled() == before

    asyncio.run(scenario())
    gc.collect()  # an unclosed session would warn here, and warnings are errors


def test_no_task_outlives_a_pool_that_gave_up() -> None:
    """A call that raises PoolExhaustedError leaves no probe loop or slot behind."""
    clock = FakeClock()
    dead = ClockedClient("http://dead:1/v1", clock, healthy=lambda now: False)

    async def scenario() -> None:
        before = others()
        async with VLLMQueueAnnotator(clients=[dead], clock=clock) as pool:
            with pytest.raises(PoolExhaustedError):
                await pool.abatch_generate(messages=conversations(5))
            left = await settled()
        # The fake clock's own driver may still be parked; nothing of the pool is.
        assert {t for t in left - before if "FakeClock" not in repr(t.get_coro())} == set()

    asyncio.run(scenario())
