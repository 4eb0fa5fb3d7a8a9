"""The work queue of a call, plain or with prefix affinity.

vLLM caches prompt prefixes per server: a document computed on server A is nearly free
for the next question about it on A and paid in full on B. With prefix affinity each
sample may carry a *group* (a document id, a hash of a shared prefix), and the queue
keeps a group's samples together for one member, its *home*:

- A member takes its own groups' samples first, a group's queued samples together.
- Then new groups, in the order they arrived: the member that takes a group becomes
  its home, so its later samples follow it there while they meet a warm cache.
- A member with room and nothing of its own or new left takes from the member whose
  own queue is longest (no member idles while work waits): the group that member
  would reach last, which moves to it whole.
- Bounded load: a group goes to its remembered home only while that member holds at
  most :func:`load_bound` queued samples; else it starts afresh for any member. (The
  bound is on giving groups a home: samples that join a group already queued at its
  home join it there, and idle members take the coldest groups of the fullest.)
- A member that stops taking work hands its groups back (:meth:`GroupQueue.release`).

Both queues count entries, not open samples: a sample closed while queued (answered
by a hedge) stays an entry until a take skips it, so lengths are upper bounds.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol

from llm_annotator.pool.books import (
    PrefixCacheBook as PrefixCacheBook,  # re-exported: it was defined here
)

LOAD_BOUND = 1.25
"""A home holds at most this much more than an even share of the queue."""
MIN_LOAD = 256
"""A home may hold this many queued samples whatever the even share (a group of a
few hundred rows stays whole at the end of a call)."""
HOMES_KEPT = 65_536
"""Groups whose home is remembered after their last queued sample left (the most
recent): a group's rows that arrive apart still meet the cache that holds them."""


def load_bound(queued: int, members: int, *, bound: float = LOAD_BOUND) -> int:
    """The most queued samples one member may hold as the home of its groups.

    ``bound`` times an even share of the ``queued`` samples over ``members``, and never
    less than :data:`MIN_LOAD`.

    Examples:
        >>> load_bound(8000, 4)
        2500
        >>> load_bound(10, 4)
        256
    """
    share = -(-queued // max(members, 1))
    return max(MIN_LOAD, int(share * bound + 0.999999))


class Skip(Protocol):
    """Whether a queued sample must not go to the member taking now: it is closed, or
    its last failure was that member's fault."""

    def __call__(self, index: int) -> bool: ...


class FifoQueue:
    """The plain queue: samples in the order they arrived, requeued ones first."""

    __slots__ = ("_line",)

    def __init__(self) -> None:
        self._line: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._line)

    def push(self, index: int, group: Hashable | None = None) -> None:
        """Add a sample at the back (``group`` is ignored)."""
        self._line.append(index)

    def push_front(self, indices: list[int]) -> None:
        """Put samples back at the front, in their order."""
        self._line.extendleft(reversed(indices))

    def take(
        self, member: str, size: int, open_: Mapping[int, Any], avoid: Skip | None
    ) -> list[int]:
        """Up to ``size`` open samples from the front (``member`` is not used).

        ``open_`` is the open samples (a sample not in it is dropped); ``avoid`` says
        which ones to leave at the front for another member.
        """
        batch: list[int] = []
        skipped: list[int] = []
        _cut(self._line, size, open_, avoid, batch, skipped)
        if skipped:
            self._line.extendleft(reversed(skipped))
        return batch

    def release(self, member: str) -> None:
        """Nothing is kept for a member here."""

    def held(self) -> dict[str, int]:
        """Queued samples kept for each member: none."""
        return {}


class GroupQueue:
    """The queue with prefix affinity (see the module's docstring).

    Args:
        members: How many members take work now (for the load bound), asked at each
            take.
        bound: See :func:`load_bound`.
    """

    __slots__ = ("_bound", "_count", "_fresh", "_groups", "_homes", "_load", "_members", "_own")

    def __init__(self, members: Callable[[], int], *, bound: float = LOAD_BOUND) -> None:
        self._members = members
        self._bound = bound
        self._groups: dict[Hashable, deque[int]] = {}
        """Each group with queued samples: them, in order."""
        self._fresh: deque[Hashable] = deque()
        """Groups with queued samples and no home, in the order they arrived."""
        self._own: dict[str, deque[Hashable]] = {}
        """Each member's groups with queued samples, in the order it got them."""
        self._homes: OrderedDict[Hashable, str] = OrderedDict()
        """Each group's member (the most recent :data:`HOMES_KEPT` once emptied)."""
        self._load: dict[str, int] = {}
        """Queued samples in each member's groups."""
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, index: int, group: Hashable | None = None) -> None:
        """Add a sample of ``group`` (None: a group of its own) at the back."""
        if group is None:
            group = _Single(index)
        self._count += 1
        samples = self._groups.get(group)
        if samples is not None:  # the group is queued: the sample joins it
            samples.append(index)
            home = self._homes.get(group)
            if home is not None:
                self._load[home] += 1
            return
        self._groups[group] = deque((index,))
        home = self._homes.get(group)
        if home is not None and self._load.get(home, 0) < self._limit():
            self._own.setdefault(home, deque()).append(group)
            self._load[home] = self._load.get(home, 0) + 1
            self._homes.move_to_end(group)
        else:
            if home is not None:
                del self._homes[group]  # its home is full: any member may take it
            self._fresh.append(group)

    def push_front(self, indices: list[int]) -> None:
        """Put samples back at the front, each a group of its own (a requeued sample's
        member failed it or was evicted: whoever is free takes it first)."""
        self._count += len(indices)
        for index in reversed(indices):
            single = _Single(index)
            self._groups[single] = deque((index,))
            self._fresh.appendleft(single)

    def take(
        self, member: str, size: int, open_: Mapping[int, Any], avoid: Skip | None
    ) -> list[int]:
        """Up to ``size`` open samples for ``member``: of its own groups first, then of
        new groups (which become its own), then of the member that holds the most.

        ``open_`` is the open samples (a sample not in it is dropped); ``avoid`` says
        which ones to leave for another member.
        """
        batch: list[int] = []
        skipped: list[int] = []
        while len(batch) < size:
            group = self._next(member)
            if group is None:
                break
            samples = self._groups[group]
            self._count -= _cut(samples, size, open_, avoid, batch, skipped)
            if samples:  # the batch is full: the rest of the group waits for its home
                self._own.setdefault(member, deque()).appendleft(group)
                self._load[member] = self._load.get(member, 0) + len(samples)
            else:
                del self._groups[group]
        if skipped:
            self.push_front(skipped)
        return batch

    def release(self, member: str) -> None:
        """``member`` takes no work now: its queued groups go back to the front, for any
        member, and it is no group's home any more."""
        groups = self._own.pop(member, None)
        self._load.pop(member, None)
        if groups:
            self._fresh.extendleft(reversed(groups))
        for group in [g for g, url in self._homes.items() if url == member]:
            del self._homes[group]

    def held(self) -> dict[str, int]:
        """Queued samples kept for each member as the home of their groups."""
        return {url: load for url, load in self._load.items() if load}

    # -- inside ---------------------------------------------------------------------------

    def _limit(self) -> int:
        return load_bound(self._count, self._members(), bound=self._bound)

    def _next(self, member: str) -> Hashable | None:
        """The next group for ``member`` to take, out of the lines (its own, else the
        oldest new one, else the last of the member that holds the most), with
        ``member`` its home now; None if nothing is queued."""
        own = self._own.get(member)
        if own:
            group = own.popleft()
            self._load[member] -= len(self._groups[group])
            return group
        if self._fresh:
            group = self._fresh.popleft()
        else:
            victim = max(
                (url for url, groups in self._own.items() if groups),
                key=lambda url: self._load[url],
                default=None,
            )
            if victim is None:
                return None
            group = self._own[victim].pop()  # the one it would reach last: coldest
            self._load[victim] -= len(self._groups[group])
        if not isinstance(group, _Single):
            self._homes[group] = member
            self._homes.move_to_end(group)
            for _ in range(len(self._homes) - HOMES_KEPT):  # forget the oldest unqueued
                oldest = next(iter(self._homes))
                if oldest in self._groups:
                    self._homes.move_to_end(oldest)  # a queued group keeps its home
                else:
                    del self._homes[oldest]
        return group


def _cut(
    line: deque[int],
    size: int,
    open_: Mapping[int, Any],
    avoid: Skip | None,
    batch: list[int],
    skipped: list[int],
) -> int:
    """Move samples from the front of ``line`` into ``batch`` until it holds ``size``:
    closed ones are dropped, avoided ones go to ``skipped``. How many left ``line``."""
    taken = 0
    while line and len(batch) < size:
        index = line.popleft()
        taken += 1
        if index not in open_:
            continue
        if avoid is not None and avoid(index):
            skipped.append(index)
        else:
            batch.append(index)
    return taken


class _Single:
    """The group of a sample without one (or put back): itself alone."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


WorkQueue = FifoQueue | GroupQueue
"""Either queue: the call's :class:`~llm_annotator.pool.run.Run` holds one."""
