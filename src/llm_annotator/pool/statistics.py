"""PoolStatistics: a frozen snapshot of the pool's counters."""

from __future__ import annotations

from dataclasses import dataclass

from llm_annotator.clients.urls import normalize_base_url
from llm_annotator.pool.member import MemberStatistics


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of the pool's counters, totals and per member (cumulative over calls).

    Only the current members count: a server removed (by hand or by a discovery) takes
    its counters with it.

    Attributes:
        members: One :class:`MemberStatistics` per current member, in the order they
            joined.
        healthy: Members taking work now.
        queued: Samples waiting in the queue now.
        in_flight: Requests in flight now.
    """

    members: tuple[MemberStatistics, ...]
    healthy: int
    queued: int
    in_flight: int

    @property
    def completed(self) -> int:
        return sum(m.completed for m in self.members)

    @property
    def errors(self) -> int:
        return sum(m.errors for m in self.members)

    @property
    def evictions(self) -> int:
        return sum(m.evictions for m in self.members)

    @property
    def readmissions(self) -> int:
        return sum(m.readmissions for m in self.members)

    @property
    def requeued(self) -> int:
        return sum(m.requeued for m in self.members)

    @property
    def hedged(self) -> int:
        return sum(m.hedged for m in self.members)

    def member(self, server: str) -> MemberStatistics:
        """The statistics of the member with this base URL."""
        url = normalize_base_url(server)
        for stats in self.members:
            if stats.server == url:
                return stats
        raise KeyError(server)
