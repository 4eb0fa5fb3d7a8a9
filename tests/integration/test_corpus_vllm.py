"""Corpus jobs against real vLLM servers: elastic workers (``--shard claim``) over a
corpus of many files and one large file cut into byte ranges, one SIGKILLed and one
added mid-run; static shards by unit. The servers' own counters
(``vllm:request_success_total``) tell what was really sent."""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

import orjson
import pyarrow.dataset as ds
import pytest

from llm_annotator.jobs.rows.corpus import FILE_COLUMN
from llm_annotator.jobs.rundir.partitions import ANNOTATIONS_DIR, RECORDS_DIR, read_manifest
from llm_annotator.local import LocalServers
from tests.integration.test_jobs_vllm import (
    finish,
    finished_requests,
    run_args,
    start,
    wait_until_idle,
)

pytestmark = pytest.mark.integration

BATCH = ["--batch-size", "8", "--max-concurrent-batches-per-client", "2"]
"""At most 16 requests in flight per server and worker: a bound on what a killed
worker's rows may be sent again."""


def write_corpus(folder: Path, files: int, rows: int) -> int:
    folder.mkdir()
    for f in range(files):
        lines = (orjson.dumps({"id": r, "text": f"review {f}-{r}: fine"}) for r in range(rows))
        (folder / f"reviews-{f:03d}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return files * rows


def write_large_file(path: Path, rows: int) -> int:
    """One JSONL file with an id column, of rows about 60 bytes each."""
    lines = (orjson.dumps({"id": f"big-{r}", "text": f"review big-{r}: fine"}) for r in range(rows))
    path.write_bytes(b"\n".join(lines) + b"\n")
    return rows


def units_done(run: Path) -> int:
    return len(list((run / ANNOTATIONS_DIR / RECORDS_DIR).glob("*.json")))


@pytest.fixture
def idle(vllm_servers: LocalServers) -> LocalServers:
    wait_until_idle(vllm_servers)
    return vllm_servers


def test_elastic_workers_one_killed_one_added_do_every_row_once(
    idle: LocalServers, tmp_path: Path
) -> None:
    """Two workers start on a corpus of 6 files and one JSONL file of 1,200 rows cut into
    byte ranges of 1 KiB (about 57 units, each read alone); once some units are finished
    one is SIGKILLed (mid-unit: each worker holds one in progress) and a third joins. The
    others take the killed worker's unit over when its lease runs out; every (file, id)
    is in the output once, and the servers answered every row once, plus at most what the
    killed worker had in flight or unflushed."""
    n = write_corpus(tmp_path / "corpus", files=6, rows=40)
    n += write_large_file(tmp_path / "corpus" / "large.jsonl", rows=1200)
    run = tmp_path / "run"
    args = run_args(
        idle,
        tmp_path / "corpus",
        run,
        "--shard",
        "claim",
        "--claim-lease",
        "3",
        "--id-column",
        "id",
        "--unit-size",
        "1K",
        *BATCH,
    )
    before = finished_requests(idle)
    first = start(args, tmp_path / "first.log")
    second = start(args, tmp_path / "second.log")
    deadline = time.monotonic() + 240
    while units_done(run) < 4:
        assert time.monotonic() < deadline and first.poll() is None, (
            tmp_path / "first.log"
        ).read_text()[-3000:]
        time.sleep(0.1)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    third = finish(args, tmp_path / "third.log")
    assert third.returncode == 0, third.stderr[-3000:]
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    wait_until_idle(idle)
    sent = finished_requests(idle) - before
    rows = ds.dataset(run / ANNOTATIONS_DIR, format="parquet").to_table().to_pylist()
    keys = Counter((r[FILE_COLUMN], r["id"]) for r in rows)
    assert len(keys) == n and max(keys.values()) == 1
    assert all(r["error"] is None for r in rows), [r for r in rows if r["error"]][:2]
    assert n <= sent <= n + 2 * 16 + 200, sent  # 200: half a second of answers, unflushed
    manifest = read_manifest(run)
    assert manifest is not None and manifest["complete"] and manifest["rows"] == n
    ranges = list((run / ANNOTATIONS_DIR).glob("large.jsonl#b*.parquet"))
    assert len(ranges) > 40, len(ranges)
    assert sum(1 for r in rows if r[FILE_COLUMN] == "large.jsonl") == 1200
    logs = (tmp_path / "second.log").read_text() + third.stdout + third.stderr
    assert "unit_taken_over" in logs
    reports = [orjson.loads(p.read_bytes()) for p in run.glob("worker-*/report.json")]
    assert len(reports) == 2 and all(r["units"]["done"] > 0 for r in reports)


def test_static_shards_of_a_corpus_read_only_their_units(
    idle: LocalServers, tmp_path: Path
) -> None:
    """Two static shards split 10 files by unit: each sends only its units' rows (the
    servers' counters), together every row once, and the last writes the manifest."""
    n = write_corpus(tmp_path / "corpus", files=10, rows=20)
    run = tmp_path / "run"
    sent = []
    for index in range(2):
        before = finished_requests(idle)
        done = finish(
            run_args(idle, tmp_path / "corpus", run, "--shard", f"{index}/2"), tmp_path / "log"
        )
        assert done.returncode == 0, done.stderr[-3000:]
        wait_until_idle(idle)
        sent.append(finished_requests(idle) - before)
    assert sent == [n // 2, n // 2]
    manifest = read_manifest(run)
    assert manifest is not None and manifest["complete"] and manifest["rows"] == n
