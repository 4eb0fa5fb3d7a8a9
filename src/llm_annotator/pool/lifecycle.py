"""A member's life as data: its states and the transitions between them.

Its own module, a leaf of the pool: the job layer names a member's state
(``llm_annotator.pool.MemberState``) without loading the member.
"""

from __future__ import annotations

from enum import Enum


class MemberState(Enum):
    """Where a member is in its life; :class:`~llm_annotator.pool.member.Member` draws
    the transitions."""

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


NEXT: dict[MemberState, frozenset[MemberState]] = {
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
"""The transition graph of a member, as data (checked on every change)."""
