"""Corpus jobs against real vLLM servers: elastic workers (``--shard claim``) over a
corpus of many files and one large file cut into byte ranges, one SIGKILLed and one
added mid-run; static shards by unit. The servers' own counters
(``vllm:request_success_total``) tell what was really sent."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
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


class Held:
    """Each server's ``num_requests_running + num_requests_waiting``, read every 0.1 s
    in a thread of its own, with the time of each read."""

    def __init__(self, servers: LocalServers) -> None:
        self.servers = servers
        self.reads: list[tuple[float, list[float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(0.1):
                held = []
                for url in self.servers.base_urls:
                    text = client.get(url.removesuffix("/v1") + "/metrics").text
                    held.append(sum(gauge(text, name) for name in BUSY))
                self.reads.append((time.monotonic(), held))

    def most(self, start: float, end: float) -> tuple[int, float]:
        """How many reads fell in ``[start, end)``, and the most any server held then."""
        within = [max(held) for at, held in self.reads if start <= at < end]
        return len(within), max(within, default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def gauge(text: str, name: str) -> float:
    """A gauge of one server's ``/metrics``, summed over its label sets."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)$")
    return sum(float(m.group(2)) for line in text.splitlines() if (m := pattern.match(line)))


def fleet_of(run: Path) -> int:
    return len(list((run / "fleet").glob("*.json")))


def test_elastic_workers_share_the_servers_one_killed_one_added_do_every_row_once(
    idle: LocalServers, tmp_path: Path
) -> None:
    """Three independent workers start on a corpus of 6 files and one JSONL file of
    1,800 rows cut into byte ranges of 1 KiB (about 86 units, each read alone), each
    given a budget of 16 per server. Once all three count each other, no server holds
    more than 1.25 x 16 (running + waiting, read from its /metrics): they hold 3 x 5,
    not 3 x 16. One is SIGKILLed mid-unit: the others take its share back at their next
    count (its process is gone), and its unit over when its lease runs out; a fourth
    joins. Every (file, id) is in the output once, and the servers answered every row
    once, plus at most what the killed worker had in flight or unflushed."""
    n = write_corpus(tmp_path / "corpus", files=6, rows=40)
    n += write_large_file(tmp_path / "corpus" / "large.jsonl", rows=1800)
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
        "--max-completion-tokens",  # answers that take a while: the servers hold them
        "16",
    )
    before = finished_requests(idle)
    held = Held(idle)
    started: list[subprocess.Popen[bytes]] = []
    try:
        first = start(args, tmp_path / "first.log")
        started.append(first)
        others = []
        for name in ("second", "third"):
            others.append(start(args, tmp_path / f"{name}.log"))
            started.append(others[-1])
        deadline = time.monotonic() + 240
        while fleet_of(run) < 3:
            assert time.monotonic() < deadline and first.poll() is None, (
                tmp_path / "first.log"
            ).read_text()[-3000:]
            time.sleep(0.05)
        joined = time.monotonic()
        logs = [tmp_path / f"{name}.log" for name in ("first", "second", "third")]
        while not all(3 in fleet_counts(log) for log in logs):
            assert time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
            time.sleep(0.05)
        # Each has counted three; what they held beyond their share before is answered
        # within a few seconds (16 tokens an answer, on two shared cores). The servers
        # are read for 3 s after that, well before the three can finish the corpus.
        settled = time.monotonic() + 4.0
        while units_done(run) < 4 or time.monotonic() < settled + 3.0:
            assert time.monotonic() < deadline and first.poll() is None, (
                tmp_path / "first.log"
            ).read_text()[-3000:]
            time.sleep(0.05)
        killed = time.monotonic()
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        while not _share_taken_back(tmp_path / "second.log"):
            assert time.monotonic() < killed + 30, (tmp_path / "second.log").read_text()[-3000:]
            time.sleep(0.05)
        fourth = finish(args, tmp_path / "fourth.log")
        assert fourth.returncode == 0, fourth.stderr[-3000:]
        for name, process in zip(("second", "third"), others, strict=True):
            assert process.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        held.stop()
        for process in started:  # a failed assertion leaves none running
            if process.poll() is None:
                process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=30)
    reads, most = held.most(settled, killed)
    timeline = [(round(at - joined, 1), held) for at, held in held.reads if at >= joined - 1]
    # 3 x 5 = 15 in steady state; a worker that idles out of the fleet and comes back
    # (it holds back for a look) moves the others' shares, and what they held beyond the
    # new share drains as it is answered: 17 was seen once. Without the fleet: up to 48.
    assert reads >= 3 and most <= 20, (reads, most, round(killed - joined, 1), str(timeline))
    print(f"reads of the servers' /metrics: {timeline}")
    _, before_sharing = held.most(0.0, joined)
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
    assert sum(1 for r in rows if r[FILE_COLUMN] == "large.jsonl") == 1800
    said = "".join(log.read_text() for log in logs[1:]) + fourth.stdout + fourth.stderr
    assert "unit_taken_over" in said
    reports = [orjson.loads(p.read_bytes()) for p in run.glob("worker-*/report.json")]
    assert len(reports) == 3 and sum(r["units"]["done"] > 0 for r in reports) >= 2
    assert fleet_of(run) == 0  # each left the fleet as it ended; the killed one's removed
    print(f"most held by a server: {most} of 16 with three sharing; {before_sharing} before")


def fleet_counts(log: Path) -> list[int]:
    """The fleet's sizes a worker counted, in order (its ``fleet_changed`` lines)."""
    counts = []
    for line in log.read_bytes().splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            said = orjson.loads(line)
            if isinstance(said, dict) and said.get("event") == "fleet_changed":
                counts.append(said["workers"])
    return counts


def _share_taken_back(log: Path) -> bool:
    """Whether a worker counted three workers, then fewer."""
    counts = fleet_counts(log)
    return 3 in counts and min(counts[counts.index(3) :]) < 3


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
