"""One server of the pool: its client, its state and its counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from llm_annotator.clients.vllm_online_client import VLLMOnlineClient


class MemberState(Enum):
    """Where a member is in its life: ``joining -> healthy -> (evicted -> healthy)``."""

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
        hedged: Samples it was sent near the end of a call while they were still in
            flight on a slower member (the first answer wins).
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


class Member:
    """A pool member: a client plus everything the pool tracks about its server."""

    def __init__(self, client: VLLMOnlineClient) -> None:
        self.client = client
        self.url = client.base_url
        self.state = MemberState.JOINING
        self.in_flight: dict[asyncio.Task[Any], int] = {}
        self.suspects: set[int] = set()
        """Samples whose request failed here and that wait for a health check."""
        self.failed_probes = 0
        self.overload_streak = 0
        self.malformed_streak = 0
        self.backoff_until = 0.0
        self.was_down = False
        self.completed = 0
        self.errors = 0
        self.evictions = 0
        self.readmissions = 0
        self.requeued = 0
        self.hedged = 0
        self.last_error: str | None = None

    @property
    def takes_work(self) -> bool:
        """Healthy and not backing off."""
        return self.state is MemberState.HEALTHY and time.monotonic() >= self.backoff_until

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
