"""Whole-request deadlines at the cost of a dict entry, not a timer, per request.

aiohttp's own ``ClientTimeout(total=...)`` bounds a whole request too, but arms and
enters a timer around every read, which costs about 10 us of CPU per request at
thousands in flight (``benchmarks/annotate_overhead.py``, side by side). Here each
request only notes its deadline; one sweeper task per event loop wakes every
:data:`SWEEP_INTERVAL` seconds and cancels the requests past theirs. A request so
cancelled ends at its deadline plus at most the interval, and :meth:`Deadlines.expired`
tells it that the cancellation was the deadline's, not a caller's.
"""

from __future__ import annotations

import asyncio

SWEEP_INTERVAL = 0.25
"""Seconds between two sweeps: how late past its deadline a request may end."""


class Deadlines:
    """The open requests of one event loop and when each must end.

    Deadlines of one transport come in the order they expire (one timeout for all its
    requests), so a sweep stops at the first request still in time.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._open: dict[asyncio.Task[object], float] = {}
        self._expired: set[asyncio.Task[object]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def watch(self, task: asyncio.Task[object], seconds: float) -> None:
        """Cancel ``task`` if it is still watched ``seconds`` from now."""
        self._open[task] = self._loop.time() + seconds
        if self._sweeper is None:
            self._sweeper = self._loop.create_task(self._sweep())

    def release(self, task: asyncio.Task[object]) -> None:
        """``task`` is done with its request."""
        self._open.pop(task, None)

    def expired(self, task: asyncio.Task[object]) -> bool:
        """Whether ``task`` was cancelled by its deadline (asked once, then forgotten)."""
        if task in self._expired:
            self._expired.discard(task)
            return True
        return False

    def close(self) -> None:
        """Stop sweeping (the transport is closed: no request is left to watch)."""
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def _sweep(self) -> None:
        try:
            while self._open:
                await asyncio.sleep(SWEEP_INTERVAL)
                now = self._loop.time()
                late = []
                for task, deadline in self._open.items():
                    if deadline > now:
                        break  # the rest came later, with the same timeout
                    late.append(task)
                for task in late:
                    del self._open[task]
                    if not task.done():
                        self._expired.add(task)
                        task.cancel()
        finally:
            self._sweeper = None
