"""A member's pace: how many answers a second it gives, measured as they arrive.

The pool reads it to share out the end of a call (see :func:`tail_share`): a slow
server should hold no more than it can finish while the others finish theirs. The
count decays exponentially over :data:`TAU` seconds, so the pace follows a server
that slows down or speeds up, costs O(1) per answer and needs no timer.
"""

from __future__ import annotations

import math

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
