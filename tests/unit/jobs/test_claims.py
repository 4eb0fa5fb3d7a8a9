"""The claim protocol on a corpus's units: one winner per generation, leases that
expire, a takeover that the old holder notices before it writes again."""

from __future__ import annotations

import threading
from pathlib import Path

from llm_annotator.jobs.rundir.claims import Claims


class Clocks:
    """A monotonic and a wall clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.wall_now = 1_000_000.0

    def clock(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.wall_now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.wall_now += seconds


def test_of_many_workers_racing_for_a_unit_exactly_one_claims_it(tmp_path: Path) -> None:
    workers = [Claims(tmp_path, lease=60) for _ in range(16)]
    won: list[int] = []
    start = threading.Barrier(len(workers))

    def race(index: int) -> None:
        start.wait()
        if workers[index].try_claim("unit-a") is not None:
            won.append(index)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(won) == 1
    assert workers[0].holder("unit-a")[0] == 1


def test_a_claim_is_held_while_renewed_and_taken_over_once_its_lease_expires(
    tmp_path: Path,
) -> None:
    clocks = Clocks()
    first = Claims(tmp_path, lease=10, clock=clocks.clock, wall=clocks.wall)
    second = Claims(tmp_path, lease=10, clock=clocks.clock, wall=clocks.wall)
    claim = first.try_claim("u")
    assert claim is not None and claim.generation == 1
    assert second.try_claim("u") is None  # held: the file was just made
    clocks.advance(6)
    assert first.valid(claim)  # past half a lease: it looks for a taker, then renews
    assert second.try_claim("u") is None
    clocks.advance(11)  # no renewal for a whole lease: the holder is stopped, or dead
    taken = second.try_claim("u")
    assert taken is not None and taken.generation == 2
    assert not first.valid(claim) and claim.lost  # it looks, sees generation 2, gives up
    assert not first.renew(claim)
    assert second.valid(taken)
    assert first.try_claim("u") is None  # the taker's lease is fresh


def test_two_takers_of_an_expired_claim_make_one_new_generation(tmp_path: Path) -> None:
    clocks = Clocks()
    workers = [Claims(tmp_path, lease=5, clock=clocks.clock, wall=clocks.wall) for _ in range(3)]
    assert workers[0].try_claim("u") is not None
    clocks.advance(6)
    taken = [w.try_claim("u") for w in workers[1:]]
    assert [t.generation for t in taken if t is not None] == [2]
    assert workers[0].holder("u")[0] == 2
