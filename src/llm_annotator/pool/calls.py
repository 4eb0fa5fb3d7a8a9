"""Calls: one batch or one stream through the pool, from the first probe to the last answer."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Coroutine,
    Hashable,
    Iterable,
    Sequence,
)
from typing import Any, TypeVar

import structlog

from llm_annotator._gc import fewer_full_collections
from llm_annotator.clients.base import Messages
from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions
from llm_annotator.errors import ErrorKind, PoolExhaustedError, ProviderError
from llm_annotator.pool.affinity import GroupQueue
from llm_annotator.pool.discovery import PoolLike
from llm_annotator.pool.dispatch import Dispatcher
from llm_annotator.pool.health import HealthMonitor
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member
from llm_annotator.pool.run import Deliver, Run
from llm_annotator.pool.state import PoolState
from llm_annotator.response import Response

log = structlog.get_logger(__name__)

K = TypeVar("K")

CACHE_EVERY = 30.0
"""Seconds between two reads of the members' prefix-cache counters during a stream."""
CACHE_FIRST_EVERY = 2.0
"""The same, while some member has not been read yet (it was starting, or down)."""
CACHE_FIRST_READS = 10
"""Reads that often at most: then every :data:`CACHE_EVERY` seconds, whatever is known."""
CACHE_READ_TIMEOUT = 2.0
"""Seconds one such read may take (a server that does not answer is read next time)."""


class Calls:
    """``abatch_generate`` and ``astream``: a call's life on the pool.

    ``pool`` is what a discovery adds servers to and removes them from.
    """

    def __init__(
        self, state: PoolState, dispatcher: Dispatcher, health: HealthMonitor, pool: PoolLike
    ) -> None:
        self._state = state
        self._dispatcher = dispatcher
        self._health = health
        self._pool = pool

    async def abatch_generate(
        self,
        messages: list[Messages],
        options: VLLMOnlineRuntimeOptions | None,
        gen_kwargs: dict[str, Any] | None,
    ) -> list[Response]:
        """The responses to ``messages``, in order (see the pool's method)."""
        if not messages:
            return []
        results: list[Response | None] = [None] * len(messages)

        def deliver(index: int, response: Response) -> None:
            results[index] = response

        run = self._begin(deliver, options, gen_kwargs)
        for index, conversation in enumerate(messages):
            run.admit(index, conversation)
        run.close_source()
        started = self._state.clock.now()
        try:
            await self._drive(run)
        except PoolExhaustedError as exc:
            exc.responses = list(results)
            raise
        done: list[Response] = [r for r in results if r is not None]
        self._report(done, self._state.clock.now() - started)
        return done

    async def astream(
        self,
        samples: Iterable[tuple[K, Messages]] | AsyncIterable[tuple[K, Messages]],
        options: VLLMOnlineRuntimeOptions | None,
        gen_kwargs: dict[str, Any] | None,
        stop: asyncio.Event | None,
        group: Callable[[K], Hashable | None] | None = None,
        warmup: Messages | None = None,
    ) -> AsyncGenerator[tuple[K, Response], None]:
        """``(key, Response)`` for each sample as it completes (see the pool's method)."""
        outbox: deque[tuple[K, Response]] = deque()
        keys: dict[int, K] = {}
        arrived = asyncio.Event()
        room = asyncio.Event()

        def deliver(index: int, response: Response) -> None:
            outbox.append((keys.pop(index), response))
            arrived.set()

        config = self._state.config

        def has_room(run: Run) -> bool:
            # Twice what the members may hold now: what they can start soon. A worker
            # that shares the servers with others (``share_servers``), or whose
            # windows start small, reads (and claims) no further ahead than that.
            ceiling = self._dispatcher.ceiling
            members = self._state.members.values()
            soon = sum(min(m.window.size, ceiling) for m in members)
            return len(run.open) + len(outbox) < 2 * max(soon, config.batch_size)

        run = self._begin(deliver, options, gen_kwargs)
        run.stop = stop
        affinity = config.prefix_affinity
        run.warmup = warmup if affinity else None
        if affinity and group is not None:
            run.queue = GroupQueue(self._dispatcher.working)
        extra = [
            self._feed(run, samples, keys, has_room, room, group if affinity else None),
            self._watch_caches(run),
        ]
        if stop is not None:
            extra.append(self._watch_stop(run, stop))
        driver = asyncio.ensure_future(self._drive(run, extra))
        try:
            while True:
                while outbox:
                    yield outbox.popleft()
                room.set()
                if driver.done():
                    break
                arrived.clear()
                waiter = asyncio.ensure_future(arrived.wait())
                await asyncio.wait({driver, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            driver.result()  # PoolExhaustedError, or a failure of the source
            await self._read_caches()  # what the servers' caches did, to the last answer
        finally:
            if not driver.done():
                run.finish()  # every loop of the call ends on its own, then cancel
                driver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await driver

    def _begin(
        self,
        deliver: Deliver,
        options: VLLMOnlineRuntimeOptions | None,
        gen_kwargs: dict[str, Any] | None,
    ) -> Run:
        """Check the options and claim the pool for one call."""
        state = self._state
        if state.run is not None:
            raise RuntimeError("the pool runs one call at a time")
        state.prototype().encode_params(options, gen_kwargs)  # ValueError before anything
        run = Run(state.config.batch_size, deliver, state.clock)
        state.run, state.loop = run, asyncio.get_running_loop()
        state.params, state.options = {}, (options, gen_kwargs)
        return run

    async def _drive(self, run: Run, extra: Sequence[Coroutine[Any, Any, None]] = ()) -> None:
        """Run the members on ``run`` until it finishes; then release the pool."""
        log.info(
            "run_started",
            samples=run.admitted if run.source_done else None,
            servers=len(self._state.members),
            batch_size=self._state.config.batch_size,
            batches_per_server=self._state.config.max_concurrent_batches_per_client,
        )
        try:
            with fewer_full_collections():
                async with asyncio.TaskGroup() as group:
                    self._state.open_tasks(group)
                    for member in list(self._state.members.values()):
                        self._dispatcher.attach(run, member)
                    self._state.spawn(self._health.watch_all_down(run))
                    if self._state.discovery is not None:
                        self._state.spawn(self._state.discovery.run(self._pool, run.done))
                    for coro in extra:
                        self._state.spawn(coro)
                    await run.done.wait()
                    self._state.cancel_tasks()
        finally:
            for coro in extra:
                coro.close()  # never started if the group failed early
            self._state.cancel_tasks()
            for member in list(self._state.members.values()):
                member.in_flight.clear()
                member.suspects.clear()
                if member.state is MemberState.DRAINING:
                    self._state.forget(member)
            self._state.run = None
        if run.failure is not None:
            raise run.failure
        if run.exhausted is not None:
            log.error("pool_exhausted", servers=run.exhausted.servers, done=run.delivered)
            raise run.exhausted

    async def _feed(
        self,
        run: Run,
        samples: Iterable[tuple[K, Messages]] | AsyncIterable[tuple[K, Messages]],
        keys: dict[int, K],
        has_room: Callable[[Run], bool],
        room: asyncio.Event,
        group: Callable[[K], Hashable | None] | None,
    ) -> None:
        """Admit samples from the caller's stream while the window has room."""
        index = 0
        try:
            async for key, conversation in _aiterate(samples):
                while not has_room(run):
                    run.notify()
                    room.clear()
                    await room.wait()
                if run.finished or run.stopping:
                    return
                idle = not run.queue
                keys[index] = key
                run.admit(index, conversation, None if group is None else group(key))
                index += 1
                if idle:
                    run.notify()
        except Exception as exc:  # the source failed: end the call with its error
            run.finish(failure=exc)
            return
        run.close_source()

    async def _watch_caches(self, run: Run) -> None:
        """Read the members' prefix-cache counters at the start of a stream, every
        :data:`CACHE_FIRST_EVERY` seconds until each member has a first reading (at
        most :data:`CACHE_FIRST_READS` times: a server may not export them), then
        every :data:`CACHE_EVERY` seconds (the end of the stream reads them again)."""
        reads = 0
        while not run.finished:
            await self._read_caches(every=True)
            reads += 1
            known = reads >= CACHE_FIRST_READS or all(
                m.prefix_cache.last is not None or m.state is MemberState.DISABLED
                for m in self._state.members.values()
            )
            await self._state.clock.sleep(CACHE_EVERY if known else CACHE_FIRST_EVERY)

    async def _read_caches(self, *, every: bool = False) -> None:
        """Read the members' prefix-cache counters from their ``/metrics``: every member
        but a disabled one (``every``), or those taking work. A read that fails is
        skipped: the next one counts what grew meanwhile."""
        timeout = min(self._state.config.health_check_timeout, CACHE_READ_TIMEOUT)
        now = self._state.clock.now()
        members = [
            m
            for m in self._state.members.values()
            if (m.state is not MemberState.DISABLED if every else m.takes_work(now))
        ]

        async def read(member: Member) -> None:
            try:
                member.prefix_cache.note(await member.client.aengine_load(timeout))
            except Exception as exc:  # a statistic: never the call's failure
                log.debug("prefix_cache_unread", server=member.url, error=repr(exc))

        await asyncio.gather(*(read(m) for m in members))

    async def _watch_stop(self, run: Run, stop: asyncio.Event) -> None:
        """Once ``stop`` is set, take no new work and end when nothing is in flight."""
        await stop.wait()
        in_flight = sum(len(m.in_flight) for m in self._state.members.values())
        log.info("run_stopping", in_flight=in_flight, open=len(run.open))
        run.notify()
        while not run.finished:
            if not any(m.in_flight or m.suspects for m in self._state.members.values()):
                run.finish()
                return
            await run.wait_for_change(0.1)

    def _report(self, results: list[Response], elapsed: float) -> None:
        failed = [r for r in results if not r.ok]
        log.info(
            "run_finished",
            samples=len(results),
            failed=len(failed),
            seconds=round(elapsed, 3),
            per_server=dict(Counter(r.server for r in results if r.ok)),
        )
        if not failed:
            return
        if self._state.config.on_error == "raise":
            first = failed[0]
            said = first.error or "request failed"
            if first.server:
                said = said.removeprefix(f"{first.server}: ")  # the error names it again
            raise ProviderError(
                said,
                kind=ErrorKind(first.error_type or ErrorKind.HTTP_ERROR.value),
                server=first.server,
            )
        if self._state.config.on_error == "warn":
            log.warning(
                "requests_failed",
                failed=len(failed),
                total=len(results),
                kinds=dict(Counter(r.error_type for r in failed)),
                first_error=failed[0].error,
            )


async def _aiterate(samples: Iterable[K] | AsyncIterable[K]) -> AsyncIterator[K]:
    """Iterate a sync or an async iterable the same way."""
    if isinstance(samples, AsyncIterable):
        async for item in samples:
            yield item
    else:
        for item in samples:
            yield item
