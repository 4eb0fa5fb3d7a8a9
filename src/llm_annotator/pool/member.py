"""One server of the pool: its client, its state, its counters and the books its
concerns keep of it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from llm_annotator.pool.backend import MemberClient
from llm_annotator.pool.books import FaultBook, HealthBook, PrefixCacheBook, StallBook, WindowBook
from llm_annotator.pool.lifecycle import NEXT, MemberState


@dataclass(frozen=True, slots=True)
class MemberStatistics:
    """A snapshot of one member's counters.

    Attributes:
        server: The member's base URL.
        state: Its state when the snapshot was taken.
        completed: Successful responses it produced.
        errors: Error rows it produced (samples at fault, not the server).
        evictions: Times it was evicted.
        readmissions: Times it rejoined after an eviction or a start while down.
        requeued: Samples taken from it and put back on the queue.
        hedged: Hedge requests it sent: samples it was sent near the end of a call
            while they were still in flight on a slower member (the first answer
            wins). A copy cancelled before it was sent (the other answer came first)
            is not counted: these are the duplicates its server got.
        in_flight: Requests it held when the snapshot was taken.
        last_error: The last failure it caused, or None.
        prefix_cache_queries: Prompt tokens its server looked up in its prefix cache
            since the pool first read its ``/metrics`` (read at the start of each
            stream, every 30 s during it and at its end), or None if it does not say.
        prefix_cache_hits: Of those, the tokens found in the cache (not computed).
    """

    server: str
    state: str
    completed: int
    errors: int
    evictions: int
    readmissions: int
    requeued: int
    hedged: int
    in_flight: int
    last_error: str | None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """The share of prompt tokens its server found in its prefix cache, or None.

        Examples:
            >>> MemberStatistics("http://a/v1", "healthy", 0, 0, 0, 0, 0, 0, 0, None,
            ...                  prefix_cache_queries=800, prefix_cache_hits=600
            ...                  ).prefix_cache_hit_rate
            0.75
        """
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


COUNTERS = tuple(
    f.name
    for f in fields(MemberStatistics)
    if f.name not in ("server", "state", "in_flight", "last_error")
    and not f.name.startswith("prefix_cache")
)
"""A member's counters (``completed`` to ``hedged``): what the run's report, timeline
and metrics count per server, in :class:`MemberStatistics`' order."""


@dataclass(frozen=True, slots=True)
class MemberChange:
    """One change of a member's state, as the pool's watchers see it.

    Attributes:
        server: The member's base URL.
        before: Its state before the change.
        after: Its state now.
        reason: Why it was evicted or disabled (its last error), else None.
    """

    server: str
    before: str
    after: str
    reason: str | None


class Member:
    """A pool member: a client plus everything the pool tracks about its server.

    Its state changes only through the methods below, along this graph (a change not in
    it raises ``RuntimeError``: a bug in the pool, never a server's doing)::

        JOINING ──admit──> HEALTHY ──evict──> EVICTED ──admit──> HEALTHY
           │                  │                  │
           └─mark_down──> EVICTED                 │
        any ──disable──> DISABLED (for good)      │
        any ──drain──> DRAINING ──evict──> EVICTED (then forgotten)

    JOINING, HEALTHY and EVICTED members may be disabled or drained; a DRAINING member
    may also be disabled. Each method returns whether the state changed.
    """

    def __init__(self, client: MemberClient) -> None:
        self.client = client
        self.url = client.base_url
        self.state = MemberState.JOINING
        self.in_flight: dict[asyncio.Task[Any], int] = {}
        self.suspects: set[int] = set()
        """Samples whose request failed here and that wait for a health check."""
        # What each concern keeps of this member, in a book (``pool.books``) that the
        # concern's module writes through the book's methods: the member's transitions
        # only start a book afresh.
        self.stall = StallBook()
        """Its timing, for stall detection (``pool.stall``)."""
        self.window = WindowBook()
        """How much it may hold, and its pace (``pool.window``)."""
        self.health = HealthBook()
        """Its probes and probation (``pool.health``)."""
        self.faults = FaultBook()
        """Its server faults and overloads in a row (``pool.settle``, by the rules of
        ``pool.failures``)."""
        self.completed = 0
        self.errors = 0
        self.evictions = 0
        self.readmissions = 0
        self.requeued = 0
        self.hedged = 0
        self.last_error: str | None = None
        """The last failure it caused, or None; written only by :meth:`note_error`."""
        self.prefix_cache = PrefixCacheBook()
        """Its server's prefix-cache counters (read by the calls, ``pool.calls``)."""
        self.on_move: Callable[[Member, MemberState], None] | None = None
        """Called with the member and its state before, after each change of state."""

    # -- transitions -------------------------------------------------------------------

    def _move(self, to: MemberState) -> bool:
        if to is self.state:
            return False
        if to not in NEXT[self.state]:
            raise RuntimeError(f"member {self.url}: no transition {self.state.value} -> {to.value}")
        before, self.state = self.state, to
        if self.on_move is not None:
            self.on_move(self, before)
        return True

    def admit(self) -> bool:
        """JOINING or EVICTED -> HEALTHY: it answered its probe and serves the model.

        Returns:
            True if it rejoined (it was evicted, or down when the call started),
            False on a first join.
        """
        if self.state not in (MemberState.JOINING, MemberState.EVICTED):
            raise RuntimeError(f"member {self.url}: admit from {self.state.value}")
        rejoined = self.health.was_down or self.evictions > 0
        self.health.admitted()
        self.faults.admitted()
        self.stall.admitted()
        if rejoined:
            self.readmissions += 1
            self.window.pace.reset()  # a restarted server may be another GPU
        self._move(MemberState.HEALTHY)
        return rejoined

    def mark_down(self, reason: str) -> bool:
        """JOINING -> EVICTED: down from the start; probed until it answers."""
        if self.state is not MemberState.JOINING:
            raise RuntimeError(f"member {self.url}: mark_down from {self.state.value}")
        if not self.last_error:
            self.note_error(reason)
        self.health.marked_down()
        self._move(MemberState.EVICTED)
        return True

    def evict(self, reason: str) -> bool:
        """HEALTHY or DRAINING -> EVICTED; False (and nothing changes) from other states."""
        if self.state not in (MemberState.HEALTHY, MemberState.DRAINING):
            return False
        self.evictions += 1
        self.health.evicted()
        self.note_error(reason)
        self._move(MemberState.EVICTED)  # last: its watchers see the counts and reason
        return True

    def disable(self, reason: str) -> bool:
        """-> DISABLED, for good: its settings (key, TLS, model, URL) are wrong."""
        self.note_error(reason)
        return self._move(MemberState.DISABLED)

    def drain(self) -> bool:
        """-> DRAINING: it is being removed; it finishes what it holds."""
        return self._move(MemberState.DRAINING)

    # -- what the member is told ---------------------------------------------------------

    def note_error(self, reason: str) -> None:
        """Record ``reason`` as the last failure it caused: what its statistics show and
        its watchers are told when it is evicted or disabled (the one writer of
        ``last_error``)."""
        self.last_error = reason

    def note_model(self, model: str) -> None:
        """Take ``model``, the first its ``/v1/models`` lists, as the model it serves,
        for a client given none: its client asks for it in each request from now on
        (the pool's one writer of the client's ``model``)."""
        self.client.model = model

    # -- what the member alone can tell its books ---------------------------------------

    def note_answer(self) -> None:
        """A good answer: the streaks of overloads and server faults end; after
        :data:`~llm_annotator.pool.books.SERVED_WELL` of them since it was admitted,
        its evictions count afresh."""
        self.health.served()
        self.faults.answered()

    def note_sent(self, now: float) -> None:
        """Requests are about to be sent; if it held none, it is busy from ``now``."""
        self.stall.sent(now, was_idle=not self.in_flight)

    def note_arrival(self, now: float) -> None:
        """An answer of any kind arrived at ``now``: the member is not hung."""
        self.stall.arrived(now)

    def quiet_for(self, now: float) -> float:
        """Seconds it has held requests without answering any (0 when it holds none)."""
        return self.stall.quiet_for(now) if self.in_flight else 0.0

    def new_call(self) -> None:
        """A call starts: what it showed of its pace in earlier calls no longer counts."""
        self.stall.new_call()
        self.window.pace.reset()

    # -- views -----------------------------------------------------------------------------

    @property
    def model(self) -> str | None:
        """The model it serves: the one its client was given, else the one its
        ``/v1/models`` listed when it was admitted (None until then)."""
        return self.client.model

    def takes_work(self, now: float) -> bool:
        """Healthy and not backing off at ``now``."""
        return self.state is MemberState.HEALTHY and now >= self.faults.backoff_until

    def statistics(self) -> MemberStatistics:
        return MemberStatistics(
            server=self.url,
            state=self.state.value,
            completed=self.completed,
            errors=self.errors,
            evictions=self.evictions,
            readmissions=self.readmissions,
            requeued=self.requeued,
            hedged=self.hedged,
            in_flight=len(self.in_flight),
            last_error=self.last_error,
            **self.prefix_cache.counts(),
        )

    def __repr__(self) -> str:
        return f"<Member {self.url} {self.state.value} in_flight={len(self.in_flight)}>"
