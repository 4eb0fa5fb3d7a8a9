"""One loop watches a running job and feeds everything that shows it.

Every :data:`~llm_annotator.jobs.watch.timeline.SAMPLE_INTERVAL` seconds the
:class:`Observer` hands the run's
:class:`~llm_annotator.jobs.watch.timeline.RunWatch` a look (the live metrics, the
timeline), and every :data:`~llm_annotator.jobs.watch.status.STATUS_INTERVAL` seconds
the :class:`~llm_annotator.jobs.watch.status.StatusFile` the job's figures. When the job
ends, both are told how by one rule (:func:`~llm_annotator.jobs.watch.outcome.outcome`),
so ``status.json`` and ``timeline.jsonl`` never tell different stories. The progress bar
is not fed by the loop: it redraws as rows are done.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import structlog

from llm_annotator.jobs.watch.outcome import outcome
from llm_annotator.jobs.watch.status import STATUS_INTERVAL, StatusFile
from llm_annotator.jobs.watch.timeline import SAMPLE_INTERVAL, RunWatch

log = structlog.get_logger(__name__)


class Observer:
    """The one watcher of a running job.

    Args:
        status: Writes ``status.json``.
        watch: Feeds the live metrics and the timeline.
        figures: The job's figures for ``status.json`` now.
        interval: Seconds between two looks.
        sleep: Waits that many seconds (tests give their own).
    """

    def __init__(
        self,
        status: StatusFile,
        watch: RunWatch,
        figures: Callable[[], dict[str, Any]],
        *,
        interval: float = SAMPLE_INTERVAL,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.status = status
        self.watch = watch
        self.figures = figures
        self.interval = interval
        self.status_every = max(1, math.ceil(STATUS_INTERVAL / interval))
        """``status.json`` is rewritten on every this many looks (the first included)."""
        self._sleep = sleep
        self.looks = 0
        self.writing: asyncio.Future[None] | None = None
        """The write of ``status.json`` under way, if any (a look while it runs skips its
        own: the next due look writes)."""

    @contextlib.asynccontextmanager
    async def kept(self) -> AsyncIterator[None]:
        """Watch while the block runs; then tell every sink how it ended.

        Raises:
            RunDirectoryError: ``status.json`` or ``timeline.jsonl`` cannot be written
                safely (a link, a FIFO), before the block runs.
        """
        await self.status.begin()
        try:
            await self.watch.begin()
        except BaseException as failure:  # a planted timeline: the job never starts
            # This job holds the run directory: its account replaces any earlier one.
            await asyncio.to_thread(self.status.write, self.figures(), *outcome(failure))
            raise
        task = asyncio.ensure_future(self._loop())
        state, error = outcome(None)
        try:
            yield
        except BaseException as failure:
            state, error = outcome(failure)
            raise
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if self.writing is not None:  # let it land, or it could land after the last
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.writing)
            try:
                await self.watch.end(state)
            except BaseException as failure:
                if state == "finished":
                    state, error = outcome(failure)
                raise
            finally:
                await self.status.end(self.figures(), state, error)

    async def _loop(self) -> None:
        while True:
            await self.look()
            await self._sleep(self.interval)

    async def look(self) -> None:
        """One look: the watch always, ``status.json`` when it is due (written beside,
        so that a slow disk under one never holds up the other)."""
        if self.looks % self.status_every == 0 and (self.writing is None or self.writing.done()):
            self.writing = asyncio.ensure_future(self._write_status(self.figures()))
        self.looks += 1
        await self.watch.observe()

    async def _write_status(self, figures: dict[str, Any]) -> None:
        try:
            await self.status.observe(figures)
        except Exception as error:  # watching must never stop the job
            log.warning("status_not_written", path=str(self.status.path), error=repr(error))
