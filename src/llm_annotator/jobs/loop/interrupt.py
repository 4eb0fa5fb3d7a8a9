"""SIGINT and SIGTERM: the first stops a job cleanly, the second at once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import structlog

from llm_annotator.errors import RunInterruptedError

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

    outer = _outer(signal.getsignal(signal.SIGTERM)) or _outer(signal.getsignal(signal.SIGINT))

    def handler(signum: int, frame: FrameType | None) -> None:
        if outer is not None:
            outer.note(signum)  # kept for after the job, should it end without stopping
        interrupt.request(signum)

    previous = {signum: signal.signal(signum, handler) for signum in _SIGNALS}
    if outer is not None and outer.signum is not None:
        interrupt.request(outer.signum)  # came just before the job: it stops at once
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)


class BetweenJobs:
    """SIGINT and SIGTERM for a worker that runs one job after another (a pipeline's
    elastic worker, turn after turn), while no job runs: each job routes them to its own
    clean stop while it runs (:func:`handling_signals`), but between two jobs, and in a
    pause between two passes, the first would have ended the process on the spot. Here
    it is kept, ends a :meth:`pause` early, and :meth:`check` raises it at the worker's
    next safe point; a second one goes to the handler there was before (SIGINT's raises
    ``KeyboardInterrupt``; SIGTERM's default ends the process). A signal that reaches a
    job inside is kept here too (a job near its end may finish without acting on it),
    and a job that starts with one kept stops before it sends anything."""

    PAUSE_SLICE = 0.1
    """Seconds a :meth:`pause` sleeps between two looks at the signals (a handler only
    sets a flag: it takes no lock the interrupted code may hold)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}

    def note(self, signum: int) -> None:
        """A signal came (to this worker's handler, or to a job's inside)."""
        if self.signum is None:
            self.signum = signum

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            return
        previous = self.previous.get(signum) or signal.SIG_DFL  # None: not set from Python
        signal.signal(signum, previous)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            os.kill(os.getpid(), signum)

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or until a signal; then :meth:`check`."""
        deadline = time.monotonic() + seconds
        while self.signum is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, self.PAUSE_SLICE))
        self.check()

    def check(self) -> None:
        """Raise the stop a signal asked for, if one came.

        Raises:
            RunInterruptedError: A signal came since the worker began.
        """
        if self.signum is not None:
            name = signal.Signals(self.signum).name
            raise RunInterruptedError(
                f"stopped by {name} between two jobs; everything done is kept, and running "
                "the worker again goes on with it",
                signum=self.signum,
            )


@contextlib.contextmanager
def between_jobs(*, enabled: bool = True) -> Iterator[BetweenJobs]:
    """Route SIGINT and SIGTERM to a :class:`BetweenJobs` while the block runs (main
    thread only; a job inside it routes them to itself while it runs)."""
    between = BetweenJobs()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield between
        return
    between.previous = {signum: signal.signal(signum, between.handler) for signum in _SIGNALS}
    try:
        yield between
    finally:
        for signum, old in between.previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)


def _outer(handler: object) -> BetweenJobs | None:
    """The :class:`BetweenJobs` whose handler ``handler`` is, if it is one."""
    owner = getattr(handler, "__self__", None)
    return owner if isinstance(owner, BetweenJobs) else None
