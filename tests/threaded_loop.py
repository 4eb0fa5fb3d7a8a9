"""An event loop in a thread of its own, for the in-process servers of the tests.

Its own loop lets the test's loop (async API) and the package's background loop (sync
API) both talk to a server without ever blocking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class ThreadedLoop:
    """A running loop; :meth:`call` runs a coroutine on it and waits for the result."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)


@contextlib.contextmanager
def threaded_loop(name: str, cleanup: Callable[[], Awaitable[None]]) -> Iterator[ThreadedLoop]:
    """A loop in a daemon thread; at the end ``cleanup()`` runs on it, then every task
    still there (a handler that sleeps for ever, say) is cancelled, and the loop closed."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    running = ThreadedLoop(loop)
    try:
        yield running
    finally:

        async def stop() -> None:
            await cleanup()
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        try:
            running.call(stop())
        finally:  # even when the clean-up failed: never leave the thread behind
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not thread.is_alive():
                loop.close()
