"""Stalls: a member that holds requests and answers none, whatever its /health says."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from llm_annotator import _constants as default
from llm_annotator.pool.lifecycle import MemberState

if TYPE_CHECKING:  # the member holds a StallBook: these import the member
    from llm_annotator.pool.effects import Effects
    from llm_annotator.pool.member import Member
    from llm_annotator.pool.run import Run
    from llm_annotator.pool.state import PoolState

log = structlog.get_logger(__name__)


def stall_window(
    floor: float, *, own_gap: float | None, pool_gap: float | None, factor: float
) -> tuple[float, bool]:
    """How long a member may hold requests and answer none, and whether timing alone
    may call it hung.

    The window is ``factor`` times the longest gap between answers seen on the member
    (``own_gap``), or on the pool before the member answered anything (``pool_gap``),
    and never under ``floor``. With neither there is no evidence of how long an answer
    takes here (the first answers of a call with long generations may take minutes), so
    only the server's own metrics may call it hung.

    Returns:
        The window in seconds, and True if timing alone decides.

    Examples:
        >>> stall_window(30.0, own_gap=2.0, pool_gap=None, factor=3.0)
        (30.0, True)
        >>> stall_window(30.0, own_gap=20.0, pool_gap=1.0, factor=3.0)
        (60.0, True)
        >>> stall_window(30.0, own_gap=None, pool_gap=15.0, factor=3.0)
        (45.0, True)
        >>> stall_window(30.0, own_gap=None, pool_gap=None, factor=3.0)
        (30.0, False)
    """
    basis = own_gap if own_gap is not None else pool_gap
    if basis is None:
        return floor, False
    return max(floor, factor * basis), True


def hung(
    quiet: float,
    window: float,
    *,
    timing_decides: bool,
    progress_before: float | None,
    progress_now: float | None,
) -> bool | None:
    """Whether a member quiet for ``quiet`` seconds while holding requests is hung.

    ``progress_before`` and ``progress_now`` are the server's own progress counters
    (tokens generated and requests finished, from ``/metrics``) read at half the window
    and now; None where they could not be read.

    Returns:
        None while the window has not passed; False if the counters grew (a busy
        server, slow for us, is never evicted) or nothing can tell; True if the
        counters stood still, or if they cannot be read and timing decides.

    Examples:
        >>> hung(5.0, 30.0, timing_decides=True, progress_before=None, progress_now=None)
        >>> hung(31.0, 30.0, timing_decides=True, progress_before=10.0, progress_now=10.0)
        True
        >>> hung(31.0, 30.0, timing_decides=True, progress_before=10.0, progress_now=12.0)
        False
        >>> hung(31.0, 30.0, timing_decides=True, progress_before=None, progress_now=None)
        True
        >>> hung(31.0, 30.0, timing_decides=False, progress_before=None, progress_now=None)
        False
    """
    if quiet < window:
        return None
    if progress_before is not None and progress_now is not None:
        return progress_now <= progress_before
    return timing_decides


@dataclass(slots=True)
class StallBook:
    """What stall detection knows of one member's timing, as ``member.stall``.

    The member writes the times through :meth:`~llm_annotator.pool.member.Member.note_sent`
    and :meth:`~llm_annotator.pool.member.Member.note_arrival` (it knows whether it holds
    requests), and forgets the last progress read when it is admitted;
    :class:`StallWatch` writes the progress reads and ``watch_from``. Nothing else
    writes it.
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

    def new_call(self) -> None:
        """A call starts: its timing in earlier calls no longer counts."""
        self.longest_gap = None
        self.busy_since = self.last_answer_at = self.watch_from = 0.0
        self.progress_read = False


class StallWatch:
    """Evicts a member that has held requests without an answer for its stall window,
    unless its engine's own counters on ``/metrics`` show it working."""

    def __init__(self, state: PoolState, effects: Effects) -> None:
        self._state = state
        self._effects = effects

    async def watch(self, run: Run, member: Member) -> None:
        """Evict a member that holds requests and answers none for its stall window,
        unless its engine's own counters show it working."""
        member.new_call()
        book = member.stall
        while not run.finished:
            if not self._state.is_member(member):
                return
            if member.state is MemberState.DISABLED:
                return
            floor = self._state.config.stall_window
            if math.isinf(floor):
                await self._state.clock.sleep(1.0)
                continue
            window, timing_decides = stall_window(
                floor,
                own_gap=book.longest_gap,
                pool_gap=self._pool_gap(member),
                factor=default.STALL_FACTOR,
            )
            quiet = member.quiet_for(self._state.clock.now())
            due = not book.progress_read or quiet >= window  # the first read, or the last
            if member.state is MemberState.HEALTHY and quiet >= window / 2 and due:
                await self._check_stall(run, member, window, timing_decides)
            await self._state.clock.sleep(max(0.05, min(1.0, window / 8)))

    async def _check_stall(
        self, run: Run, member: Member, window: float, timing_decides: bool
    ) -> None:
        """Read the member's progress counters at half its stall window, and again once
        the window has passed: then decide (:func:`hung`)."""
        book = member.stall
        epoch = book.epoch()
        progress = await member.client.aengine_progress(self._state.config.health_check_timeout)
        if epoch != book.epoch():
            return  # an answer came meanwhile
        if not member.in_flight or member.state is not MemberState.HEALTHY:
            return
        if not book.progress_read:
            book.progress_read, book.progress_seen = True, progress
            return
        before = book.progress_seen
        if (before is None) != (progress is None):
            # One of the two reads failed (a busy server may be slow to render its
            # metrics): take this one as the new baseline and look again, rather than
            # letting a single failed read evict a working server.
            book.progress_seen = progress
            book.watch_from = self._state.clock.now() - window / 2
            return
        quiet = member.quiet_for(self._state.clock.now())
        verdict = hung(
            quiet,
            window,
            timing_decides=timing_decides,
            progress_before=before,
            progress_now=progress,
        )
        if verdict is None:
            return
        if not verdict:
            log.info(
                "member_busy_not_hung" if progress is not None else "member_quiet_unproven",
                server=member.url,
                quiet_seconds=round(quiet, 1),
                in_flight=len(member.in_flight),
                engine_progress=progress,
            )
            book.watch_from = self._state.clock.now()  # watch it again from now
            book.progress_read = False
            return
        metrics = (
            "its engine's counters on /metrics stood still"
            if progress is not None
            else "/metrics could not tell"
        )
        self._effects.evict(
            run,
            member,
            f"hung: it held {len(member.in_flight)} requests and answered none for "
            f"{quiet:.1f} s (stall window {window:.1f} s); {metrics}",
        )

    def _pool_gap(self, member: Member) -> float | None:
        gaps = [
            m.stall.longest_gap
            for m in self._state.members.values()
            if m is not member and m.stall.longest_gap is not None
        ]
        return max(gaps, default=None)
