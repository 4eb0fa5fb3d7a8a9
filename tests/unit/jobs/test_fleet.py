"""The fleet: the workers of one job count each other in the run directory, and each
holds its share of every server's budget; a worker that leaves, dies or idles gives its
share back, and a worker restarted in its slot takes its own place."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from llm_annotator.jobs.rundir.claims import process_gone, this_machine
from llm_annotator.jobs.rundir.fleet import (
    FLEET_DIR,
    FOUND_DEAD,
    SERVERS_DIR,
    Fleet,
    keep_share,
    share_evictions,
    worker_slot,
)

LEASE = 60.0


def fleet(run_dir: Path, name: str, slot: str | None = None, **kwargs: float) -> Fleet:
    return Fleet(run_dir, f"host:{os.getpid()}:{name}", slot, this_machine(), LEASE, **kwargs)  # type: ignore[arg-type]


def test_workers_count_each_other_and_one_that_leaves_or_expires_no_longer_counts(
    tmp_path: Path,
) -> None:
    a, b, c = fleet(tmp_path, "a"), fleet(tmp_path, "b"), fleet(tmp_path, "c")
    assert a.count() == 0  # not joined: it counts no one, itself neither
    for worker in (a, b, c):
        worker.join()
    assert [w.count() for w in (a, b, c)] == [3, 3, 3]
    b.leave()
    assert a.count() == 2 and not (tmp_path / FLEET_DIR / b.path.name).exists()
    old = time.time() - LEASE - 1  # c stopped renewing a lease ago
    os.utime(c.path, (old, old))
    assert a.count() == 1
    c.renew()
    assert a.count() == 2


def test_a_worker_whose_process_is_gone_on_this_machine_no_longer_counts_at_once(
    tmp_path: Path,
) -> None:
    """A worker of this machine SIGKILLed (its file fresh, its lease far from over)
    gives its share back at the next count; one said to be on another machine counts
    until its lease ends."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    assert process_gone(gone.pid)
    me = fleet(tmp_path, "me")
    me.join()
    folder = tmp_path / FLEET_DIR
    dead = {"owner": f"host:{gone.pid}:x", "slot": None, "machine": this_machine()}
    (folder / "dead.json").write_bytes(orjson.dumps(dead))
    elsewhere = {**dead, "machine": "another-host:1"}
    (folder / "elsewhere.json").write_bytes(orjson.dumps(elsewhere))
    assert me.count() == 2  # itself and the one elsewhere
    assert not (folder / "dead.json").exists() and (folder / "elsewhere.json").exists()
    forgotten = time.time() - 10 * LEASE  # expired for ten leases: removed too
    os.utime(folder / "elsewhere.json", (forgotten, forgotten))
    assert me.count() == 1 and not (folder / "elsewhere.json").exists()


def test_workers_of_one_slot_count_each_other_and_a_restart_elsewhere_replaces_its_earlier_run(
    tmp_path: Path,
) -> None:
    """Two live workers given one slot on this machine (a misconfiguration) still count
    each other, so neither holds the whole budget; the file of the slot's earlier run on
    another machine (the array task before its restart) no longer counts for the
    worker restarted in that slot, and is removed."""
    first = fleet(tmp_path, "first", slot="slurm-7_3")
    twin = fleet(tmp_path, "twin", slot="slurm-7_3")
    first.join()
    twin.join()
    assert first.count() == twin.count() == 2
    earlier = {"owner": "node-9:77:zz", "slot": "slurm-7_4", "machine": "node-9:1"}
    (tmp_path / FLEET_DIR / "node-9_77_zz.json").write_bytes(orjson.dumps(earlier))
    assert first.count() == 3  # another slot's worker elsewhere: counted for its lease
    restarted = fleet(tmp_path, "restarted", slot="slurm-7_4")
    restarted.join()
    assert restarted.count() == 3  # itself and the two twins, not its earlier run
    assert not (tmp_path / FLEET_DIR / "node-9_77_zz.json").exists()


def test_slots_come_from_the_scheduler_or_the_variable() -> None:
    assert worker_slot({"SLURM_ARRAY_JOB_ID": "9", "SLURM_ARRAY_TASK_ID": "0"}) == "slurm-9_0"
    assert worker_slot({"SLURM_JOB_ID": "4", "JOB_COMPLETION_INDEX": "4"}) is None
    assert worker_slot({"LLM_ANNOTATOR_WORKER_SLOT": "  "}) is None


def test_the_share_follows_workers_that_join_idle_and_leave(tmp_path: Path) -> None:
    """A worker keeps its share: alone it has the whole budget; when two more join it
    holds a third; one that holds no unit for a while leaves the fleet and the others
    take its share; at the end each leaves."""
    shares: list[int] = []
    others = [fleet(tmp_path, name) for name in ("b", "c")]
    idle = [False]

    async def scenario() -> None:
        me = fleet(tmp_path, "me")
        task = asyncio.ensure_future(
            keep_share(me, lambda: True, shares.append, every=0.02, idle_for=0.1)
        )
        await asyncio.sleep(0.3)
        for other in others:
            other.join()
        await asyncio.sleep(0.3)
        busy_c = asyncio.ensure_future(
            keep_share(others[1], lambda: not idle[0], lambda n: None, every=0.02, idle_for=0.1)
        )
        idle[0] = True
        await asyncio.sleep(0.5)  # c holds no unit: it leaves within idle_for
        others[0].leave()
        await asyncio.sleep(0.3)
        for running in (task, busy_c):
            running.cancel()
        await asyncio.gather(task, busy_c, return_exceptions=True)
        assert not me.path.exists() and not me.joined

    asyncio.run(scenario())
    # (a count between the two joins may see 2 on the way to 3)
    assert shares[0] == 1 and shares[-3:] == [3, 2, 1] and len(shares) <= 5


def test_a_worker_that_joins_others_holds_back_for_a_look_before_its_share(
    tmp_path: Path,
) -> None:
    """Two workers already hold the whole budget between them: the third holds one
    request a server (a count of 2**30) until they have counted it, then its third."""
    shares: list[int] = []
    for name in ("a", "b"):
        fleet(tmp_path, name).join()

    async def scenario() -> None:
        me = fleet(tmp_path, "me")
        task = asyncio.ensure_future(keep_share(me, lambda: True, shares.append, every=0.05))
        await asyncio.sleep(0.4)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert shares == [1 << 30, 3]


def test_a_worker_that_comes_back_holds_back_again_and_counts_itself_while_out(
    tmp_path: Path,
) -> None:
    """Beside one other worker: a worker idle long enough leaves the fleet but still
    shares by two (it may still send what it has); busy again, it rejoins, holds back
    for a look, then takes its half."""
    shares: list[int] = []
    fleet(tmp_path, "other").join()
    busy = [True]

    async def scenario() -> None:
        me = fleet(tmp_path, "me")
        task = asyncio.ensure_future(
            keep_share(me, lambda: busy[0], shares.append, every=0.05, idle_for=0.1)
        )
        await asyncio.sleep(0.3)
        busy[0] = False
        await asyncio.sleep(0.4)
        assert not me.joined
        busy[0] = True
        await asyncio.sleep(0.4)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert shares == [1 << 30, 2, 1 << 30, 2]


def test_a_server_one_worker_evicts_is_taken_out_by_the_others_in_the_same_words(
    tmp_path: Path,
) -> None:
    """Worker a evicts a server: b takes it out at its next look, in the same words at
    every look (the pool acts on one told eviction once), and does not tell it on (an
    eviction told by another is never told again); a's eviction of another server that
    has answered a since, and one told more than a lease ago, are not acted on."""
    a, b = fleet(tmp_path, "a"), fleet(tmp_path, "b")
    told_a: list[tuple[str, str, str | None]] = [
        ("http://s1/v1", "evicted", "connect timeout"),
        ("http://s2/v1", "evicted", "hung"),
    ]
    suspected: list[tuple[str, str]] = []
    told_b: list[tuple[str, str, str | None]] = []

    def taken(changes: list[tuple[str, str, str | None]]) -> Any:
        def take() -> list[tuple[str, str, str | None]]:
            out = changes[:]
            changes.clear()
            return out

        return take

    def suspect(url: str, reason: str) -> bool:
        suspected.append((url, reason))
        told_b.append((url, "evicted", reason))  # b's pool says what it did
        return True

    async def run() -> None:
        tasks = [
            asyncio.ensure_future(
                share_evictions(a, taken(told_a), lambda u, r: False, every=0.02)
            ),
        ]
        await asyncio.sleep(0.1)
        told_a.append(("http://s2/v1", "healthy", None))  # s2 answers a again
        await asyncio.sleep(0.1)
        tasks.append(asyncio.ensure_future(share_evictions(b, taken(told_b), suspect, every=0.02)))
        await asyncio.sleep(0.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(run())
    assert len(set(suspected)) == 1 and suspected[0][0] == "http://s1/v1", suspected
    assert suspected[0][1].startswith(f"{FOUND_DEAD} {a.owner} at ")
    assert suspected[0][1].endswith("UTC: connect timeout")
    records = [orjson.loads(p.read_bytes()) for p in (tmp_path / FLEET_DIR / SERVERS_DIR).iterdir()]
    assert [(r["url"], r["by"]) for r in records] == [("http://s1/v1", a.owner)]
    old = time.time() - LEASE - 1
    for path in (tmp_path / FLEET_DIR / SERVERS_DIR).iterdir():
        os.utime(path, (old, old))
    assert fleet(tmp_path, "c").evictions() == []
