"""One server of the pool: its client, its state and its counters."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

from llm_annotator.pool.pace import Pace

if TYPE_CHECKING:
    from llm_annotator.pool.backend import MemberClient

SERVED_WELL = 20
"""Good answers after an admission that clear a member's record of evictions in a row."""


class MemberState(Enum):
    """Where a member is in its life; :class:`Member` draws the transitions."""

    JOINING = "joining"
    """Not yet probed."""
    HEALTHY = "healthy"
    """Takes work."""
    EVICTED = "evicted"
    """Gone or hung; probed in the background and re-admitted when healthy."""
    DISABLED = "disabled"
    """Misconfigured (auth, unknown model); never re-admitted."""
    DRAINING = "draining"
    """Being removed: finishes what it holds, takes nothing new."""


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
        self.window = 0
        """The most requests it may hold now (set for each call; see ``pool.window``)."""
        self.pace = Pace()
        """Its good answers a second this call (see ``pool.pace``)."""
        self.window_evictions = 0
        """Its evictions when its window was last started (a rejoin starts it again)."""
        self.suspects: set[int] = set()
        """Samples whose request failed here and that wait for a health check."""
        self.failed_probes = 0
        self.overload_streak = 0
        self.fault_streak = 0
        """Answers in a row that were the server's fault (garbage, 5xx, cut off, hung)."""
        self.fault_samples: list[int] = []
        """The samples of that streak: they were on the member when it broke."""
        self.backoff_until = 0.0
        self.was_down = False
        self.busy_since = 0.0
        """When it last went from holding no request to holding some."""
        self.last_answer_at = 0.0
        """When it last answered anything (a success or an error of any kind)."""
        self.longest_gap: float | None = None
        """The longest it went without an answer while holding requests, this call."""
        self.progress_read = False
        self.progress_seen: float | None = None
        """Its engine's progress counters (None: unreadable), read once it had gone
        quiet for half its stall window (``progress_read``)."""
        self.watch_from = 0.0
        """The hung-check looks at quiet time from here (moved on when a check found
        the engine busy)."""
        self.eviction_streak = 0
        """Evictions since the member last served well (probation doubles with it)."""
        self.served_since_admit = 0
        self.drop_counted_at = float("-inf")
        """When a dropped connection was last counted as its fault."""
        self.probation_until = 0.0
        """An evicted member gets its next test completion no sooner than this."""
        self.failed_canaries = 0
        self.completed = 0
        self.errors = 0
        self.evictions = 0
        self.readmissions = 0
        self.requeued = 0
        self.hedged = 0
        self.last_error: str | None = None
        self.on_move: Callable[[Member, MemberState], None] | None = None
        """Called with the member and its state before, after each change of state."""

    # -- transitions -------------------------------------------------------------------

    def _move(self, to: MemberState) -> bool:
        if to is self.state:
            return False
        if to not in _NEXT[self.state]:
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
        rejoined = self.was_down or self.evictions > 0
        self.failed_probes = 0
        self.backoff_until = 0.0
        self.overload_streak = 0
        self.fault_streak = 0
        self.fault_samples.clear()
        self.failed_canaries = 0
        self.served_since_admit = 0
        self.progress_read = False
        self.was_down = False
        if rejoined:
            self.readmissions += 1
            self.pace.reset()  # a restarted server may be another GPU
        self._move(MemberState.HEALTHY)
        return rejoined

    def mark_down(self, reason: str) -> bool:
        """JOINING -> EVICTED: down from the start; probed until it answers."""
        if self.state is not MemberState.JOINING:
            raise RuntimeError(f"member {self.url}: mark_down from {self.state.value}")
        self.last_error = self.last_error or reason
        self.was_down = True
        self._move(MemberState.EVICTED)
        return True

    def evict(self, reason: str) -> bool:
        """HEALTHY or DRAINING -> EVICTED; False (and nothing changes) from other states."""
        if self.state not in (MemberState.HEALTHY, MemberState.DRAINING):
            return False
        self.evictions += 1
        self.eviction_streak += 1
        self.failed_probes = 0
        self.last_error = reason
        self._move(MemberState.EVICTED)  # last: its watchers see the counts and reason
        return True

    def disable(self, reason: str) -> bool:
        """-> DISABLED, for good: its settings (key, TLS, model, URL) are wrong."""
        self.last_error = reason
        return self._move(MemberState.DISABLED)

    def drain(self) -> bool:
        """-> DRAINING: it is being removed; it finishes what it holds."""
        return self._move(MemberState.DRAINING)

    # -- counters that decide transitions -------------------------------------------------

    def note_probe(self, healthy: bool) -> int:
        """Count a probe of a HEALTHY member; the failed probes in a row so far."""
        self.failed_probes = 0 if healthy else self.failed_probes + 1
        return self.failed_probes

    def note_answer(self) -> None:
        """A good answer: the streaks of overloads and server faults end; after
        :data:`SERVED_WELL` of them since it was admitted, its evictions count afresh."""
        self.served_since_admit += 1
        if self.served_since_admit == SERVED_WELL:
            self.eviction_streak = 0
        self.overload_streak = 0
        if self.fault_streak:
            self.end_fault_streak()

    def end_fault_streak(self) -> None:
        """Its test completion succeeded: the streak of server faults ends (unlike
        :meth:`note_answer`, nothing else counts it as served)."""
        self.fault_streak = 0
        self.fault_samples.clear()

    def note_fault(self, index: int = -1) -> int:
        """An answer to sample ``index`` that was the server's fault; how many in a row.

        The streak counts samples, not answers: a sample that fails again on its retry
        is as much evidence against the sample as against the server, so it counts
        once (a test completion settles which it is; see ``Effect.PROVE``).
        """
        if index < 0 or index not in self.fault_samples:
            self.fault_streak += 1
            self.fault_samples.append(index)
        return self.fault_streak

    def streak_with(self, index: int) -> int:
        """The fault streak if sample ``index`` failed here now (see :meth:`note_fault`)."""
        known = index >= 0 and index in self.fault_samples
        return self.fault_streak + (0 if known else 1)

    def note_sent(self, now: float) -> None:
        """Requests are about to be sent; if it held none, it is busy from ``now``."""
        if not self.in_flight:
            self.busy_since = now
            self.progress_read = False

    def note_arrival(self, now: float) -> None:
        """An answer of any kind arrived at ``now``: the member is not hung."""
        gap = now - max(self.busy_since, self.last_answer_at)
        if self.longest_gap is None or gap > self.longest_gap:
            self.longest_gap = gap
        self.last_answer_at = now
        self.progress_read = False

    def quiet_for(self, now: float) -> float:
        """Seconds it has held requests without answering any (0 when it holds none)."""
        if not self.in_flight:
            return 0.0
        return now - max(self.busy_since, self.last_answer_at, self.watch_from)

    def new_call(self) -> None:
        """A call starts: what it showed of its pace in earlier calls no longer counts."""
        self.longest_gap = None
        self.busy_since = self.last_answer_at = self.watch_from = 0.0
        self.progress_read = False
        self.pace.reset()

    def back_off(self, now: float, delay_for: Callable[[int], float]) -> float:
        """An overloaded answer: pause the member; the moment it may take work again."""
        self.overload_streak += 1
        self.backoff_until = now + delay_for(self.overload_streak - 1)
        return self.backoff_until

    # -- views -----------------------------------------------------------------------------

    def takes_work(self, now: float) -> bool:
        """Healthy and not backing off at ``now``."""
        return self.state is MemberState.HEALTHY and now >= self.backoff_until

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
        )

    def __repr__(self) -> str:
        return f"<Member {self.url} {self.state.value} in_flight={len(self.in_flight)}>"


_NEXT: dict[MemberState, frozenset[MemberState]] = {
    MemberState.JOINING: frozenset(
        {MemberState.HEALTHY, MemberState.EVICTED, MemberState.DISABLED, MemberState.DRAINING}
    ),
    MemberState.HEALTHY: frozenset(
        {MemberState.EVICTED, MemberState.DISABLED, MemberState.DRAINING}
    ),
    MemberState.EVICTED: frozenset(
        {MemberState.HEALTHY, MemberState.DISABLED, MemberState.DRAINING}
    ),
    MemberState.DRAINING: frozenset({MemberState.EVICTED, MemberState.DISABLED}),
    MemberState.DISABLED: frozenset({MemberState.DRAINING}),
}
"""The transition graph of :class:`Member`, as data (checked on every change)."""
