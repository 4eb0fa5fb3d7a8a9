"""The books the pool keeps on each member, one per concern: plain data and the small
pure methods that change it.

A :class:`~llm_annotator.pool.member.Member` holds one of each (``member.stall``,
``member.window``, ``member.health``, ``member.faults``, ``member.prefix_cache``); the
concern's own module writes it through these methods: :mod:`~llm_annotator.pool.stall`,
:mod:`~llm_annotator.pool.window`, :mod:`~llm_annotator.pool.health`, the settler
(:mod:`~llm_annotator.pool.settle`) and the calls' ``/metrics`` reads. The member
itself starts a book afresh on its transitions.

A leaf of the pool: of the pool it imports only the pace counter
(:class:`~llm_annotator.pool.tail.Pace`, itself a leaf), so the member can hold the
books without loading the services that write them, and those services can import
the member.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from llm_annotator import _constants as default
from llm_annotator.clients.metrics import EngineLoad
from llm_annotator.pool.tail import Pace

SERVED_WELL = 20
"""Good answers after an admission that clear a member's record of evictions in a row."""


def probation(evictions: int, failed_canaries: int, interval: float, cap: float) -> float:
    """Seconds an evicted member waits before its next test completion: the probe
    interval, doubled for every eviction after the first and every failed test.

    Examples:
        >>> [probation(n, 0, 3.0, 300.0) for n in (1, 2, 3)]
        [3.0, 6.0, 12.0]
        >>> probation(2, 10, 3.0, 300.0)
        300.0
    """
    exponent = max(evictions - 1, 0) + failed_canaries
    if exponent > 60:
        return cap
    return min(cap, interval * math.pow(2.0, exponent))


@dataclass(slots=True)
class StallBook:
    """What stall detection knows of one member's timing, as ``member.stall``.

    The member writes the times through :meth:`~llm_annotator.pool.member.Member.note_sent`
    and :meth:`~llm_annotator.pool.member.Member.note_arrival` (it knows whether it holds
    requests), and forgets the last progress read when it is admitted;
    :class:`~llm_annotator.pool.stall.StallWatch` writes the progress reads and
    ``watch_from``. Nothing else writes it.
    """

    busy_since: float = 0.0
    """When the member last went from holding no request to holding some."""
    last_answer_at: float = 0.0
    """When it last answered anything (a success or an error of any kind)."""
    longest_gap: float | None = None
    """The longest it went without an answer while holding requests, this call."""
    progress_read: bool = False
    """Whether its engine's progress was read since it went quiet."""
    progress_seen: float | None = None
    """Its engine's progress counters at that read (None: unreadable)."""
    watch_from: float = 0.0
    """The hung-check looks at quiet time from here (moved on when a check found the
    engine busy)."""

    def sent(self, now: float, *, was_idle: bool) -> None:
        """Requests are about to be sent; a member that held none is busy from ``now``."""
        if was_idle:
            self.busy_since = now
            self.progress_read = False

    def arrived(self, now: float) -> None:
        """An answer of any kind arrived at ``now``."""
        gap = now - max(self.busy_since, self.last_answer_at)
        if self.longest_gap is None or gap > self.longest_gap:
            self.longest_gap = gap
        self.last_answer_at = now
        self.progress_read = False

    def quiet_for(self, now: float) -> float:
        """Seconds since it was last busy, answered or was found working."""
        return now - max(self.busy_since, self.last_answer_at, self.watch_from)

    def epoch(self) -> tuple[float, float, float]:
        """What changes when it answers or goes busy (a read compares it before and after)."""
        return (self.busy_since, self.last_answer_at, self.watch_from)

    def read_progress(self, progress: float | None) -> None:
        """The first read of its engine's progress since it went quiet."""
        self.progress_read, self.progress_seen = True, progress

    def rebase(self, progress: float | None, watch_from: float) -> None:
        """Take ``progress`` as the new baseline and look at quiet time from
        ``watch_from`` (one of two reads failed, so they cannot be compared)."""
        self.progress_seen = progress
        self.watch_from = watch_from

    def watch_again(self, now: float) -> None:
        """Its engine was found working: watch it afresh from ``now``."""
        self.watch_from = now
        self.progress_read = False

    def admitted(self) -> None:
        """It was admitted: a progress read from before counts no more."""
        self.progress_read = False

    def new_call(self) -> None:
        """A call starts: its timing in earlier calls no longer counts."""
        self.longest_gap = None
        self.busy_since = self.last_answer_at = self.watch_from = 0.0
        self.progress_read = False


@dataclass(slots=True)
class WindowBook:
    """How much one member may hold, and how fast it answers, as ``member.window``.

    :class:`~llm_annotator.pool.window.WindowTuner` sets ``size`` and ``started_at``;
    the dispatcher notes each good answer in ``pace`` (see :mod:`llm_annotator.pool.tail`),
    which the member starts afresh on a new call or a rejoin.
    """

    size: int = 0
    """The most requests it may hold now (set for each call)."""
    started_at: int = 0
    """Its evictions when its window was last started (a rejoin starts it again)."""
    pace: Pace = field(default_factory=Pace)
    """Its good answers a second this call."""

    def room(self, holding: int) -> int:
        """Requests it may take on top of the ``holding`` it has."""
        return self.size - holding

    def start(self, size: int, *, evictions: int) -> None:
        """Start the window at ``size``, for a member evicted ``evictions`` times so far."""
        self.size = size
        self.started_at = evictions

    def resize(self, size: int) -> int:
        """Set the window to ``size``; the size it had."""
        was, self.size = self.size, size
        return was

    def grow(self) -> int:
        """One request more; the new size."""
        self.size += 1
        return self.size


@dataclass(slots=True)
class HealthBook:
    """What the health checks know of one member, as ``member.health``: its probes,
    its probation and how it served since it was last admitted.

    The member's transitions reset it (:meth:`admitted`, :meth:`evicted`,
    :meth:`marked_down`); the :class:`~llm_annotator.pool.health.HealthMonitor` counts
    probes and failed test completions.
    """

    failed_probes: int = 0
    """Health checks of a HEALTHY member failed in a row."""
    was_down: bool = False
    """It was down when it joined (its first admission is then a rejoin)."""
    eviction_streak: int = 0
    """Evictions since it last served well (probation doubles with it)."""
    served_since_admit: int = 0
    """Good answers since it was last admitted."""
    probation_until: float = 0.0
    """An evicted member gets its next test completion no sooner than this."""
    failed_canaries: int = 0
    """Test completions it failed since it was last admitted."""
    suspected: str | None = None
    """Why another process last said it was dead (``QueuePool.suspect_server``): the
    same word is acted on once, admissions or not."""

    def suspect(self, reason: str) -> bool:
        """Note another process's word that it is dead; False if it was said already."""
        if self.suspected == reason:
            return False
        self.suspected = reason
        return True

    def probe(self, healthy: bool) -> int:
        """Count a probe of a HEALTHY member; the failed probes in a row so far."""
        self.failed_probes = 0 if healthy else self.failed_probes + 1
        return self.failed_probes

    def served(self) -> None:
        """A good answer: after :data:`SERVED_WELL` of them since it was admitted, its
        evictions count afresh."""
        self.served_since_admit += 1
        if self.served_since_admit == SERVED_WELL:
            self.eviction_streak = 0

    def canary_failed(self) -> None:
        """It failed a test completion (its probation doubles)."""
        self.failed_canaries += 1

    def marked_down(self) -> None:
        """It was down when it joined: its first admission is a rejoin."""
        self.was_down = True

    def admitted(self) -> None:
        self.failed_probes = self.failed_canaries = self.served_since_admit = 0
        self.was_down = False

    def evicted(self) -> None:
        self.eviction_streak += 1
        self.failed_probes = 0

    def start_probation(self, now: float, *, interval: float, all_down_timeout: float) -> None:
        """Wait before its next test completion: doubling with evictions in a row (a
        member that served well since counts afresh) and failed tests from the probe
        ``interval``, and at most a quarter of ``all_down_timeout``, so a pool is never
        given up on while a member that healed still waits out its probation."""
        cap = min(default.MAX_PROBATION, all_down_timeout / 4)
        wait = probation(self.eviction_streak, self.failed_canaries, interval, max(cap, interval))
        self.probation_until = now + wait


@dataclass(slots=True)
class FaultBook:
    """One member's failures in a row, as ``member.faults``: the server faults the
    failure rules (:mod:`~llm_annotator.pool.failures`) count towards an eviction, and the
    overloads it backs off from.

    The settler (``pool.settle``) writes it as it carries out the failure rules; a good
    answer ends both streaks, and an admission ends them and the back-off (a dropped
    connection counted before still is: the next one counts only if sent after it).
    """

    fault_streak: int = 0
    """Answers in a row that were the server's fault (garbage, 5xx, cut off, hung)."""
    fault_samples: list[int] = field(default_factory=list)
    """The samples of that streak: they were on the member when it broke."""
    overload_streak: int = 0
    """Overloaded answers in a row."""
    backoff_until: float = 0.0
    """It takes no work before this (it said it was overloaded)."""
    drop_counted_at: float = float("-inf")
    """When a dropped connection was last counted as its fault."""

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

    def end_streak(self) -> None:
        """The streak of server faults ends (a good answer, or a test completion)."""
        self.fault_streak = 0
        self.fault_samples.clear()

    def count_drop(self, now: float) -> None:
        """A dropped connection counted as its fault at ``now`` (one sent before it is
        not counted again)."""
        self.drop_counted_at = now

    def back_off(self, now: float, delay_for: Callable[[int], float]) -> float:
        """An overloaded answer: the moment the member may take work again."""
        self.overload_streak += 1
        self.backoff_until = now + delay_for(self.overload_streak - 1)
        return self.backoff_until

    def answered(self) -> None:
        """A good answer: the streaks of overloads and server faults end."""
        self.overload_streak = 0
        if self.fault_streak:
            self.end_streak()

    def admitted(self) -> None:
        self.backoff_until = 0.0
        self.overload_streak = 0
        self.end_streak()


class PrefixCacheBook:
    """A member's prefix-cache counters, from the readings of its ``/metrics``: what
    grew between them (a server that restarted counts from zero again)."""

    __slots__ = ("hits", "last", "queries")

    def __init__(self) -> None:
        self.last: tuple[float, float] | None = None
        self.queries = 0.0
        self.hits = 0.0

    def note(self, load: EngineLoad | None) -> None:
        """Count a reading (None, or one without the counters, is skipped).

        Examples:
            >>> book = PrefixCacheBook()
            >>> for queries, hits in [(100, 10), (300, 150), (50, 40)]:  # then a restart
            ...     book.note(EngineLoad(0, 0, prefix_cache_queries=queries,
            ...                          prefix_cache_hits=hits))
            >>> book.counts()
            {'prefix_cache_queries': 250, 'prefix_cache_hits': 180}
        """
        if load is None or load.prefix_cache_queries is None or load.prefix_cache_hits is None:
            return
        reading = (load.prefix_cache_queries, load.prefix_cache_hits)
        if self.last is not None:
            if reading[0] >= self.last[0] and reading[1] >= self.last[1]:
                self.queries += reading[0] - self.last[0]
                self.hits += reading[1] - self.last[1]
            else:
                self.queries += reading[0]
                self.hits += reading[1]
        self.last = reading

    def counts(self) -> dict[str, int]:
        """The counts for :class:`~llm_annotator.pool.member.MemberStatistics` (none
        before the first reading)."""
        if self.last is None:
            return {}
        return {"prefix_cache_queries": round(self.queries), "prefix_cache_hits": round(self.hits)}
