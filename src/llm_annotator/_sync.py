"""Run the async core from synchronous code, inside a notebook too.

The synchronous API (``generate``, ``batch_generate``, ...) hands its coroutine to one
event loop that runs in a daemon thread for the life of the process. ``asyncio.run``
cannot be used: it fails where a loop is already running (a Jupyter notebook), and a new
loop per call would throw away every open connection.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's where it is installed, asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _LoopThread:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = new_event_loop()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                thread = threading.Thread(target=serve, name="llm-annotator-loop", daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self.loop()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "a synchronous llm_annotator method was called from inside its own event "
                "loop; await the async twin (agenerate, abatch_generate, ...) instead"
            )
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            # KeyboardInterrupt in the caller's thread: stop the work it started.
            future.cancel()
            raise


_RUNNER = _LoopThread()


_AT_SHUTDOWN: list[Callable[[], Awaitable[None]]] = []


def on_shutdown(callback: Callable[[], Awaitable[None]]) -> None:
    """Have ``callback`` awaited on the background loop when the interpreter exits (a
    layer that opens connections registers its closer here; this module imports none).
    """
    _AT_SHUTDOWN.append(callback)


def _shut_down_at_exit() -> None:
    """Await what was registered (the clients close the connections they left open on
    the background loop), then stop the loop.

    The loop must not still be running when the interpreter tears down: a TLS
    connection being shut down in that thread then can crash the process (seen once as
    SIGSEGV after a finished https job). So the loop gets a moment to finish closing
    (TLS close_notify), is stopped, and its thread is joined.
    """
    loop, thread = _RUNNER._loop, _RUNNER._thread
    if loop is None or not loop.is_running():
        return  # no synchronous call was made: nothing runs on the loop

    async def close_all() -> None:
        await asyncio.gather(*(callback() for callback in _AT_SHUTDOWN), return_exceptions=True)
        await asyncio.sleep(0.1)  # let TLS connections finish closing

    with contextlib.suppress(Exception):
        asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout=3)
    loop.call_soon_threadsafe(loop.stop)
    if thread is not None:
        thread.join(timeout=3)


atexit.register(_shut_down_at_exit)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the shared background loop and return its result."""
    return _RUNNER.run(coro)
