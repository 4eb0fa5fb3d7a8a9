"""Stalls: a member that holds requests and answers none, whatever its /health says."""

from __future__ import annotations

import math

import structlog

from llm_annotator import _constants as default
from llm_annotator.pool.books import StallBook as StallBook  # re-exported: it was defined here
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.lifecycle import MemberState
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
            book.read_progress(progress)
            return
        before = book.progress_seen
        if (before is None) != (progress is None):
            # One of the two reads failed (a busy server may be slow to render its
            # metrics): take this one as the new baseline and look again, rather than
            # letting a single failed read evict a working server.
            book.rebase(progress, watch_from=self._state.clock.now() - window / 2)
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
            book.watch_again(self._state.clock.now())
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
