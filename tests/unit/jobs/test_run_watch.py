"""The run timeline, the HTML report and the live metrics, against in-process fake servers.

The same behaviour is shown against real vLLM servers with a SIGKILL in
``tests/faults/test_run_report_vllm.py``.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_annotator import ConfigurationError, RunInterruptedError, VLLMQueueAnnotator
from llm_annotator.cli.main import main
from llm_annotator.jobs.annotate import Annotator
from llm_annotator.jobs.run_report import run_series, write_html_report
from llm_annotator.jobs.watch.status import run_status
from llm_annotator.jobs.watch.timeline import (
    SERVER_FIELDS,
    TIMELINE_FILE,
    RunRecord,
    read_timeline,
    tick_interval,
    ticks_within,
)
from tests.unit.conftest import FakeServer, completion
from tests.unit.helpers import FAST, rows

FakeServers = Callable[[int], list[FakeServer]]


def output_by_server(path: Path, keep: Callable[[int], bool] = lambda _: True) -> Counter[str]:
    table = pq.read_table(path, columns=["id", "server"]).to_pylist()
    return Counter(r["server"] for r in table if keep(r["id"]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the metrics endpoint, by name and labels, through Prometheus's
    own text parser."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def no_outside_resources(page: str) -> list[str]:
    """What in the page would reach outside the file (none may): scripts, style
    sheets, and any reference that is not to a place in the page itself (``#id``)."""
    found = re.findall(r"<script|<link|<iframe|<img|@import", page)
    references = re.findall(r"(?:href|src)\s*=\s*[\"']([^\"']*)", page)
    references += re.findall(r"url\(\s*[\"']?([^)\"']*)", page)
    return found + [ref for ref in references if not ref.startswith("#")]


# -- the size bound and the reader, pure ----------------------------------------------------


def test_a_week_long_run_writes_a_bounded_number_of_ticks() -> None:
    """Stepping the tick interval over a week gives what ticks_within says (within 1%),
    under 14,000 ticks; the first half hour is one tick a second."""
    t, count = 0.0, 0
    while t < 7 * 86400:
        t += tick_interval(t)
        count += 1
    assert abs(count - ticks_within(7 * 86400)) <= 0.01 * count
    assert count < 14_000
    assert tick_interval(0.0) == tick_interval(2047.0) == 1.0
    assert tick_interval(86400.0) == pytest.approx(42.19, abs=0.01)


def test_the_reader_skips_a_torn_last_line_and_foreign_lines(tmp_path: Path) -> None:
    """A crash in mid-write leaves half a line: the runs before it read whole."""
    lines = [
        {"e": "start", "wall": 10.0, "total": 4, "done_before": 0},
        {
            "e": "tick",
            "t": 0,
            "wall": 10.0,
            "done": 0,
            "rows": 0,
            "urls": ["u"],
            "servers": [["healthy", 0, 2]],
        },
        {
            "e": "member",
            "t": 0.5,
            "wall": 10.5,
            "server": "u",
            "from": "healthy",
            "to": "evicted",
            "reason": "gone",
        },
        {"e": "tick", "t": 1, "wall": 11.0, "done": 2, "rows": 2, "servers": [["evicted", 2, 0]]},
        {"not": "ours"},
        {"e": "tick", "t": 1.5, "done": 2, "rows": 2, "servers": [["evicted", 2, 0]]},  # no wall
        {"e": "tick", "t": 1.6, "wall": 11.6, "done": 2, "rows": 2, "servers": [["x", "y", 0]]},
        {"e": "member", "t": 1.7, "wall": 11.7, "to": "healthy"},  # no server
        {"e": "start", "wall": "later", "total": 4, "done_before": 0},  # not a number
    ]
    body = b"".join(orjson.dumps(line) + b"\n" for line in lines) + b'{"e": "tick", "t": 2, "wa'
    (tmp_path / TIMELINE_FILE).write_bytes(body)
    (run,) = read_timeline(tmp_path)
    assert [tick["done"] for tick in run.ticks] == [0, 2]
    assert run.ticks[1]["servers"] == {"u": {"state": "evicted", "rows": 2, "in_flight": 0}}
    assert [c["to"] for c in run.changes] == ["evicted"]
    assert run.ended is None  # killed: no end line
    page = write_html_report_of(tmp_path)
    assert page.count("<svg") >= 3


def write_html_report_of(directory: Path) -> str:
    """The report of a bare timeline (a run directory needs its job.json)."""
    (directory / "job.json").write_bytes(orjson.dumps({"fingerprint": {"model": "m"}}))
    return write_html_report(directory).read_text()


def test_a_resumed_run_after_a_torn_line_starts_its_own_run(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A crash in mid-line: the next run ends that line first, so its start is read."""
    out = tmp_path / "run"
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        Annotator(pool, progress=False).annotate(rows(10), "x {text}", out)
        with (out / TIMELINE_FILE).open("ab") as file:
            file.write(b'{"e": "tick", "t": 9, "wa')
        Annotator(pool, progress=False).annotate(rows(20), "x {text}", out, force=True)
    first, second = read_timeline(out)
    assert (first.ended, second.ended) == ("finished", "finished")
    assert (second.done_before, second.ticks[-1]["done"]) == (10, 20)


def test_the_report_leaves_matplotlib_as_it_found_it(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    import matplotlib

    out = tmp_path / "run"
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        Annotator(pool, progress=False).annotate(rows(10), "x {text}", out)
    before = (matplotlib.get_backend(), dict(matplotlib.rcParams))
    write_html_report(out)
    assert (matplotlib.get_backend(), dict(matplotlib.rcParams)) == before


def tick(wall: float, done: int, rows: int, servers: dict[str, int], errors: dict[str, int]) -> Any:
    return {
        "t": wall,
        "wall": wall,
        "done": done,
        "rows": rows,
        "errors": errors,
        "servers": {url: {"rows": n, "in_flight": 2} for url, n in servers.items()},
    }


def test_series_of_a_resumed_job_with_an_eviction() -> None:
    """Two runs: x counts from the first start; rates per server; error counts go on
    from the first run's; the eviction and re-admission are placed; the tail is from
    99% to 100% of the rows."""
    first = RunRecord(
        wall=100.0,
        total=200,
        done_before=0,
        ticks=[
            tick(100.0, 0, 0, {"a": 0, "b": 0}, {}),
            tick(102.0, 100, 100, {"a": 60, "b": 40}, {"read_timeout": 3}),
        ],
        changes=[
            {"wall": 101.0, "server": "b", "from": "healthy", "to": "evicted", "reason": "gone"},
            {"wall": 101.5, "server": "b", "from": "evicted", "to": "healthy"},
        ],
        ended=None,
    )
    second = RunRecord(
        wall=200.0,
        total=200,
        done_before=100,
        ticks=[
            tick(200.0, 100, 0, {"a": 0}, {}),
            tick(204.0, 200, 100, {"a": 100}, {"read_timeout": 1}),
        ],
        ended="finished",
    )
    series = run_series([first, second])
    assert series.rate == [(2.0, 50.0), (104.0, 25.0)]
    assert series.server_rate["a"] == [(2.0, 30.0), (104.0, 25.0)]
    assert series.server_rows == {"a": 160, "b": 40}
    assert series.errors["read_timeout"] == [(2.0, 3), (104.0, 4)]
    assert series.evictions == [(1.0, "b", "gone")]
    assert series.readmissions == [(1.5, "b")]
    assert series.runs == [(0.0, None), (100.0, "finished")]
    assert series.tail == (103.92, 104.0)
    # Little's law: 2 in flight over 2 s and 4 s, over a's 160 rows.
    assert series.seconds_per_row["a"] == pytest.approx(2 * 6 / 160)


# -- a whole job ----------------------------------------------------------------------------


def test_a_job_with_an_evicted_server_leaves_a_timeline_and_a_report(
    fake_servers: FakeServers, tmp_path: Path
) -> None:
    """A server that hangs mid-run is evicted: the timeline holds the change at its
    time with its reason, and ticks whose per-server rows add up to the output's; the
    report draws it, self-contained."""
    steady, failing = fake_servers(2)
    hang = threading.Event()

    async def slow(body: dict[str, Any]) -> Any:
        await asyncio.sleep(0.2)
        return completion(body["messages"][-1]["content"])

    async def then_hang(body: dict[str, Any]) -> Any:
        if hang.is_set():
            await asyncio.sleep(3600)
        await asyncio.sleep(0.1)
        return completion(body["messages"][-1]["content"])

    steady.handler, failing.handler = slow, then_hang
    hung_at: list[float] = []

    def fail_later() -> None:
        time.sleep(2.0)
        hang.set()
        failing.health_status = 503
        hung_at.append(time.time())

    threading.Thread(target=fail_later, daemon=True).start()
    out = tmp_path / "run"
    with VLLMQueueAnnotator([steady.base_url, failing.base_url], batch_size=16, **FAST) as pool:
        result = Annotator(pool, progress=False).annotate(rows(2500), "x {text}", out)
    assert result.num_succeeded == 2500

    (run,) = read_timeline(out)
    assert run.ended == "finished" and run.total == 2500
    evicted = [c for c in run.changes if c["to"] == "evicted"]
    assert [c["server"] for c in evicted] == [failing.base_url]
    assert "health check" in evicted[0]["reason"]
    assert hung_at[0] < evicted[0]["wall"] < hung_at[0] + 5.0
    last = run.ticks[-1]
    assert last["done"] == 2500
    assert {u: s["rows"] for u, s in last["servers"].items()} == output_by_server(
        result.output_path
    )
    assert last["servers"][failing.base_url]["state"] == "evicted"
    assert len(run.ticks) >= 4  # one a second, and the last

    page_path = write_html_report(out)
    assert page_path == out / "report.html"
    page = page_path.read_text()
    assert no_outside_resources(page) == []
    assert page.count("<svg") == 4
    assert f"<td>{failing.base_url}</td><td>healthy</td><td>evicted</td>" in page
    series = run_series([run])
    assert series.evictions[0][0] == pytest.approx(evicted[0]["wall"] - run.wall)
    # A tick follows each change, so the pool right after the eviction is drawn.
    assert any(evicted[0]["wall"] <= t["wall"] <= evicted[0]["wall"] + 3.0 for t in run.ticks)
    assert run_status(out).servers == {
        steady.base_url: {"state": "healthy", "evictions": 0},
        failing.base_url: {"state": "evicted", "evictions": 1},
    }


def test_metrics_are_served_while_the_job_runs_and_match_the_output(
    fake_servers: FakeServers, tmp_path: Path
) -> None:
    """Scraped during the run (the last 50 rows held back by the servers), the
    counters are those of the rows written so far: the same per server as the output
    gives for those rows; they never go down; the state gauges say healthy."""
    servers = fake_servers(2)
    release = threading.Event()

    async def hold_the_last(body: dict[str, Any]) -> Any:
        if int(body["messages"][-1]["content"].removeprefix("x t")) >= 250:
            for _ in range(1200):  # bounded: 60 s
                if release.is_set():
                    break
                await asyncio.sleep(0.05)
        return completion(body["messages"][-1]["content"])

    for server in servers:
        server.handler = hold_the_last
    port = free_port()
    out = tmp_path / "run"
    results: list[Any] = []

    def job() -> None:
        with VLLMQueueAnnotator([s.base_url for s in servers], batch_size=16, **FAST) as pool:
            annotator = Annotator(pool, progress=False, metrics_port=port)
            results.append(annotator.annotate(rows(300), "x {text}", out, handle_signals=False))

    runner = threading.Thread(target=job)
    runner.start()
    scrapes = []
    live = ""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                samples = scrape(port)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            scrapes.append(samples)
            if (
                samples.get(("llm_annotator_rows_processed_total", (("outcome", "answered"),)))
                == 250
            ):
                time.sleep(1.5)  # two more snapshots: nothing more may come
                scrapes.append(scrape(port))
                live = write_html_report(out, tmp_path / "live.html").read_text()
                break
            time.sleep(0.1)
    finally:
        release.set()
        runner.join(timeout=60)
    (result,) = results
    # The report of the run while it ran: drawn as far as it got.
    assert "state: running" in live and "<svg" in live
    assert "250 of 300 (83.3%)" in live
    held = scrapes[-1]
    assert held[("llm_annotator_rows_processed_total", (("outcome", "answered"),))] == 250
    assert held[("llm_annotator_rows_processed_total", (("outcome", "failed"),))] == 0
    assert held[("llm_annotator_rows", ())] == 300
    assert held[("llm_annotator_rows_done", ())] == 250
    by_server = {
        dict(labels)["server"]: value
        for (name, labels), value in held.items()
        if name == "llm_annotator_server_rows_total"
    }
    assert by_server == output_by_server(result.output_path, lambda i: i < 250)
    for server in servers:
        assert held[("llm_annotator_server_up", (("server", server.base_url),))] == 1
        key = ("llm_annotator_server_state", (("server", server.base_url), ("state", "healthy")))
        assert held[key] == 1
    assert held[("llm_annotator_in_flight_requests", ())] >= 50  # the held rows, some hedged
    answered = [
        s[("llm_annotator_rows_processed_total", (("outcome", "answered"),))] for s in scrapes
    ]
    assert answered == sorted(answered)
    with pytest.raises(httpx.TransportError):  # the endpoint closes with the job
        scrape(port)


def test_a_taken_metrics_port_is_refused_before_anything_is_written(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
            annotator = Annotator(pool, progress=False, metrics_port=port)
            with pytest.raises(ConfigurationError, match=f"cannot serve the metrics on .*:{port}"):
                annotator.annotate(rows(5), "x {text}", tmp_path / "run")
    assert not (tmp_path / "run").exists()
    assert fake_server.requests == []
    with pytest.raises(ConfigurationError, match="metrics_port must be a port number"):
        Annotator(pool, metrics_port=70000)


def test_without_a_timeline_the_report_has_the_tables_and_says_why(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        Annotator(pool, progress=False, timeline=False).annotate(rows(20), "x {text}", out)
    assert not (out / TIMELINE_FILE).exists()
    page = write_html_report(out, tmp_path / "elsewhere.html").read_text()
    assert "has no timeline.jsonl" in page
    assert f'<td>{fake_server.base_url}</td><td class="n">20</td>' in page
    assert "<svg" not in page


def test_the_report_command_writes_the_file_or_says_what_is_wrong(
    fake_server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path / "nothing")]) == 1
    assert "no such directory" in capsys.readouterr().err
    out = tmp_path / "run"
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        Annotator(pool, progress=False).annotate(rows(20), "x {text}", out)
    assert main(["report", str(out), "--output", str(tmp_path / "r.html")]) == 0
    assert capsys.readouterr().out.strip() == f"report: {tmp_path / 'r.html'}"
    assert "<svg" in (tmp_path / "r.html").read_text()
    assert (
        main(
            [
                "run",
                "--input",
                "a",
                "--output-dir",
                "o",
                "--prompt-template",
                "{t}",
                "--servers",
                "http://127.0.0.1:9/v1",
                "--metrics-host",
                "0.0.0.0",
            ]
        )
        == 1
    )
    assert "--metrics-host needs --metrics-port" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["run", "--metrics-port", "70000"])
    assert exited.value.code == 1
    assert "--metrics-port: expected an integer >= 0 and <= 65535" in capsys.readouterr().err


def test_an_interrupted_then_resumed_job_is_drawn_as_two_runs(
    fake_servers: FakeServers, tmp_path: Path
) -> None:
    """A run stopped part way (the report drawn while the directory is left that way)
    then resumed: two runs in the timeline, the first ``interrupted``; the rows of both
    add up per server to the output's."""
    servers = fake_servers(2)
    answered = 0

    async def slow(body: dict[str, Any]) -> Any:
        nonlocal answered
        await asyncio.sleep(0.01)
        answered += 1
        return completion(body["messages"][-1]["content"])

    for server in servers:
        server.handler = slow
    out = tmp_path / "run"

    async def first_run() -> None:
        stop = asyncio.Event()

        async def stop_at_200() -> None:
            for _ in range(3000):  # 30 s at most
                if answered >= 200:
                    break
                await asyncio.sleep(0.01)
            stop.set()

        stopper = asyncio.ensure_future(stop_at_200())
        pool = VLLMQueueAnnotator([s.base_url for s in servers], batch_size=16, **FAST)
        try:
            await pool.aannotate(rows(1000), "x {text}", out, progress=False, stop=stop)
        finally:
            stopper.cancel()
            await pool.aclose()

    with pytest.raises(RunInterruptedError):
        asyncio.run(first_run())
    (stopped,) = read_timeline(out)
    assert stopped.ended == "interrupted"
    page = write_html_report(out).read_text()
    assert "state: interrupted" in page and page.count("<svg") >= 3

    with VLLMQueueAnnotator([s.base_url for s in servers], batch_size=16, **FAST) as pool:
        result = pool.annotate(rows(1000), "x {text}", out, progress=False)
    first, second = read_timeline(out)
    assert (first.ended, second.ended) == ("interrupted", "finished")
    assert second.done_before == result.num_resumed == first.ticks[-1]["done"]
    series = run_series([first, second])
    assert series.server_rows == output_by_server(result.output_path)
    assert len(series.runs) == 2 and series.runs[1][0] > 0
    page = write_html_report(out).read_text()
    assert "2 run(s) in the timeline" in page


def test_a_cancelled_job_is_interrupted_in_status_and_timeline_alike(
    fake_servers: FakeServers, tmp_path: Path
) -> None:
    """One rule for how a run ended: a job whose task is cancelled (as an embedding
    application does) is ``interrupted`` in ``status.json`` and in the timeline, not
    ``failed`` in one and ``interrupted`` in the other."""
    servers = fake_servers(1)
    answered = 0

    async def slow(body: dict[str, Any]) -> Any:
        nonlocal answered
        await asyncio.sleep(0.01)
        answered += 1
        return completion(body["messages"][-1]["content"])

    servers[0].handler = slow
    out = tmp_path / "run"

    async def cancelled_run() -> None:
        pool = VLLMQueueAnnotator([servers[0].base_url], batch_size=8, **FAST)
        job = asyncio.ensure_future(pool.aannotate(rows(2000), "x {text}", out, progress=False))
        for _ in range(3000):  # 30 s at most
            if answered >= 50 or job.done():
                break
            await asyncio.sleep(0.01)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        await pool.aclose()

    asyncio.run(cancelled_run())
    assert answered >= 50
    (run,) = read_timeline(out)
    status = orjson.loads((out / "status.json").read_bytes())
    assert (run.ended, status["state"]) == ("interrupted", "interrupted")
    assert status.get("error") is None


def test_a_ticks_server_list_keeps_its_order_for_the_timelines_already_written() -> None:
    """Each server's list in a tick is positional: the counters derive from the pool's
    statistics, and a new one may only come last."""
    assert SERVER_FIELDS[:9] == (
        *("state", "rows", "in_flight", "completed", "errors", "evictions"),
        *("readmissions", "requeued", "hedged"),
    )
