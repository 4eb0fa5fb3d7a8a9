"""A three-step pipeline on the small real model: label reviews, ask the negative ones
for a reason as JSON, judge each reason. The pipeline process is SIGKILLed in step 2 and
run again: step 1 is not redone, step 2 resumes, and every row of every step is written
exactly once (the server's own request counter says what was sent)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq

from llm_annotator.local import LocalServers
from tests.cli import COMMAND
from tests.integration.test_jobs_vllm import finished_requests, wait_until_idle, written_ids

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "pipeline" / "pipeline.toml"
"""The documentation's example, run here as it is but for the settings overridden."""
REVIEWS = ROOT / "src" / "llm_annotator" / "cli" / "data" / "reviews.jsonl"
ROWS = 60


def _overrides(tmp_path: Path, url: str) -> list[str]:
    """The example's settings for this test: a part of its reviews, a directory of its
    own, the shared server, and exact request counts (no regenerations, no hedging)."""
    lines = REVIEWS.read_bytes().splitlines()[:ROWS]
    (tmp_path / "reviews.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    settings = {
        "output_dir": str(tmp_path / "run"),
        "input": str(tmp_path / "reviews.jsonl"),
        "servers": [url],
        "model": "small",
        "max_regenerations": 0,
        "hedge_tail": False,
        "log_format": "json",
    }
    return [f"--set={key}={orjson.dumps(value).decode()}" for key, value in settings.items()]


def _table(run: Path, step: str) -> list[dict[str, Any]]:
    return pq.read_table(run / "steps" / step / "annotations.parquet").to_pylist()  # type: ignore[no-any-return]


def test_a_pipeline_killed_in_step_two_resumes_each_row_once(
    small_server: LocalServers, tmp_path: Path
) -> None:
    wait_until_idle(small_server)
    overrides = _overrides(tmp_path, small_server.base_urls[0])
    run = tmp_path / "run"
    log = tmp_path / "pipeline.log"
    args = [COMMAND, "pipeline", "run", str(EXAMPLE), *overrides]
    first_sent = finished_requests(small_server)
    with log.open("ab") as sink:  # from the repository's root, as the example says
        process = subprocess.Popen(
            args, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, cwd=ROOT
        )
    deadline = time.monotonic() + 300
    while len(written_ids(run / "steps" / "reason")) < 2:
        assert process.poll() is None, f"the pipeline ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    wait_until_idle(small_server)
    label_sent = finished_requests(small_server) - first_sent
    label = _table(run, "label")
    assert sorted(row["id"] for row in label) == list(range(ROWS))
    negative = sorted(
        row["id"] for row in label if row["sentiment"] == "negative" and row["error"] is None
    )
    assert len(negative) >= 5, [r["response"] for r in label[:5]]
    reason_done = written_ids(run / "steps" / "reason")
    assert len(reason_done) == len(set(reason_done)) < len(negative)
    assert not (run / "steps" / "judge").exists()

    before = finished_requests(small_server)
    second = subprocess.run(
        args, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, cwd=ROOT
    )
    log.write_text(second.stdout + second.stderr)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "step label: skipped, done before" in second.stdout
    assert "step reason: resumed, done" in second.stdout
    wait_until_idle(small_server)
    reason = _table(run, "reason")
    assert sorted(row["id"] for row in reason) == negative  # each once, none lost
    answered = sorted(row["id"] for row in reason if row["error"] is None)
    judge = _table(run, "judge")
    assert sorted(row["id"] for row in judge) == answered
    assert {row["verdict"] for row in judge if row["error"] is None} <= {"yes", "no"}
    assert all(row["sentiment"] == "negative" for row in judge)
    sent = finished_requests(small_server) - before
    assert sent == (len(negative) - len(reason_done)) + len(judge)
    assert label_sent >= ROWS  # step 1 was sent once, in the first run only

    report = orjson.loads((run / "report.json").read_bytes())
    assert [(s["name"], s["action"], s["rows"]) for s in report["steps"]] == [
        ("label", "skip", ROWS),
        ("reason", "resume", len(negative)),
        ("judge", "run", len(judge)),
    ]
    described = subprocess.run(
        [COMMAND, "pipeline", "describe", str(EXAMPLE), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert described.returncode == 0, described.stderr
    for step, rows in (("label", ROWS), ("reason", len(negative)), ("judge", len(judge))):
        assert f"{step}: reads" in described.stdout
        assert f"done: {rows} of {rows} rows" in described.stdout
    assert described.stdout.count("a run would skip it") == 3


def test_the_pipeline_by_elastic_workers_one_killed_one_added_does_each_step_once(
    vllm_servers: LocalServers, tmp_path: Path
) -> None:
    """The documentation's 3-step pipeline over a corpus of 30 files, by elastic workers
    (``pipeline run --shard claim``) on the two tiny-model servers: two start, one is
    SIGKILLed once a few units of the first step are finished, a third joins after. Every
    row of every step is in its output once, and the servers answered each step's rows
    once, plus at most what the killed worker had in hand."""
    wait_until_idle(vllm_servers)
    reviews = [orjson.loads(line) for line in REVIEWS.read_bytes().splitlines()[:120]]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(30):
        part = reviews[4 * f : 4 * f + 4]
        (corpus / f"reviews-{f:02d}.jsonl").write_bytes(
            b"".join(orjson.dumps(r) + b"\n" for r in part)
        )
    run = tmp_path / "run"
    settings = {
        "output_dir": str(run),
        "input": str(corpus),
        "servers": vllm_servers.base_urls,
        "max_regenerations": 0,
        "hedge_tail": False,
        "log_format": "json",
        "batch_size": 4,
        "max_concurrent_batches_per_client": 2,
    }
    overrides = [f"--set={key}={orjson.dumps(value).decode()}" for key, value in settings.items()]
    args = [COMMAND, "pipeline", "run", str(EXAMPLE), *overrides, "--shard", "claim"]
    args += ["--claim-lease", "3"]
    before = finished_requests(vllm_servers)
    logs = [tmp_path / f"worker-{i}.log" for i in range(3)]

    def start(log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as sink:  # from the repository's root, as the example says
            return subprocess.Popen(
                args, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, cwd=ROOT
            )

    first, second = start(logs[0]), start(logs[1])
    finished = run / "steps" / "label" / "annotations"
    deadline = time.monotonic() + 240
    # Killed mid-step: a few units finished, and the first worker holding one (the
    # other may have started sooner and done those alone).
    while len(list(finished.glob("*.parquet"))) < 4 or not _held(logs[0]):
        assert first.poll() is None, logs[0].read_text()[-3000:]
        assert time.monotonic() < deadline, logs[0].read_text()[-3000:]
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    held = _held(logs[0])  # what it held as it died: the others take it over
    third = start(logs[2])
    assert second.wait(timeout=600) == 0, logs[1].read_text()[-3000:]
    assert third.wait(timeout=600) == 0, logs[2].read_text()[-3000:]
    wait_until_idle(vllm_servers)
    sent = finished_requests(vllm_servers) - before

    import pyarrow.dataset as ds

    def step(name: str) -> list[dict[str, Any]]:
        folder = run / "steps" / name / "annotations"
        return ds.dataset(folder, format="parquet").to_table().to_pylist()  # type: ignore[no-any-return]

    label, reason, judge = step("label"), step("reason"), step("judge")
    keys = {name: Counter((r["input_file"], r["id"]) for r in rows) for name, rows in
            (("label", label), ("reason", reason), ("judge", judge))}  # fmt: skip
    assert all(max(count.values(), default=1) == 1 for count in keys.values()), keys
    assert sorted(r["id"] for r in label) == sorted(r["id"] for r in reviews)
    negative = [r for r in label if r["sentiment"] == "negative" and r["error"] is None]
    assert len(reason) == len(negative)
    assert len(judge) == sum(1 for r in reason if r["error"] is None)
    rows = len(label) + len(reason) + len(judge)
    assert rows <= sent <= rows + 2 * 8 + 100, (sent, rows)  # 8 in flight per server
    record = orjson.loads((run / "pipeline.json").read_bytes())
    assert {name: s["state"] for name, s in record["steps"].items()} == dict.fromkeys(
        ("label", "reason", "judge"), "done"
    )
    said = "".join(log.read_text() for log in logs[1:])
    assert not held or "unit_taken_over" in said, held


def _held(log: Path) -> set[str]:
    """The units a worker holds, by its log: claimed, and not yet finished or let go."""
    held: set[str] = set()
    for line in log.read_bytes().splitlines():
        try:
            said = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line cut by the kill, or not a log line
        if not isinstance(said, dict) or "unit" not in said:
            continue
        if said.get("event") == "unit_claimed":
            held.add(str(said["unit"]))
        elif said.get("event") in ("unit_finished", "unit_skipped", "unit_lost", "unit_given_up"):
            held.discard(str(said["unit"]))
    return held
