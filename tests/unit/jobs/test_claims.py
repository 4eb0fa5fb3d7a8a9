"""The claim protocol on a corpus's units: one winner per generation, leases that
expire, a takeover that the old holder notices before it writes again."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
import structlog

from llm_annotator.jobs.rundir.claims import Claims, lease_state, process_gone


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


@pytest.mark.parametrize(
    ("age", "unchanged", "state"),
    [
        (0.0, 0.0, "held"),
        (9.9, 100.0, "held"),  # renewed within a lease: held, however long unchanged
        (10.0, 0.0, "expired"),
        (86_400.0, 0.0, "expired"),
        (-5.0, 0.0, "held"),  # a holder's clock a little ahead: an ordinary claim
        (-10.0, 100.0, "held"),
        (-10.1, 0.0, "ahead"),  # more than a lease ahead: a clock fault
        (-86_400.0, 9.9, "ahead"),
        (-86_400.0, 10.0, "stale"),  # seen unchanged for a lease: its holder stopped
    ],
)
def test_a_claims_state_follows_its_age_and_how_long_it_was_seen_unchanged(
    age: float, unchanged: float, state: str
) -> None:
    assert lease_state(age, 10.0, unchanged) == state


def ahead(claims: Claims, key: str, seconds: float) -> None:
    """Set the unit's claim file's time as its holder's clock, ``seconds`` ahead, would."""
    generation, renewed = claims.holder(key)
    assert renewed is not None
    path = claims.folder / f"{key}.{generation}"
    os.utime(path, (renewed + seconds, renewed + seconds))


def test_a_claim_a_day_ahead_of_this_hosts_clock_is_logged_and_taken_over_after_a_lease(
    tmp_path: Path,
) -> None:
    """A claim written by a host whose clock is a day ahead is a clock fault: the
    other worker logs it (the unit, the holder and its host, how far ahead) once, and
    takes the unit over once it has seen the claim unchanged for a lease, not a day."""
    clocks = Clocks()
    first = Claims(tmp_path, lease=10, clock=clocks.clock, wall=clocks.wall)
    second = Claims(tmp_path, lease=10, clock=clocks.clock, wall=clocks.wall)
    assert first.try_claim("u") is not None
    ahead(first, "u", 86_400)
    with structlog.testing.capture_logs() as logs:
        assert second.try_claim("u") is None
        clocks.advance(6)
        assert second.try_claim("u") is None
        clocks.advance(4)  # unchanged for a lease on the second worker's own clock
        taken = second.try_claim("u")
    assert taken is not None and taken.generation == 2
    faults = [log for log in logs if log["event"] == "claim_clock_ahead"]
    assert len(faults) == 1
    assert faults[0]["unit"] == "u" and faults[0]["owner"] == first.owner
    assert faults[0]["host"] == socket.gethostname()
    assert faults[0]["ahead_seconds"] == pytest.approx(86_400, abs=1)
    over = [log for log in logs if log["event"] == "unit_taken_over"]
    assert over[0]["reason"] == "clock_ahead" and over[0]["previous"] == first.owner


def test_a_live_holder_whose_clock_is_ahead_keeps_its_unit_while_it_renews(
    tmp_path: Path,
) -> None:
    """A holder a day ahead that goes on renewing changes its claim's file each time:
    the other worker never sees it unchanged for a lease, and leaves the unit to it."""
    clocks = Clocks()
    first = Claims(tmp_path, lease=10, clock=clocks.clock, wall=lambda: clocks.wall() + 86_400)
    second = Claims(tmp_path, lease=10, clock=clocks.clock, wall=clocks.wall)
    claim = first.try_claim("u")
    assert claim is not None
    for _ in range(10):
        assert second.try_claim("u") is None
        clocks.advance(3)
        assert first.renew(claim)
    assert second.try_claim("u") is None
    assert first.valid(claim)


def test_a_waiting_worker_says_which_units_by_whom_until_when_once_a_lease(
    tmp_path: Path,
) -> None:
    """A worker that waits on units held by others logs each one's holder and the end
    of its lease (wall-clock ISO time), at its first look and then once a lease, not at
    each of its looks."""
    clocks = Clocks()
    holder = Claims(tmp_path, lease=10, clock=clocks.clock, wall=clocks.wall)
    waiting = Claims(tmp_path, lease=10, clock=clocks.clock, wall=clocks.wall)
    claims = [holder.try_claim(key) for key in ("a", "b")]
    with structlog.testing.capture_logs() as logs:
        for _ in range(25):  # a look every second for 25 s, the holder renewing
            waiting.report_waiting(["a", "b"])
            clocks.advance(1)
            for claim in claims:
                assert claim is not None and holder.renew(claim)
    said = [log for log in logs if log["event"] == "waiting_for_units"]
    assert len(said) == 3  # at 0, 10 and 20 s
    expiry = datetime.fromtimestamp(1_000_000.0 + 10, UTC).isoformat(timespec="seconds")
    assert said[0]["held"] == [
        {"unit": "a", "owner": holder.owner, "until": expiry},
        {"unit": "b", "owner": holder.owner, "until": expiry},
    ]
    later = datetime.fromtimestamp(1_000_000.0 + 20, UTC).isoformat(timespec="seconds")
    assert said[1]["held"][0]["until"] == later  # renewed at 10 s: its lease ends at 20 s


def test_the_taker_of_a_unit_removes_the_temporaries_its_dead_holder_left(
    tmp_path: Path,
) -> None:
    """A worker killed while it wrote a unit's Parquet file (and its record, and its
    store's job.json) leaves their temporaries; the worker that takes the unit over
    removes them as it begins it, and leaves those of the other units alone."""
    import asyncio

    import orjson
    import pyarrow.parquet as pq

    from llm_annotator.jobs.rows.corpus import list_corpus
    from llm_annotator.jobs.rundir.partitions import (
        ANNOTATIONS_DIR,
        RECORDS_DIR,
        UNITS_DIR,
        PartitionedStore,
    )

    (tmp_path / "c").mkdir()
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / "c" / name).write_bytes(
            b"".join(orjson.dumps({"text": f"t{i}"}) + b"\n" for i in range(5))
        )
    unit, other = list_corpus(tmp_path / "c").units
    clocks = Clocks()
    run = tmp_path / "run"
    run.mkdir()
    annotations = run / ANNOTATIONS_DIR

    def left_by_a_kill(folder: Path, name: str) -> Path:
        fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        os.write(fd, b"PAR1 half a file")
        os.close(fd)
        return Path(path)

    async def scenario() -> None:
        dead = Claims(run, lease=10, clock=clocks.clock, wall=clocks.wall)
        killed = PartitionedStore(run, {"model": "m"}, claims=dead)
        killed.begin(unit, dead.try_claim("a.jsonl"))
        leftovers = [
            left_by_a_kill(annotations, f".{unit.output_name}.new"),
            left_by_a_kill(annotations / RECORDS_DIR, f"{unit.output_name}.json"),
            left_by_a_kill(run / UNITS_DIR / "a.jsonl", "job.json"),
            annotations / f".{unit.output_name}.new",
        ]
        leftovers[-1].write_bytes(b"PAR1 whole but not renamed")
        others = [left_by_a_kill(annotations, f".{other.output_name}.new")]
        killed.close()  # its process's files, as the kernel closes them
        clocks.advance(11)  # the holder was killed: its lease runs out
        taker = Claims(run, lease=10, clock=clocks.clock, wall=clocks.wall)
        store = PartitionedStore(run, {"model": "m"}, claims=taker)
        claim = taker.try_claim("a.jsonl")
        assert claim is not None and claim.generation == 2
        store.begin(unit, claim)
        assert [path for path in leftovers if path.exists()] == []
        assert all(path.exists() for path in others)
        for row in unit.read(None):
            assert store.take(row)
            store.append({"id": row.id, "response": "x"}, unit.index)
        store.end_of(unit)
        await store.drain()
        store.close()

    asyncio.run(scenario())
    assert pq.read_table(annotations / unit.output_name).num_rows == 5
    assert sorted(p.name for p in annotations.glob(f".{unit.output_name}*")) == []


def test_a_dead_holder_on_this_machine_is_taken_over_at_once_not_after_its_lease(
    tmp_path: Path,
) -> None:
    """A worker SIGKILLed on this machine (a --processes worker, a task restarted on the
    same node): another worker here takes its unit at once, with a lease of an hour; a
    holder said to be on another machine keeps it for its lease, and so does a live one."""
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import sys, time; from pathlib import Path\n"
        "from llm_annotator.jobs.rundir.claims import Claims\n"
        "claims = Claims(Path(sys.argv[1]), 3600)\n"
        "assert claims.try_claim(sys.argv[2]) is not None\n"
        "print('held', flush=True); time.sleep(600)\n"
    )

    def holder(key: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path), key],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        said = [process.stdout.readline() for _ in range(2)]  # the claim's log line, then
        assert said[-1] == "held\n", said
        return process

    live, dead, elsewhere = holder("live"), holder("dead"), holder("elsewhere")
    try:
        path = tmp_path / "claims" / "elsewhere.1"
        record = orjson.loads(path.read_bytes())
        path.write_bytes(orjson.dumps({**record, "machine": "another-host:1"}))
        elsewhere.send_signal(signal.SIGKILL)
        elsewhere.wait(timeout=10)
        dead.send_signal(signal.SIGKILL)  # not reaped: a zombie has ended too
        for _ in range(200):
            if process_gone(dead.pid):
                break
            time.sleep(0.01)
        assert process_gone(dead.pid) and not process_gone(live.pid)
        claims = Claims(tmp_path, 3600)
        assert claims.try_claim("live") is None
        assert claims.try_claim("elsewhere") is None
        taken = claims.try_claim("dead")
        assert taken is not None and taken.generation == 2
    finally:
        for process in (live, dead, elsewhere):
            process.kill()
            process.wait(timeout=10)
            if process.stdout is not None:
                process.stdout.close()


def test_a_worker_restarted_in_its_slot_takes_its_own_units_back_at_once(
    tmp_path: Path,
) -> None:
    """A claim made in slot ``task-3`` on another machine (the array task before its
    restart on another node) is taken back at once by a worker in the same slot, with a
    lease of an hour; a worker of another slot waits for the lease; and two live
    processes of one slot on this machine (a misconfigured slot) take nothing from
    each other."""
    from llm_annotator.jobs.rundir.claims import this_machine

    def plant(key: str, owner: str, machine: str | None, slot: str) -> None:
        folder = tmp_path / "claims"
        folder.mkdir(exist_ok=True)
        record = {"owner": owner, "taken_over": 0, "machine": machine, "slot": slot}
        (folder / f"{key}.1").write_bytes(orjson.dumps(record))

    plant("moved", "node-7:4242:ab", "another-host:1", "task-3")
    plant("alive-here", f"{socket.gethostname()}:{os.getppid()}:cd", this_machine(), "task-3")
    other = Claims(tmp_path, 3600, slot="task-4")
    assert other.try_claim("moved") is None
    restarted = Claims(tmp_path, 3600, slot="task-3")
    taken = restarted.try_claim("moved")
    assert taken is not None and taken.generation == 2
    assert restarted.try_claim("alive-here") is None
    said = orjson.loads((tmp_path / "claims" / "moved.2").read_bytes())
    assert said["slot"] == "task-3" and said["owner"] == restarted.owner
