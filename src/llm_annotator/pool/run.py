"""The state of one pooled call: open samples, the work queue, and a change signal."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from llm_annotator.clients.base import Messages
from llm_annotator.errors import PoolExhaustedError
from llm_annotator.pool.affinity import FifoQueue, WorkQueue
from llm_annotator.pool.clock import SYSTEM_CLOCK, Clock
from llm_annotator.response import Response

Deliver = Callable[[int, Response], None]
"""Called once per sample with its final Response."""


@dataclass(slots=True, eq=False)
class SampleState:
    """One open sample of a call: its conversation and what befell it so far. It lives
    from :meth:`Run.admit` until its Response is stored, and goes with it."""

    messages: Messages
    retries: int = 0
    """Resends after transient server errors."""
    overloads: int = 0
    """Answers that said the server was overloaded (429, 503)."""
    faults: int = 0
    """Answers that were the server's fault."""
    first_fault_at: float | None = None
    avoid: str | None = None
    """The member whose fault the last failure was: the sample goes elsewhere."""
    evicted_with: list[tuple[str, int]] | None = None
    """The evictions it was on, in order: each member and that member's count of
    evictions then (the same eviction is counted once; poison at the limit)."""
    hedged: bool = False
    """Also sent to a second member near the end (the first answer wins)."""
    copies: list[asyncio.Task[Any]] | None = None
    """The requests of a hedged sample: storing its Response cancels the rest."""


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
        self.open: dict[int, SampleState] = {}
        """Each open sample's conversation and history, the one place that holds them."""
        self.queue: WorkQueue = FifoQueue()
        """The samples waiting to be sent (a stream with prefix affinity sets a
        :class:`~llm_annotator.pool.affinity.GroupQueue` before its first sample)."""
        self.warmup: Messages | None = None
        """A conversation each member answers once before its first sample (the
        prompts' shared prefix), or None."""
        self.admitted = 0
        self.delivered = 0
        self.source_done = False
        self.stop: asyncio.Event | None = None
        """Set by the caller: no new work is taken; the run ends once nothing is in flight."""
        self.started = clock.now()
        self.avoiding = 0
        """Open samples whose last failure was a member's fault (they go elsewhere)."""
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

    def admit(self, index: int, messages: Messages, group: Hashable | None = None) -> None:
        """Add one sample (of ``group``, for prefix affinity) at the back of the queue."""
        self.open[index] = SampleState(messages)
        self.queue.push(index, group)
        self.admitted += 1

    def close_source(self) -> None:
        """No sample will be admitted any more."""
        self.source_done = True
        if not self.open:
            self.finish()
        self.notify()

    def store(self, index: int, response: Response) -> bool:
        """Record the result of sample ``index``; False if it already had one."""
        sample = self.open.pop(index, None)
        if sample is None:
            return False
        if sample.copies:
            for copy in sample.copies:
                if not copy.done():
                    copy.cancel()  # the server drops a request whose client left
        if sample.avoid is not None:
            self.avoiding -= 1
        if response.ok:
            self.last_success_at = self.clock.now()
        self.delivered += 1
        self.deliver(index, response)
        if self.source_done and not self.open:
            self.finish()
        return True

    def note_fault(self, index: int, server: str) -> int:
        """Count a server-fault answer to sample ``index`` from ``server``; how many (0 if
        the sample is closed)."""
        sample = self.open.get(index)
        if sample is None:
            return 0
        sample.faults += 1
        if sample.first_fault_at is None:
            sample.first_fault_at = self.clock.now()
        if sample.avoid is None:
            self.avoiding += 1
        sample.avoid = server
        return sample.faults

    def requeue(self, indices: list[int]) -> int:
        """Put the samples that are still open back at the front of the queue."""
        open_ = [i for i in indices if i in self.open]
        if open_:
            self.queue.push_front(open_)
            self.notify()
        return len(open_)

    def take(
        self,
        slots: int = 1,
        avoid: str | None = None,
        limit: int | None = None,
        member: str = "",
    ) -> list[int] | None:
        """Open samples for ``member`` (its base URL); None if there are none.

        A batch holds ``batch_size`` samples (or ``limit``, if fewer), except once the
        source is done: then at
        most an even share of the queue over ``slots`` (the batch slots taking work),
        so the last samples spread over every member instead of ending up in a few
        full batches on the slowest. Samples whose last failure was the fault of the
        member ``avoid`` are left at the front for another member. Which samples
        the queue gives ``member`` is its own affair (see
        :mod:`~llm_annotator.pool.affinity`).
        """
        if self.stopping:
            return None
        size = self.batch_size if limit is None else min(limit, self.batch_size)
        if self.source_done:
            size = max(1, min(size, -(-len(self.queue) // max(slots, 1))))
        shunned = avoid if self.avoiding else None
        open_ = self.open
        skip = None if shunned is None else (lambda index: open_[index].avoid == shunned)
        return self.queue.take(member, size, open_, skip) or None

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
