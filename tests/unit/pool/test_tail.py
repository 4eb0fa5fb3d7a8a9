"""The end of a call: a member's pace (answers a second, decayed), the share it sets,
and the hedges an idle member sends."""

from __future__ import annotations

import math

import pytest

from llm_annotator.pool import tail
from llm_annotator.pool.tail import Holder, Pace, pick_hedges, tail_share


def steady(rate: float, seconds: float, start: float = 0.0, meter: Pace | None = None) -> Pace:
    """A pace fed ``rate`` answers a second for ``seconds`` after an answer at
    ``start``."""
    meter = meter or Pace()
    count = round(rate * seconds)
    for i in range(count + 1):
        meter.note(start + i / rate)
    return meter


@pytest.mark.parametrize("rate", [2.0, 40.0, 1000.0, 5000.0])
@pytest.mark.parametrize("seconds", [2.5, 6.0, 30.0])
def test_a_steady_pace_reads_as_its_rate_however_long_it_was_measured(
    rate: float, seconds: float
) -> None:
    """Read just after an answer: the answer counts whole, so a slow pace reads high by
    up to about one answer over TAU."""
    measured = steady(rate, seconds).rate(seconds)
    assert measured is not None
    assert measured == pytest.approx(rate, rel=0.05 + 1 / (rate * tail.TAU))


def test_a_pace_is_unknown_until_measured_long_enough_and_often_enough() -> None:
    meter = Pace()
    assert meter.rate(10.0) is None  # nothing answered
    meter.note(5.0)
    assert meter.rate(10.0) is None  # one answer only starts the measure
    for i in range(tail.MIN_ANSWERS):
        meter.note(5.0 + 0.1 * (i + 1))
    assert meter.rate(5.0 + tail.MIN_SPAN / 2) is None  # too short a span
    assert meter.rate(5.0 + tail.MIN_SPAN) is not None


def test_the_wait_for_a_servers_first_answers_does_not_count_against_its_pace() -> None:
    """A server whose answers take 5 s each, 20 a second once they flow: its pace reads
    20 two seconds after the first answer, not a third of it."""
    meter = Pace()
    steady(20.0, 2.0, start=5.0, meter=meter)
    measured = meter.rate(7.0)
    assert measured is not None
    assert measured == pytest.approx(20.0, rel=0.1)


def test_a_pace_follows_a_server_that_slows_down() -> None:
    """100/s for 10 s then 10/s: within a few TAU the pace reads close to 10."""
    meter = steady(100.0, 10.0)
    steady(10.0, 5 * tail.TAU, start=10.0, meter=meter)
    measured = meter.rate(10.0 + 5 * tail.TAU)
    assert measured is not None
    assert 9.0 < measured < 12.0


def test_a_server_that_stopped_answering_fades_to_nothing() -> None:
    meter = steady(100.0, 10.0)
    measured = meter.rate(10.0 + 10 * tail.TAU)
    assert measured is not None
    assert measured < 100.0 * math.exp(-9)


def test_reset_forgets_the_pace() -> None:
    meter = steady(100.0, 10.0)
    meter.reset()
    assert meter.rate(10.0) is None


@pytest.mark.parametrize(
    ("remaining", "rate", "total", "share"),
    [
        (1000, 100.0, 1000.0, 100),  # its part by pace
        (1000, 800.0, 1000.0, 800),
        (999, 500.0, 1000.0, 500),  # rounded up ...
        (3, 1.0, 1000.0, 1),  # ... and never 0, so the last sample always goes somewhere
        (0, 1.0, 1.0, 1),
        (50, 0.0, 0.0, 50),  # no pace at all: no limit beyond what is left
    ],
)
def test_the_end_of_a_call_is_shared_by_pace(
    remaining: int, rate: float, total: float, share: int
) -> None:
    assert tail_share(remaining, rate, total) == share


def test_the_shares_add_up_to_at_least_what_is_left() -> None:
    """However the paces fall, the shares cover what is left (shares rounded to the
    nearest would not): among the members that take work, one holds less than its
    share while anything is queued."""
    for rates in ([1.0, 1.0, 1.0, 1.0], [1066.0, 533.0, 266.0, 133.0], [1e-3, 5.0, 7.0]):
        for remaining in range(200):
            shares = [tail_share(remaining, r, sum(rates)) for r in rates]
            assert sum(shares) >= remaining


@pytest.mark.parametrize(
    ("holders", "limit", "skip", "picked"),
    [
        # The member expected to finish last gives first (4 held at 1 answer per 10 s),
        # the last sent first: its server would answer those last.
        ([Holder(10, [1]), Holder(1, [2, 3, 4, 5])], 3, set(), [5, 4, 3]),
        ([Holder(10, [1]), Holder(1, [2, 3, 4, 5])], 9, set(), [5, 4, 3, 2, 1]),
        # Suspects, hedged ones and closed ones are skipped, wherever they are.
        ([Holder(10, [1]), Holder(1, [2, 3])], 9, {2, 1}, [3]),
        # A member that has answered nothing yet is expected to finish last.
        ([Holder(50, [1, 2]), Holder(0, [3])], 1, set(), [3]),
        ([Holder(50, [1, 2]), Holder(0, [3])], 2, set(), [3, 2]),
        # Nothing to hedge.
        ([], 4, set(), []),
        ([Holder(1, [1])], 4, {1}, []),
    ],
)
def test_what_an_idle_member_hedges(
    holders: list[Holder], limit: int, skip: set[int], picked: list[int]
) -> None:
    assert pick_hedges(holders, elapsed=10.0, limit=limit, skip=skip) == picked
