"""Annotation jobs against real vLLM servers, driven through the installed command.

The annotating process is a subprocess (``llm-annotator run``) so it can be SIGKILLed
and SIGTERMed for real. The servers' own Prometheus counters
(``vllm:request_success_total``) tell how many requests each run really sent.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
import pytest

from llm_annotator import VLLMOnlineRuntimeOptions, VLLMQueueAnnotator
from llm_annotator.local import LocalServers

pytestmark = pytest.mark.integration

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))
TEMPLATE = "Classify the sentiment of this review: {text}"
# No --seed: vLLM 0.32's CPU build kills its engine ("CPU Generator does not use
# offset") when a seeded request's prefill is split over steps, as it is under load.
OPTIONS = ["--max-completion-tokens", "4", "--temperature", "1.0"]


def write_rows(path: Path, n: int, *, long_every: int = 0) -> Path:
    """n reviews; with ``long_every``, every such row is far over the context length."""
    with path.open("wb") as file:
        for i in range(n):
            text = f"review {i}: the product was fine"
            if long_every and i % long_every == 0:
                text = " ".join(["word"] * 2000)
            file.write(orjson.dumps({"text": text}) + b"\n")
    return path


def metric(servers: LocalServers, name: str) -> float:
    """The sum of a Prometheus metric over every server (all label sets)."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)$")
    for url in servers.base_urls:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
        for line in text.splitlines():
            match = pattern.match(line)
            if match:
                total += float(match.group(2))
    return total


def finished_requests(servers: LocalServers) -> float:
    return metric(servers, "vllm:request_success_total")


def wait_until_idle(servers: LocalServers, timeout: float = 60.0) -> None:
    """Until no server runs or queues a request (aborted ones included)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = metric(servers, "vllm:num_requests_running") + metric(
            servers, "vllm:num_requests_waiting"
        )
        if busy == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"servers still busy after {timeout} s")


def written_ids(output_dir: Path) -> list[Any]:
    """Ids of the complete records in the run's shards: only a shard's last line may be
    cut (a process killed mid-write); a corrupt line elsewhere fails the test."""
    ids = []
    for shard in sorted((output_dir / "shards").glob("*.jsonl")):
        lines = shard.read_bytes().split(b"\n")
        for number, line in enumerate(lines, 1):
            if not line:
                continue
            try:
                ids.append(orjson.loads(line)["id"])
            except orjson.JSONDecodeError:
                assert number == len(lines), f"{shard.name} line {number} is corrupt"
    return ids


def run_args(servers: LocalServers, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        COMMAND,
        "run",
        "--servers",
        *servers.base_urls,
        "--input",
        str(data),
        "--prompt-template",
        TEMPLATE,
        "--output-dir",
        str(out),
        "--log-format",
        "json",
        # Exact request counts: no duplicate requests for the tail.
        "--no-hedge-tail",
        *OPTIONS,
        *extra,
    ]


def start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as sink:
        return subprocess.Popen(args, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL)


def wait_for_rows(process: subprocess.Popen[bytes], out: Path, rows: int, log: Path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the run ended early:\n{log.read_text()[-3000:]}")
        if len(written_ids(out)) >= rows:
            return
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"fewer than {rows} rows after 240 s:\n{log.read_text()[-3000:]}")


def finish(args: list[str], log: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    log.write_text(done.stdout + done.stderr)
    return done


@pytest.fixture
def idle(vllm_servers: LocalServers) -> LocalServers:
    wait_until_idle(vllm_servers)
    return vllm_servers


def test_sigkilled_run_resumes_without_sending_done_rows_again(
    idle: LocalServers, tmp_path: Path
) -> None:
    """SIGKILL the annotating process half way; the second run sends exactly the rows
    not yet written (the servers' counters say so) and the output has every id once."""
    n = 6000
    data = write_rows(tmp_path / "data.jsonl", n)
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    process = start(run_args(idle, data, out), log)
    wait_for_rows(process, out, n // 2, log)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    wait_until_idle(idle)
    done_before = written_ids(out)
    assert len(done_before) == len(set(done_before))
    assert n // 2 <= len(done_before) < n
    before = finished_requests(idle)

    second = finish(run_args(idle, data, out), log)
    assert second.returncode == 0, second.stderr[-3000:]
    wait_until_idle(idle)
    sent = finished_requests(idle) - before
    assert sent == n - len(done_before)
    report = orjson.loads((out / "report.json").read_bytes())
    table = pq.read_table(out / "annotations.parquet").to_pylist()
    assert [row["id"] for row in table] == list(range(n))
    assert all(row["error"] is None for row in table), [r for r in table if r["error"]][:2]
    assert report["this_run"]["resumed_rows"] == len(done_before)
    assert report["this_run"]["sent_rows"] == n - len(done_before)


def test_sigterm_stops_within_the_grace_with_everything_completed_written(
    idle: LocalServers, tmp_path: Path
) -> None:
    """SIGTERM mid-run: the process exits 128+15 within the grace (10 s) plus start-up
    slack, every request the servers finished is written, and the message says how to
    resume."""
    n = 6000
    data = write_rows(tmp_path / "data.jsonl", n)
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    before = finished_requests(idle)
    process = start(run_args(idle, data, out, "--stop-grace", "10"), log)
    wait_for_rows(process, out, 500, log)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(timeout=60)
    took = time.monotonic() - signalled
    assert code == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert took < 10 + 5, took
    wait_until_idle(idle)
    written = written_ids(out)
    assert len(written) == len(set(written)) < n
    assert finished_requests(idle) - before == len(written)
    text = log.read_text()
    assert "SIGTERM" in text and "resume" in text
    assert f"{len(written)} of {n} rows are written" in text


def test_changed_template_is_refused_and_retry_errors_resends_only_errors(
    idle: LocalServers, tmp_path: Path
) -> None:
    """Prompts over the context length end as error rows; a changed template is
    refused naming the change; --retry-errors sends the error rows and nothing else."""
    n = 300
    data = write_rows(tmp_path / "data.jsonl", n, long_every=25)
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    first = finish(run_args(idle, data, out), log)
    assert first.returncode == 0, first.stderr[-3000:]
    table = pq.read_table(out / "annotations.parquet").to_pylist()
    errors = [row["id"] for row in table if row["error"]]
    assert errors == list(range(0, n, 25))
    assert {table[i]["error_type"] for i in errors} == {"bad_request"}

    changed = run_args(idle, data, out)
    changed[changed.index("--prompt-template") + 1] = "Label: {text}"
    refused = finish(changed, log)
    assert refused.returncode == 1
    assert "prompt_template" in refused.stderr and "--force" in refused.stderr

    wait_until_idle(idle)
    before = finished_requests(idle)
    retried = finish(run_args(idle, data, out, "--retry-errors"), log)
    assert retried.returncode == 0, retried.stderr[-3000:]
    wait_until_idle(idle)
    assert finished_requests(idle) - before == 0  # no row that had an answer was sent
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["this_run"]["sent_rows"] == len(errors)
    assert report["failed"] == len(errors)  # still too long, still error rows


def test_cli_runs_the_same_job_as_the_python_api(idle: LocalServers, tmp_path: Path) -> None:
    """The installed command and pool.annotate give the same rows for the same job
    (greedy decoding, so the answers match too)."""
    n = 200
    data = write_rows(tmp_path / "data.jsonl", n)
    args = run_args(idle, data, tmp_path / "cli", "--jsonl")
    args[args.index("--temperature") + 1] = "0"
    cli = finish(args, tmp_path / "cli.log")
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "annotations:" in cli.stdout
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=4, temperature=0.0)
    with VLLMQueueAnnotator(idle.base_urls) as pool:
        api = pool.annotate(data, TEMPLATE, tmp_path / "api", options=options, progress=False)
    columns = ["id", "text", "response", "finish_reason", "num_prompt_tokens", "error"]
    from_cli = pq.read_table(tmp_path / "cli" / "annotations.parquet").select(columns)
    from_api = pq.read_table(api.output_path).select(columns)
    assert from_cli.to_pylist() == from_api.to_pylist()
    assert (tmp_path / "cli" / "annotations.jsonl").is_file()


def test_environment_has_the_command() -> None:
    """The test command installs the package, so the console script exists."""
    assert os.access(COMMAND, os.X_OK), COMMAND
