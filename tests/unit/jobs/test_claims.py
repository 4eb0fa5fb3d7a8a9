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


def test_a_unit_lost_and_claimed_again_is_done_whole_by_its_first_worker(tmp_path: Path) -> None:
    """Worker A loses a unit to B (A stopped past its lease), then B stops too and A
    takes the unit back: A reads it again, writes every row not written, and finishes
    it with all its rows (nothing is dropped as "lost" any more)."""
    import asyncio

    import orjson
    import pyarrow.parquet as pq

    from llm_annotator.jobs.rows.corpus import list_corpus
    from llm_annotator.jobs.rundir.partitions import ANNOTATIONS_DIR, PartitionedStore

    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.jsonl").write_bytes(
        b"".join(orjson.dumps({"text": f"t{i}"}) + b"\n" for i in range(10))
    )
    unit = list_corpus(tmp_path / "c").units[0]
    clocks = Clocks()
    run = tmp_path / "run"
    run.mkdir()

    async def scenario() -> None:
        mine = Claims(run, lease=10, clock=clocks.clock, wall=clocks.wall)
        theirs = Claims(run, lease=10, clock=clocks.clock, wall=clocks.wall)
        store = PartitionedStore(run, {"model": "m"}, claims=mine)
        claim = mine.try_claim("a.jsonl")
        assert claim is not None
        store.begin(unit, claim)
        rows = list(unit.read(None))
        for row in rows[:4]:
            assert store.take(row)
            store.append({"id": row.id, "response": "x"}, unit.index)
        store.flush()
        clocks.advance(11)  # A stopped past its lease; B takes the unit over
        assert theirs.try_claim("a.jsonl") is not None
        store.take(rows[4])  # A's loop does not know yet: it reads on, and writes nothing
        store.append({"id": rows[4].id, "response": "x"}, unit.index)
        assert store.is_lost(unit)
        clocks.advance(11)  # B stopped too: A takes the unit back
        again = mine.try_claim("a.jsonl")
        assert again is not None and again.generation == 3
        store.begin(unit, again)
        assert not store.is_lost(unit)
        for row in rows:
            if store.take(row):
                store.append({"id": row.id, "response": "y"}, unit.index)
        store.end_of(unit)
        await store.drain()
        store.close()

    asyncio.run(scenario())
    table = pq.read_table(run / ANNOTATIONS_DIR / unit.output_name)
    assert sorted(table.column("id").to_pylist()) == list(range(10))
