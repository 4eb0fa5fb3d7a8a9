"""The state of one pooled call: the work queue, the results, and a change signal."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque

from llm_annotator.clients.base import Messages
from llm_annotator.errors import PoolExhaustedError
from llm_annotator.response import Response


class Run:
    """Work and results of one ``abatch_generate`` call.

    The queue is a flat line of sample indices; a batch is whatever :meth:`take` cuts
    from its front, so samples put back after an eviction travel in full batches
    again. Requeued samples go to the front. A sample is done once it has a Response;
    the first Response stored wins, so a sample that comes back twice is never written
    twice.
    """

    def __init__(self, messages: list[Messages], batch_size: int) -> None:
        self.messages = messages
        self.batch_size = batch_size
        self.results: list[Response | None] = [None] * len(messages)
        self.remaining = len(messages)
        self.queue: deque[int] = deque(range(len(messages)))
        self.evicted_with: dict[int, list[str]] = {}
        self.retries: Counter[int] = Counter()
        self.overloads: Counter[int] = Counter()
        self.exhausted: PoolExhaustedError | None = None
        self.done = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    @property
    def queued(self) -> int:
        """Samples in the queue (an upper bound: some may have finished meanwhile)."""
        return len(self.queue)

    def store(self, index: int, response: Response) -> bool:
        """Record the result of sample ``index``; False if it already had one."""
        if self.results[index] is not None:
            return False
        self.results[index] = response
        self.remaining -= 1
        if self.remaining == 0:
            self.finish()
        return True

    def requeue(self, indices: list[int]) -> int:
        """Put the samples that still lack a result back at the front of the queue."""
        open_ = [i for i in indices if self.results[i] is None]
        if open_:
            self.queue.extendleft(reversed(open_))
            self.notify()
        return len(open_)

    def take(self) -> list[int] | None:
        """Up to ``batch_size`` open samples from the front; None if there are none."""
        batch: list[int] = []
        queue, results = self.queue, self.results
        while queue and len(batch) < self.batch_size:
            index = queue.popleft()
            if results[index] is None:
                batch.append(index)
        return batch or None

    def finish(self, error: PoolExhaustedError | None = None) -> None:
        if error is not None and not self.finished:
            self.exhausted = error
        self.done.set()
        self.notify()

    def notify(self) -> None:
        """Wake everything waiting for a change (new work, a member's state, the end)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout: float) -> None:
        """Sleep until the next :meth:`notify`, or ``timeout`` seconds at most."""
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout)
