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

    The queue holds batches of sample indices. Requeued samples go to the front. A
    sample is done once it has a Response; the first Response stored wins, so a sample
    that comes back twice is never written twice.
    """

    def __init__(self, messages: list[Messages], batch_size: int) -> None:
        self.messages = messages
        self.batch_size = batch_size
        self.results: list[Response | None] = [None] * len(messages)
        self.remaining = len(messages)
        self.queue: deque[list[int]] = deque(
            list(range(start, min(start + batch_size, len(messages))))
            for start in range(0, len(messages), batch_size)
        )
        self.evicted_with: dict[int, list[str]] = {}
        self.retries: Counter[int] = Counter()
        self.exhausted: PoolExhaustedError | None = None
        self.done = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    @property
    def queued(self) -> int:
        return sum(len(batch) for batch in self.queue)

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
        for start in reversed(range(0, len(open_), self.batch_size)):
            self.queue.appendleft(open_[start : start + self.batch_size])
        if open_:
            self.notify()
        return len(open_)

    def take(self) -> list[int] | None:
        """The next batch, skipping samples finished meanwhile; None if the queue is empty."""
        while self.queue:
            batch = [i for i in self.queue.popleft() if self.results[i] is None]
            if batch:
                return batch
        return None

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
