"""One job over several annotator processes (``--shard``), against in-process fake
servers: each row once over all shards, a killed shard re-run alone, the merge."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from llm_annotator import ConfigurationError, JobError, VLLMQueueAnnotator
from llm_annotator.cli.main import main
from llm_annotator.jobs.annotate import Annotator
from llm_annotator.jobs.merge import merge, shard_states
from llm_annotator.jobs.shard import Shard
from tests.unit.conftest import FakeServer, completion

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))
FAST: dict[str, Any] = {"health_check_interval": 0.2, "health_check_timeout": 0.5}


def write_rows(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"text": f"t{i}"}) + b"\n" for i in range(n)))
    return path


def shard_command(servers: list[FakeServer], data: Path, out: Path, shard: str) -> list[str]:
    return [
        COMMAND, "run", "--servers", *[s.base_url for s in servers], "--input", str(data),
        "--prompt-template", "Label: {text}", "--output-dir", str(out), "--shard", shard,
        "--log-format", "json", "--no-hedge-tail",  # exact request counts
    ]  # fmt: skip


def sent_ids(servers: list[FakeServer]) -> Counter[int]:
    return Counter(
        int(r["messages"][-1]["content"].removeprefix("Label: t"))
        for s in servers
        for r in s.requests
    )


def output_ids(path: Path) -> list[Any]:
    return pq.read_table(path, columns=["id"]).column("id").to_pylist()  # type: ignore[no-any-return]


def slow_by(seconds: float) -> Any:
    async def answer(body: dict[str, Any]) -> Any:
        await asyncio.sleep(seconds)
        return completion(body["messages"][-1]["content"])

    return answer


def test_the_shards_split_the_ids_into_balanced_disjoint_parts() -> None:
    ids: list[int | str] = [*range(6000), *(f"row-{i}" for i in range(6000))]
    owners = [[i for i in range(4) if Shard(i, 4).owns(row_id)] for row_id in ids]
    assert all(len(owner) == 1 for owner in owners)
    sizes = Counter(owner[0] for owner in owners)
    assert all(abs(size - 3000) < 300 for size in sizes.values())


def test_auto_reads_the_schedulers_index_or_says_what_is_missing() -> None:
    slurm = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4"}
    assert Shard.parse("auto", slurm) == Shard(3, 4)
    rerun = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "1"}  # sbatch --array=3
    assert Shard.parse("auto/4", rerun) == Shard(3, 4)
    with pytest.raises(ConfigurationError, match="submit the array as --array=0-0"):
        Shard.parse("auto", rerun)
    assert Shard.parse("auto", {"JOB_COMPLETION_INDEX": "2", "LLM_ANNOTATOR_SHARD_COUNT": "5"}) == (
        Shard(2, 5)
    )
    with pytest.raises(ConfigurationError, match="give the count, as auto/COUNT"):
        Shard.parse("auto", {"JOB_COMPLETION_INDEX": "2"})
    with pytest.raises(ConfigurationError, match="neither SLURM_ARRAY_TASK_ID"):
        Shard.parse("auto", {})
    with pytest.raises(ConfigurationError, match="expected INDEX/COUNT"):
        Shard.parse("2")
    with pytest.raises(ConfigurationError, match="the count must be an integer"):
        Shard.parse("1/x")


def test_three_shard_processes_send_each_row_once_and_the_last_merges(
    fake_servers: Any, tmp_path: Path
) -> None:
    servers = fake_servers(2)
    for server in servers:
        server.handler = slow_by(0.002)
    data = write_rows(tmp_path / "data.jsonl", 900)
    out = tmp_path / "run"
    processes = [
        subprocess.Popen(
            shard_command(servers, data, out, f"{i}/3"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for i in range(3)
    ]
    results = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], results
    assert sum("all shards merged" in stdout for stdout, _ in results) == 1
    assert sorted(output_ids(out / "annotations.parquet")) == list(range(900))
    assert sent_ids(servers) == Counter(range(900))  # every row once, over all shards
    for index in range(3):
        shard = Shard(index, 3)
        ids = output_ids(out / shard.name / "annotations.parquet")
        assert ids and all(shard.owns(row_id) for row_id in ids)
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["rows"] == report["succeeded"] == 900
    assert [s["shard"] for s in report["shards"]] == [0, 1, 2]
    assert main(["report", str(out)]) == 0  # the shards, and each one's plots
    page = (out / "report.html").read_text()
    assert "A job in 3 shards; merged into annotations.parquet." in page
    for index in range(3):
        assert f"<h2>Shard {index} of 3</h2>" in page
        assert f"<td>shard-{index:04d}-of-0003</td>" in page
    assert page.count("<svg") >= 9


def test_a_killed_shard_re_run_alone_sends_only_its_rows_left(
    fake_servers: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    servers = fake_servers(2)
    for server in servers:
        server.handler = slow_by(0.1)
    data = write_rows(tmp_path / "data.jsonl", 600)
    out = tmp_path / "run"
    victim = Shard(1, 3)
    # 8 requests in flight at 0.1 s each: shard 1's 200-odd rows take about 3 s, so
    # the kill at 40 rows comes in the middle.
    slow = ["--batch-size", "4", "--max-concurrent-batches-per-client", "1"]
    killed = subprocess.Popen(
        [*shard_command(servers, data, out, "1/3"), *slow],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and written(out / victim.name) < 40:
            time.sleep(0.05)
        assert written(out / victim.name) >= 40
        assert killed.poll() is None, "shard 1 ended before the kill"
    finally:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
    for index in (0, 2):
        done = subprocess.run(
            shard_command(servers, data, out, f"{index}/3"),
            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        assert "all shards merged" not in done.stdout
    _, states = shard_states(out)
    assert [s.state for s in states] == ["finished", "stopped", "finished"]
    assert main(["status", str(out)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"{out}: a job in 3 shards, 2 complete; not merged yet")
    assert f"{out / victim.name}: stopped" in shown
    assert main(["merge", str(out)]) == 1
    err = capsys.readouterr().err
    assert "1 of its 3 shards are not complete" in err
    assert "shard 1 of 3: stopped with" in err and "--shard 1/3" in err
    assert not (out / "annotations.parquet").exists()

    before = written(out / victim.name)
    for server in servers:
        server.requests.clear()
    again = subprocess.run(
        shard_command(servers, data, out, "1/3"),
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert "all shards merged" in again.stdout
    resent = sent_ids(servers)
    assert all(victim.owns(row_id) for row_id in resent)  # only its rows
    assert sum(resent.values()) == sum(victim.owns(i) for i in range(600)) - before
    assert sorted(output_ids(out / "annotations.parquet")) == list(range(600))


def written(folder: Path) -> int:
    """Complete lines in a shard's result files (a killed writer may leave half a one)."""
    total = 0
    for path in (folder / "shards").glob("*.jsonl") if folder.is_dir() else ():
        total += path.read_bytes().count(b"\n")
    return total


def test_another_count_or_no_shard_in_a_sharded_directory_is_refused(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    rows = [{"text": f"t{i}"} for i in range(30)]
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        annotator = Annotator(pool, progress=False)
        first = annotator.annotate(rows, "x {text}", out, shard=(0, 2))
        assert first.merged_path is None
        sent = len(fake_server.requests)
        with pytest.raises(ConfigurationError, match="split into 2 shards, not 3"):
            annotator.annotate(rows, "x {text}", out, shard=(0, 3))
        with pytest.raises(ConfigurationError, match="split into 2 shards: run each with"):
            annotator.annotate(rows, "x {text}", out)
        with pytest.raises(ConfigurationError, match="other settings"):
            annotator.annotate(rows, "y {text}", out, shard="1/2")
        with pytest.raises(ConfigurationError, match=r"trial run \(limit\) is not sharded"):
            annotator.annotate(rows, "x {text}", out, shard=(1, 2), limit=5)
        assert len(fake_server.requests) == sent  # nothing sent by a refused run
        with pytest.raises(JobError, match="shard 1 of 2: not started"):
            merge(out)
        last = annotator.annotate(rows, "x {text}", out, shard=(1, 2))
        assert last.merged_path == out / "annotations.parquet"
        assert sorted(output_ids(last.merged_path)) == list(range(30))
        annotator.annotate(rows, "x {text}", tmp_path / "plain")  # not sharded, then:
        with pytest.raises(ConfigurationError, match="not sharded; run without --shard"):
            annotator.annotate(rows, "x {text}", tmp_path / "plain", shard=(0, 2))
