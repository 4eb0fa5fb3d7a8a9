"""Time, as the pool sees it: injectable, so that its timing is tested without waiting.

The pool never calls ``time.monotonic`` or ``asyncio.sleep`` itself; it asks its
:class:`Clock`. :class:`SystemClock` is the real one. A test gives a fake one (the test
suite's ``FakeClock`` jumps straight to the next wake-up when nothing else can run), and
health intervals, backoff and the all-down deadline then pass in no time at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol


class Clock(Protocol):
    """What the pool needs of time."""

    def now(self) -> float:
        """Seconds on a monotonic clock."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds``."""
        ...

    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        """Wait until ``event`` is set, or ``timeout`` seconds at most."""
        ...


class SystemClock:
    """The real clock: ``time.monotonic`` and the event loop's own timers.

    Examples:
        >>> clock = SystemClock()
        >>> clock.now() <= clock.now()
        True
    """

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
        # cancellation that arrives as the event fires, and the waiter then never ends.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await event.wait()


SYSTEM_CLOCK = SystemClock()
