"""Elastic workers (``--shard claim``) over a corpus against a fake server: workers
racing for every unit, a worker SIGKILLed mid-unit and its unit taken over row by row,
a worker stopped past its lease that writes nothing once it wakes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator, MutableMapping
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import pyarrow.dataset as ds
import pytest
import structlog

from llm_annotator import VLLMOnlineRuntimeOptions, VLLMQueueAnnotator
from llm_annotator.jobs.rows.corpus import FILE_COLUMN
from llm_annotator.jobs.rundir.claims import Claims
from llm_annotator.jobs.rundir.fleet import FOUND_DEAD
from llm_annotator.jobs.rundir.partitions import (
    ANNOTATIONS_DIR,
    RECORDS_DIR,
    UNITS_DIR,
    read_manifest,
)
from tests.unit.conftest import FakeServer
from tests.unit.helpers import FAST, command, delayed_echo, sent_texts, write_jsonl

TEMPLATE = "Label: {text}"


def corpus(folder: Path, files: int, rows: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for f in range(files):
        records = [{"text": f"f{f}-r{r}"} for r in range(rows)]
        write_jsonl(folder / f"part-{f:03d}.jsonl", records)
        texts += [str(r["text"]) for r in records]
    return texts


def output(run: Path) -> list[dict[str, Any]]:
    table = ds.dataset(run / ANNOTATIONS_DIR, format="parquet").to_table()
    return table.to_pylist()  # type: ignore[no-any-return]


class Worker:
    """``llm-annotator run --shard claim`` in a process of its own, its output in a file."""

    def __init__(
        self, server: FakeServer, data: Path, run: Path, log: Path, started: list[Worker]
    ) -> None:
        argv = command(server, data, run, "--shard", "claim", "--claim-lease", "2")
        argv[argv.index("--batch-size") + 1] = "2"
        argv += ["--max-concurrent-batches-per-client", "1"]
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.pid = self.process.pid
        started.append(self)

    def wait(self, seconds: float) -> str:
        """Its exit status checked (0), and what it printed."""
        code = self.process.wait(timeout=seconds)
        said = self.log.read_text()
        assert code == 0, said[-3000:]
        return said


def parts_of(run: Path, pid: int) -> dict[Path, int]:
    """The part files a worker wrote, with their sizes."""
    return {p: p.stat().st_size for p in (run / UNITS_DIR).glob(f"*/shards/part-*-{pid}-*.jsonl")}


def wait_for(condition: Any, seconds: float, what: str, worker: Worker) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert worker.process.poll() is None, f"the worker ended: {worker.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def started() -> Iterator[list[Worker]]:
    """The workers a test starts, each killed and reaped at its end if still running."""
    workers: list[Worker] = []
    yield workers
    for worker in workers:
        if worker.process.poll() is None:
            os.kill(worker.pid, signal.SIGCONT)
            worker.process.kill()
        worker.process.wait(timeout=30)


def test_workers_racing_for_every_unit_do_each_row_once(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Three workers in one process claim a corpus's 12 units at the same moment: each
    unit is finished once, each row sent once, and more than one worker did work; each
    unit's record says which worker finished it (``by``: its claim owner)."""
    texts = corpus(tmp_path / "c", files=12, rows=20)
    fake_server.handler = delayed_echo(0.002)

    async def one() -> Any:
        pool = VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST)
        async with pool:
            return await pool.aannotate(
                tmp_path / "c", TEMPLATE, tmp_path / "run", shard="claim", progress=False
            )

    async def three() -> list[Any]:
        return list(await asyncio.gather(one(), one(), one()))

    results = asyncio.run(three())
    assert sum(r.num_rows for r in results) == len(texts)
    assert sum(1 for r in results if r.num_rows) >= 2
    assert sent_texts([fake_server]) == Counter(f"Label: {t}" for t in texts)
    rows = output(tmp_path / "run")
    assert Counter(r["text"] for r in rows) == Counter(texts)
    manifest = read_manifest(tmp_path / "run")
    assert manifest is not None and manifest["complete"] and manifest["units"] == 12
    by: Counter[str] = Counter()
    for path in (tmp_path / "run" / ANNOTATIONS_DIR / RECORDS_DIR).glob("*.json"):
        record = orjson.loads(path.read_bytes())
        by[record["by"]] += record["rows"]
    assert all(len(owner.split(":")) >= 3 for owner in by), by  # host:pid:token
    assert sorted(by.values()) == sorted(r.num_rows for r in results if r.num_rows)


def test_workers_of_one_job_hold_each_servers_budget_once_between_them(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Three independent workers, each given a budget of 8 on the one server (batch 4 x
    2 batches): once they have counted each other the server holds no more than 8 (3 x 2
    with the rounding down), not 3 x 8; each row once; and each worker left the fleet."""
    texts = corpus(tmp_path / "c", files=12, rows=40)
    fake_server.handler = delayed_echo(0.05)
    held: list[tuple[float, int]] = []

    async def one() -> Any:
        pool = VLLMQueueAnnotator(
            [fake_server.base_url], batch_size=4, max_concurrent_batches_per_client=2, **FAST
        )
        async with pool:
            result = await pool.aannotate(
                tmp_path / "c", TEMPLATE, tmp_path / "run", shard="claim", progress=False
            )
            assert pool.sharing == 1  # the pool has its whole budget back for what follows
            return result

    async def sample(stop: asyncio.Event) -> None:
        start = time.monotonic()
        while not stop.is_set():
            held.append((time.monotonic() - start, fake_server.in_flight))
            await asyncio.sleep(0.005)

    async def three() -> list[Any]:
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(sample(stop))
        try:
            return list(await asyncio.gather(one(), one(), one()))
        finally:
            stop.set()
            await sampler

    results = asyncio.run(three())
    assert sum(r.num_rows for r in results) == len(texts)
    assert sent_texts([fake_server]) == Counter(f"Label: {t}" for t in texts)
    settled = [n for t, n in held if t >= 1.0]
    assert settled and max(settled) <= 8, max(settled)
    assert max(n for _, n in held) <= 3 * 8
    assert not list((tmp_path / "run" / "fleet").glob("*.json"))


def test_a_server_that_hangs_is_taken_out_by_every_worker_once_one_finds_it_dead(
    tmp_path: Path, fake_servers: Any
) -> None:
    """Two workers over two servers; one server hangs mid-run (its requests and its
    /health). Worker a checks health often and evicts it; worker b, whose own checks
    would take minutes to (a long request timeout, rare probes, no tail hedging), takes
    it out at its next look at the fleet, and its rows there go to the other server:
    each row once."""
    texts = corpus(tmp_path / "c", files=12, rows=40)
    hung, fine = fake_servers(2)
    fine.handler = delayed_echo(0.02)
    stuck = asyncio.Event()

    async def hang_after_some(request: dict[str, Any]) -> Any:
        if len(hung.requests) > 40:
            hung.health_delay = 3600.0
            await stuck.wait()  # never set: a stopped server
        return await delayed_echo(0.02)(request)

    hung.handler = hang_after_some
    quick = {**FAST, "max_failed_health_checks": 1}
    slow = {"health_check_interval": 60.0, "timeout": 120.0, "hedge_tail": False}

    async def one(settings: dict[str, Any]) -> Any:
        pool = VLLMQueueAnnotator(
            [hung.base_url, fine.base_url],
            batch_size=2,
            max_concurrent_batches_per_client=2,
            **settings,
        )
        async with pool:
            result = await pool.aannotate(
                tmp_path / "c", TEMPLATE, tmp_path / "run", shard="claim", progress=False
            )
            return result, pool.statistics().member(hung.base_url)

    async def both() -> list[Any]:
        return list(await asyncio.gather(one(quick), one(slow)))

    (a, a_hung), (b, b_hung) = asyncio.run(both())
    assert a.num_rows + b.num_rows == len(texts)
    rows = output(tmp_path / "run")
    assert Counter(r["text"] for r in rows) == Counter(texts)
    assert a_hung.evictions >= 1 and "health checks" in (a_hung.last_error or "")
    assert b_hung.evictions == 1, b_hung
    assert (b_hung.last_error or "").startswith(FOUND_DEAD), b_hung.last_error


def test_a_worker_killed_mid_unit_has_its_unit_taken_over_row_by_row(
    tmp_path: Path, fake_server: FakeServer, started: list[Worker]
) -> None:
    texts = corpus(tmp_path / "c", files=4, rows=60)
    fake_server.handler = delayed_echo(0.02)
    run = tmp_path / "run"
    first = Worker(fake_server, tmp_path / "c", run, tmp_path / "first.log", started)
    wait_for(lambda: sum(parts_of(run, first.pid).values()) > 2000, 60, "the first rows", first)
    first.process.kill()
    first.process.wait(timeout=30)
    written = sum(parts_of(run, first.pid).values())
    second = Worker(fake_server, tmp_path / "c", run, tmp_path / "second.log", started)
    assert "unit_taken_over" in second.wait(120)
    rows = output(run)
    assert Counter((r[FILE_COLUMN], r["text"]) for r in rows) == Counter(
        (f"part-{int(t[1 : t.index('-')]):03d}.jsonl", t) for t in texts
    )
    sent = sent_texts([fake_server])
    assert set(sent) == {f"Label: {t}" for t in texts}
    # Sent again: what the killed worker had in flight or had not flushed yet (half a
    # second of answers); the rest of its rows were kept, not done again.
    resent = sum(n - 1 for n in sent.values())
    assert resent <= len(texts) // 10, resent
    assert written > 2000


def test_a_worker_stopped_past_its_lease_writes_nothing_once_it_wakes(
    tmp_path: Path, fake_server: FakeServer, started: list[Worker]
) -> None:
    texts = corpus(tmp_path / "c", files=3, rows=60)
    fake_server.handler = delayed_echo(0.02)
    run = tmp_path / "run"
    first = Worker(fake_server, tmp_path / "c", run, tmp_path / "first.log", started)
    wait_for(lambda: sum(parts_of(run, first.pid).values()) > 2000, 60, "the first rows", first)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        stopped_at = parts_of(run, first.pid)
        second = Worker(fake_server, tmp_path / "c", run, tmp_path / "second.log", started)
        assert "unit_taken_over" in second.wait(120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert "unit_lost" in first.wait(60)
    assert parts_of(run, first.pid) == stopped_at  # not a byte more once it woke
    rows = output(run)
    assert Counter(r["text"] for r in rows) == Counter(texts)


def test_processes_start_workers_that_share_the_corpus_and_each_servers_budget(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """``--processes 2``: two workers take the units by claims, counting each other in the
    run directory's fleet; every row once; the command prints what the manifest says."""
    texts = corpus(tmp_path / "c", files=8, rows=30)
    fake_server.handler = delayed_echo(0.01)
    argv = command(fake_server, tmp_path / "c", tmp_path / "run", "--processes", "2")
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "starting 2 worker processes" in done.stderr
    assert f"rows: {len(texts)} ({len(texts)} succeeded, 0 failed) in 8 of 8 units" in done.stdout
    workers = sorted(p.name for p in (tmp_path / "run").glob("worker-*"))
    assert len(workers) == 2
    assert sent_texts([fake_server]) == Counter(f"Label: {t}" for t in texts)


def test_processes_share_one_file_by_its_byte_ranges_and_refuse_a_static_shard(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """``--processes 2`` over one JSONL file with an id column: its byte ranges are the
    units the workers claim, every row once; with a static shard it is refused before
    any request."""
    records = [{"id": i, "text": f"t{i}"} for i in range(200)]
    data = write_jsonl(tmp_path / "one.jsonl", records)
    fake_server.handler = delayed_echo(0.005)
    argv = command(fake_server, data, tmp_path / "run", "--processes", "2")
    argv += ["--id-column", "id", "--unit-size", "1K"]
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr[-3000:]
    units = sorted((tmp_path / "run" / ANNOTATIONS_DIR).glob("*.parquet"))
    assert len(units) > 2 and all("#b" in unit.name for unit in units), units
    assert sent_texts([fake_server]) == Counter(f"Label: t{i}" for i in range(200))
    assert sorted(row["id"] for row in output(tmp_path / "run")) == list(range(200))
    fake_server.requests.clear()
    argv = command(fake_server, data, tmp_path / "run2", "--processes", "2", "--shard", "0/2")
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 1
    assert "--processes: workers take a corpus's units by claims" in done.stderr
    assert not fake_server.requests


def test_workers_waiting_for_units_still_send_their_regenerations(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """With an output schema every answer is generated again (the fake server's echo is
    not JSON); a worker that has nothing left to claim must still send its units'
    regenerations, or two workers would each wait for the other's unit for ever."""
    texts = corpus(tmp_path / "c", files=4, rows=15)
    fake_server.handler = delayed_echo(0.005)
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}

    async def one() -> Any:
        pool = VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST)
        async with pool:
            return await pool.aannotate(
                tmp_path / "c",
                TEMPLATE,
                tmp_path / "run",
                shard="claim",
                progress=False,
                options=VLLMOnlineRuntimeOptions(output_schema=schema),
                max_regenerations=2,
            )

    async def two() -> list[Any]:
        return list(await asyncio.wait_for(asyncio.gather(one(), one()), 120))

    results = asyncio.run(two())
    assert sum(r.num_failed for r in results) == len(texts)  # each an invalid_output row
    assert Counter(sent_texts([fake_server]).values()) == {3: len(texts)}  # 1 + 2 each
    table = ds.dataset(tmp_path / "run" / ANNOTATIONS_DIR, format="parquet").to_table()
    assert table.num_rows == len(texts)
    assert set(table.column("error_type").to_pylist()) == {"invalid_output"}
    assert table.schema.field("label").type == "string"  # null in every row: typed anyway


def test_a_worker_waiting_on_a_unit_held_by_another_says_which_by_whom_until_when(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """A worker that has finished every unit but one held by another worker logs that
    unit, its holder (as the claim file names it) and the end of its lease; once the
    holder stops renewing, the worker takes the unit over and finishes the corpus."""
    texts = corpus(tmp_path / "c", files=2, rows=10)
    run = tmp_path / "run"
    run.mkdir()
    other = Claims(run, lease=1.0)
    held = other.try_claim("part-001.jsonl")
    assert held is not None

    async def scenario(logs: list[MutableMapping[str, Any]]) -> Any:
        async def renew_until_waited_on() -> None:
            for _ in range(400):  # the other worker is alive until the first one waits
                if any(log["event"] == "waiting_for_units" for log in logs):
                    return
                assert held is not None and other.renew(held)
                await asyncio.sleep(0.05)

        pool = VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST)
        async with pool:
            renewing = asyncio.ensure_future(renew_until_waited_on())
            result = await pool.aannotate(
                tmp_path / "c", TEMPLATE, run, shard="claim", claim_lease=1.0, progress=False
            )
            await renewing
            return result

    with structlog.testing.capture_logs() as logs:
        result = asyncio.run(asyncio.wait_for(scenario(logs), 60))
    waited = [log for log in logs if log["event"] == "waiting_for_units"]
    assert waited, [log["event"] for log in logs]
    assert waited[0]["units"] == 1
    [entry] = waited[0]["held"]
    assert entry["unit"] == "part-001.jsonl" and entry["owner"] == other.owner
    assert datetime.fromisoformat(entry["until"]).tzinfo is not None
    assert any(log["event"] == "unit_taken_over" for log in logs)
    assert result.num_rows == len(texts)
    assert Counter(r["text"] for r in output(run)) == Counter(texts)
