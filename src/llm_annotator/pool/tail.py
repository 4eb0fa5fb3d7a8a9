"""The end of a call: each member's pace, its share of what is left, and the hedges.

A member's pace is how many answers a second it gives, measured as they arrive. The
pool reads it to share out the end of a call (see :func:`tail_share`): a slow server
should hold no more than it can finish while the others finish theirs. The count decays
exponentially over :data:`TAU` seconds, so the pace follows a server that slows down or
speeds up, costs O(1) per answer and needs no timer. When nothing is left to send, an
idle member sends again what the slowest others hold (:func:`pick_hedges`).
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

TAU = 3.0
"""Seconds over which past answers fade (by a factor e)."""
MIN_SPAN = 1.0
"""Seconds a pace must have been measured for before it is believed ..."""
MIN_ANSWERS = 4
"""... and answers it must have counted."""


class Pace:
    """Answers per second, decayed over :data:`TAU` seconds, measured from the first
    answer (a server's first answers come one latency after its first requests, which
    says nothing of its pace).

    Examples:
        >>> pace = Pace()
        >>> for i in range(301):
        ...     pace.note(i / 100)  # 100 answers a second for 3 s
        >>> round(pace.rate(3.0))
        100
        >>> Pace().rate(3.0) is None  # nothing answered yet
        True
    """

    __slots__ = ("_answers", "_count", "_last", "_since")

    def __init__(self) -> None:
        self._count = 0.0
        self._last = 0.0
        self._since: float | None = None
        self._answers = 0

    def reset(self) -> None:
        """Forget everything (a new call, or the server came back)."""
        self._count, self._last, self._since, self._answers = 0.0, 0.0, None, 0

    def note(self, now: float) -> None:
        """An answer arrived at ``now`` (the first only starts the measure)."""
        if self._since is None:
            self._since = self._last = now
            return
        elapsed = now - self._last
        if elapsed > 0:
            self._count *= math.exp(-elapsed / TAU)
            self._last = now
        self._count += 1.0
        self._answers += 1

    def rate(self, now: float) -> float | None:
        """Answers per second at ``now``; None while too little has been measured.

        The decayed count over the decayed span measured, so a pace measured for less
        than :data:`TAU` is not biased low.
        """
        since = self._since
        if since is None or self._answers < MIN_ANSWERS or now - since < MIN_SPAN:
            return None
        count = self._count * math.exp(-max(now - self._last, 0.0) / TAU)
        return count / (TAU * -math.expm1(-(now - since) / TAU))


def tail_share(remaining: int, rate: float, total_rate: float) -> int:
    """What a member answering ``rate`` a second may hold once the source is done,
    when ``remaining`` samples are queued or in flight and the working members
    answer ``total_rate`` together: its part of the remaining work, in proportion to
    its pace, so that every member is expected to finish at about the same moment.

    Examples:
        >>> tail_share(1000, 100.0, 1000.0), tail_share(1000, 800.0, 1000.0)
        (100, 800)
        >>> tail_share(3, 1.0, 1000.0)  # never nothing: the last sample goes somewhere
        1
    """
    if total_rate <= 0:
        return remaining
    return max(1, math.ceil(remaining * rate / total_rate))


@dataclass(frozen=True, slots=True)
class Holder:
    """Another member, as the tail hedge sees it.

    Attributes:
        completed: Answers it has given this call.
        in_flight: The samples it holds, in the order they were sent.
    """

    completed: int
    in_flight: Sequence[int]


def pick_hedges(
    holders: Iterable[Holder],
    *,
    elapsed: float,
    limit: int,
    skip: Container[int],
) -> list[int]:
    """Up to ``limit`` samples an idle member sends again near the end of a call.

    The samples come first from the members expected to finish last (what they hold,
    over the rate at which they have answered in ``elapsed`` seconds), each one's last
    sent first: a server serves its line in order, so those are the ones it would
    answer last. A sample in
    ``skip`` is never hedged: one closed or hedged already, one that was on an evicted
    member (it may be what kills servers), or one that failed on the idle member.

    Examples:
        >>> slow, fast = Holder(completed=1, in_flight=[1, 2, 3]), Holder(10, [4])
        >>> pick_hedges([fast, slow], elapsed=10.0, limit=3, skip={2})
        [3, 1, 4]
    """
    rate_floor = 1e-3
    elapsed = max(elapsed, rate_floor)

    def expected_end(holder: Holder) -> float:
        return len(holder.in_flight) / max(holder.completed / elapsed, rate_floor)

    picked: list[int] = []
    for holder in sorted(holders, key=expected_end, reverse=True):
        for index in reversed(holder.in_flight):
            if index not in skip:
                picked.append(index)
                if len(picked) == limit:
                    return picked
    return picked
