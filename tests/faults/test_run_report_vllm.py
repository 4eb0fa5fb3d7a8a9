"""Watching a real run: live metrics scraped during a job over real vLLM servers, one
of them SIGKILLed mid-run, then its HTML report, opened in a real headless Chromium.

The job is ``llm-annotator run --metrics-port`` in a subprocess; the test scrapes the
port with Prometheus's own text parser, kills a server once a third of the rows is
done, and checks the counters, the timeline and the report against the output. The
screenshot is kept (``test-artifacts/report-vllm.png``, or under
``$LLM_ANNOTATOR_ARTIFACTS``) to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from llm_annotator.jobs.watch.timeline import read_timeline
from llm_annotator.local import LocalServers, pick_free_ports

pytestmark = [pytest.mark.integration, pytest.mark.faults]

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))
ROOT = Path(__file__).resolve().parents[2]
N = 6000
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--enable-logging=stderr",
    "--v=0",
]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def answered(samples: Samples) -> float:
    return samples.get(("llm_annotator_rows_processed_total", (("outcome", "answered"),)), 0.0)


def per_server(samples: Samples, name: str) -> dict[str, float]:
    return {dict(labels)["server"]: v for (n, labels), v in samples.items() if n == name}


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("LLM_ANNOTATOR_REQUIRE_VLLM"):
            pytest.fail("chromium is missing: the test command installs it (Debian: chromium)")
        pytest.skip("chromium is not installed")
    return found


def artifacts() -> Path:
    where = Path(os.environ.get("LLM_ANNOTATOR_ARTIFACTS", ROOT / "test-artifacts"))
    where.mkdir(parents=True, exist_ok=True)
    return where


def test_a_killed_server_shows_in_the_live_metrics_the_timeline_and_the_report(
    vllm_servers: LocalServers, start_vllm: Any, tmp_path: Path
) -> None:
    victim = start_vllm(1)
    urls = [*vllm_servers.base_urls, victim.base_urls[0]]
    data = tmp_path / "reviews.jsonl"
    data.write_bytes(
        b"".join(orjson.dumps({"text": f"review {i}: it was fine"}) + b"\n" for i in range(N))
    )
    out = tmp_path / "run"
    (port,) = pick_free_ports(1)
    log = tmp_path / "run.log"
    args = [
        COMMAND, "run", "--servers", *urls, "--input", str(data),
        "--prompt-template", "Classify: {text}", "--output-dir", str(out),
        "--max-completion-tokens", "4", "--temperature", "1.0", "--batch-size", "32",
        "--log-format", "json", "--metrics-port", str(port),
    ]  # fmt: skip
    with log.open("wb") as sink:
        job = subprocess.Popen(args, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL)
    scrapes: list[tuple[float, Samples]] = []
    killed_at: float | None = None
    deadline = time.monotonic() + 400
    try:
        while job.poll() is None and time.monotonic() < deadline:
            try:
                samples = scrape(port)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            scrapes.append((time.time(), samples))
            if killed_at is None and answered(samples) >= N // 3:
                # Taken before the kill: kill() returns only once the process is reaped,
                # which on a loaded machine can be after the pool has already evicted it.
                killed_at = time.time()
                victim[0].kill()
            time.sleep(0.25)
    finally:
        if job.poll() is None:
            job.kill()
        job.wait(timeout=30)
    assert job.returncode == 0, log.read_text()[-3000:]
    assert killed_at is not None, "the job ended before a third of its rows"

    table = pq.read_table(out / "annotations.parquet", columns=["id", "server", "error"])
    records = table.to_pylist()
    assert sorted(r["id"] for r in records) == list(range(N))
    assert all(r["error"] is None for r in records)
    output = Counter(r["server"] for r in records)
    victim_url = victim.base_urls[0]

    # The live metrics: counters that never go down, per-server rows that add up to
    # the rows written, nothing above the output; the killed server shown as down.
    assert len(scrapes) >= 5
    seen = [answered(s) for _, s in scrapes]
    assert seen == sorted(seen) and 0 < seen[-1] <= N
    for _, samples in scrapes:
        rows = per_server(samples, "llm_annotator_server_rows_total")
        assert sum(rows.values()) == answered(samples)
        assert all(rows[url] <= output[url] for url in rows)

    # The timeline: the eviction at its time, per-server totals equal to the output's.
    (run,) = read_timeline(out)
    assert run.ended == "finished"
    evictions = [c for c in run.changes if c["to"] == "evicted"]
    assert [c["server"] for c in evictions] == [victim_url]
    assert killed_at - 1 < evictions[0]["wall"] < killed_at + 10
    final = run.ticks[-1]["servers"]
    assert {url: s["rows"] for url, s in final.items()} == dict(output)
    # ... and the live metrics said so, soon (a snapshot a second, on a busy loop).
    told = [
        (at, s)
        for at, s in scrapes
        if per_server(s, "llm_annotator_server_evictions_total").get(victim_url) == 1
    ]
    assert told, "no scrape showed the eviction"
    assert told[0][0] < evictions[0]["wall"] + 10
    assert all(per_server(s, "llm_annotator_server_up")[victim_url] == 0 for _, s in told)
    before = [s for at, s in scrapes if at < killed_at and answered(s) > 0]  # all joined
    assert all(per_server(s, "llm_annotator_server_up")[victim_url] == 1 for s in before)
    print(
        f"\n{len(scrapes)} scrapes; killed at {killed_at - run.wall:.1f} s, evicted at "
        f"{evictions[0]['wall'] - run.wall:.1f} s, finished at {run.ticks[-1]['t']:.1f} s"
    )

    # The report: written by the command, the same figures, and a page Chromium
    # renders without an error.
    made = subprocess.run(
        [COMMAND, "report", str(out)], capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr
    page = (out / "report.html").read_text()
    for url, count in output.items():
        assert f'<td>{url}</td><td class="n">{count}</td><td class="n">{count}</td>' in page
    moment = f"{evictions[0]['wall'] - run.wall:.1f}"
    assert f"<td>{moment}</td><td>{victim_url}</td><td>healthy</td><td>evicted</td>" in page
    assert "<script" not in page

    shot = artifacts() / "report-vllm.png"
    shot.unlink(missing_ok=True)
    rendered = subprocess.run(
        [
            chromium(),
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--window-size=1200,2600",
            f"--screenshot={shot}",
            (out / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    problems = re.findall(
        r".*(?:Uncaught|CONSOLE\(\d+\).*[Ee]rror|Failed to load).*", rendered.stderr
    )
    assert problems == []
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2600)
    colours = image.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50  # plots and tables, not a blank or an error page
    print(f"\nreport screenshot: {shot}")
