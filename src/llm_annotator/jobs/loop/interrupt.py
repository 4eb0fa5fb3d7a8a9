"""SIGINT and SIGTERM: the first stops a job cleanly, the second at once."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import structlog

log = structlog.get_logger(__name__)

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """How a job learns it must stop.

    The first signal sets :attr:`stop`: no new rows are sent, the requests in flight
    get ``grace`` seconds to finish and be written. After the grace, or at a second
    signal, the job's task is cancelled; what is written stays written.

    A signal may arrive in any thread; :meth:`request` hands it to the job's loop.
    """

    def __init__(self, grace: float, *, stop: asyncio.Event | None = None) -> None:
        self.grace = grace
        self.stop = stop if stop is not None else asyncio.Event()
        self.signals: list[int] = []
        self.hard = False
        self.sending = False
        """Set once rows are being sent; before that a first signal stops at once."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[object] | None = None
        self._early: list[int] = []
        self._lock = threading.Lock()

    @property
    def triggered(self) -> bool:
        """Whether the job was told to stop (by a signal or the caller's event)."""
        return self.stop.is_set() or self.hard

    @property
    def reason(self) -> str:
        if self.signals:
            return signal.Signals(self.signals[-1]).name
        return "request"

    def bind(self) -> None:
        """Attach to the running job (call from its task)."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            early, self._early = self._early, []
        for signum in early:
            self._on_signal(signum)

    def request(self, signum: int) -> None:
        """A signal arrived; safe from any thread and from a signal handler."""
        with self._lock:
            loop = self._loop
            if loop is None:
                self._early.append(signum)
                return
        loop.call_soon_threadsafe(self._on_signal, signum)

    def uncancel(self) -> None:
        """Clear the cancellation this interrupt caused (the job then ends normally)."""
        if self._task is not None:
            self._task.uncancel()

    def _on_signal(self, signum: int) -> None:
        self.signals.append(signum)
        name = signal.Signals(signum).name
        if len(self.signals) == 1 and not self.sending:
            self.stop.set()
            self._cancel(f"{name} before any row was sent")
        elif len(self.signals) == 1:
            log.warning(
                "job_stopping",
                signal=name,
                grace_seconds=self.grace,
                hint="requests in flight finish and are written; signal again to stop now",
            )
            self.stop.set()
            if self._loop is not None:
                self._loop.call_later(self.grace, self._cancel, "grace period over")
        else:
            self._cancel(f"second signal ({name})")

    def _cancel(self, why: str) -> None:
        if self.hard or self._task is None or self._task.done():
            return
        log.warning("job_stopping_now", reason=why)
        self.hard = True
        self._task.cancel()


@contextlib.contextmanager
def handling_signals(interrupt: Interrupt, *, enabled: bool = True) -> Iterator[None]:
    """Route SIGINT and SIGTERM to ``interrupt`` while the block runs (main thread only)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        interrupt.request(signum)

    previous = {signum: signal.signal(signum, handler) for signum in _SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
