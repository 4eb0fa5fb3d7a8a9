"""The state of one pooled call: open samples, the work queue, and a change signal."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from llm_annotator.clients.base import Messages
from llm_annotator.errors import PoolExhaustedError
from llm_annotator.pool.clock import SYSTEM_CLOCK, Clock
from llm_annotator.response import Response

Deliver = Callable[[int, Response], None]
"""Called once per sample with its final Response."""


class Run:
    """Work and results of one call (``abatch_generate`` or a stream).

    A sample is *open* from :meth:`admit` until its first Response is stored; only open
    samples are sent, and storing is what closes one, so a sample that comes back twice
    (or from two members) is delivered once. The queue is a flat line of sample
    indices; a batch is whatever :meth:`take` cuts from its front, so samples put back
    after an eviction travel in full batches again, and requeued samples go first.

    A run ends when its source is exhausted and no sample is open, when it is stopped
    and nothing is in flight (see :attr:`stopping`), or when :meth:`finish` is called.
    Nothing here grows with the samples already delivered.
    """

    def __init__(self, batch_size: int, deliver: Deliver, clock: Clock = SYSTEM_CLOCK) -> None:
        self.batch_size = batch_size
        self.clock = clock
        self.deliver = deliver
        self.open: dict[int, Messages] = {}
        self.queue: deque[int] = deque()
        self.admitted = 0
        self.delivered = 0
        self.source_done = False
        self.stop: asyncio.Event | None = None
        """Set by the caller: no new work is taken; the run ends once nothing is in flight."""
        self.hedged: set[int] = set()
        """Open samples also sent to a second member near the end (first answer wins)."""
        self.copies: dict[int, list[asyncio.Task[Any]]] = {}
        """The requests of each hedged sample: storing its Response cancels the rest."""
        self.started = clock.now()
        self.evicted_with: dict[int, list[str]] = {}
        self.eviction_marks: dict[int, set[tuple[str, int]]] = {}
        """Which evictions (member, its eviction count) each sample was counted in."""
        self.retries: Counter[int] = Counter()
        self.overloads: Counter[int] = Counter()
        self.faults: Counter[int] = Counter()
        """Server-fault answers per open sample."""
        self.first_fault_at: dict[int, float] = {}
        self.avoid: dict[int, str] = {}
        """The member whose fault an open sample's last failure was: it goes elsewhere."""
        self.last_success_at = float("-inf")
        self.exhausted: PoolExhaustedError | None = None
        self.failure: BaseException | None = None
        self.done = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    @property
    def queued(self) -> int:
        """Samples in the queue (an upper bound: some may have finished meanwhile)."""
        return len(self.queue)

    @property
    def stopping(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def is_open(self, index: int) -> bool:
        return index in self.open

    def admit(self, index: int, messages: Messages) -> None:
        """Add one sample at the back of the queue."""
        self.open[index] = messages
        self.queue.append(index)
        self.admitted += 1

    def close_source(self) -> None:
        """No sample will be admitted any more."""
        self.source_done = True
        if not self.open:
            self.finish()
        self.notify()

    def store(self, index: int, response: Response) -> bool:
        """Record the result of sample ``index``; False if it already had one."""
        if self.open.pop(index, None) is None:
            return False
        if self.evicted_with:
            self.evicted_with.pop(index, None)
            self.eviction_marks.pop(index, None)
        self.hedged.discard(index)
        if self.copies:
            for copy in self.copies.pop(index, ()):
                if not copy.done():
                    copy.cancel()  # the server drops a request whose client left
        self.retries.pop(index, None)
        self.overloads.pop(index, None)
        if self.faults:
            self.faults.pop(index, None)
            self.first_fault_at.pop(index, None)
            self.avoid.pop(index, None)
        if response.ok:
            self.last_success_at = self.clock.now()
        self.delivered += 1
        self.deliver(index, response)
        if self.source_done and not self.open:
            self.finish()
        return True

    def note_fault(self, index: int, server: str) -> int:
        """Count a server-fault answer to sample ``index`` from ``server``; how many."""
        self.faults[index] += 1
        self.first_fault_at.setdefault(index, self.clock.now())
        self.avoid[index] = server
        return self.faults[index]

    def answered_since_first_fault(self, index: int) -> bool:
        """Whether any sample succeeded after ``index`` first failed by a server's fault."""
        return self.last_success_at > self.first_fault_at.get(index, float("inf"))

    def requeue(self, indices: list[int]) -> int:
        """Put the samples that are still open back at the front of the queue."""
        open_ = [i for i in indices if i in self.open]
        if open_:
            self.queue.extendleft(reversed(open_))
            self.notify()
        return len(open_)

    def take(
        self, slots: int = 1, avoid: str | None = None, limit: int | None = None
    ) -> list[int] | None:
        """Open samples from the front; None if there are none.

        A batch holds ``batch_size`` samples (or ``limit``, if fewer), except once the
        source is done: then at
        most an even share of the queue over ``slots`` (the batch slots taking work),
        so the last samples spread over every member instead of ending up in a few
        full batches on the slowest. Samples whose last failure was the fault of the
        member ``avoid`` are left at the front for another member.
        """
        if self.stopping:
            return None
        size = self.batch_size if limit is None else min(limit, self.batch_size)
        if self.source_done:
            size = max(1, min(size, -(-len(self.queue) // max(slots, 1))))
        batch: list[int] = []
        queue, open_ = self.queue, self.open
        shunned = self.avoid if avoid is not None and self.avoid else None
        skipped: list[int] = []
        while queue and len(batch) < size:
            index = queue.popleft()
            if index in open_:
                if shunned is not None and shunned.get(index) == avoid:
                    skipped.append(index)
                else:
                    batch.append(index)
        if skipped:
            queue.extendleft(reversed(skipped))
        return batch or None

    def finish(
        self, error: PoolExhaustedError | None = None, failure: BaseException | None = None
    ) -> None:
        if not self.finished:
            if error is not None:
                self.exhausted = error
            if failure is not None:
                self.failure = failure
        self.done.set()
        self.notify()

    def notify(self) -> None:
        """Wake everything waiting for a change (new work, a member's state, the end)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout: float) -> None:
        """Sleep until the next :meth:`notify`, or ``timeout`` seconds at most."""
        await self.clock.wait(self._changed, timeout)
