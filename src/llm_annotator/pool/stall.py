"""Stalls: a member that holds requests and answers none, whatever its /health says."""

from __future__ import annotations

import math

import structlog

from llm_annotator import _constants as default
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.member import Member, MemberState
from llm_annotator.pool.policy import hung, stall_window
from llm_annotator.pool.run import Run
from llm_annotator.pool.state import PoolState

log = structlog.get_logger(__name__)


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
                own_gap=member.longest_gap,
                pool_gap=self._pool_gap(member),
                factor=default.STALL_FACTOR,
            )
            quiet = member.quiet_for(self._state.clock.now())
            due = not member.progress_read or quiet >= window  # the first read, or the last
            if member.state is MemberState.HEALTHY and quiet >= window / 2 and due:
                await self._check_stall(run, member, window, timing_decides)
            await self._state.clock.sleep(max(0.05, min(1.0, window / 8)))

    async def _check_stall(
        self, run: Run, member: Member, window: float, timing_decides: bool
    ) -> None:
        """Read the member's progress counters at half its stall window, and again once
        the window has passed: then decide (:func:`~llm_annotator.pool.policy.hung`)."""
        epoch = (member.busy_since, member.last_answer_at, member.watch_from)
        progress = await member.client.aengine_progress(self._state.config.health_check_timeout)
        if epoch != (member.busy_since, member.last_answer_at, member.watch_from):
            return  # an answer came meanwhile
        if not member.in_flight or member.state is not MemberState.HEALTHY:
            return
        if not member.progress_read:
            member.progress_read, member.progress_seen = True, progress
            return
        before = member.progress_seen
        if (before is None) != (progress is None):
            # One of the two reads failed (a busy server may be slow to render its
            # metrics): take this one as the new baseline and look again, rather than
            # letting a single failed read evict a working server.
            member.progress_seen = progress
            member.watch_from = self._state.clock.now() - window / 2
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
            member.watch_from = self._state.clock.now()  # watch it again from now
            member.progress_read = False
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
            m.longest_gap
            for m in self._state.members.values()
            if m is not member and m.longest_gap is not None
        ]
        return max(gaps, default=None)
