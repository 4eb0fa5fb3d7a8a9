"""Progress: a bar on a terminal, log lines elsewhere, rates from this process only."""

from __future__ import annotations

import io

import structlog

from llm_annotator.jobs.watch.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bar_redraws_one_line_with_rates_servers_and_eta() -> None:
    """On a terminal the bar redraws in place at most every bar_interval, with rows,
    rows/s, output tokens/s, healthy servers and the ETA; close ends the line."""
    clock, stream = Clock(), io.StringIO()
    progress = Progress(
        1000, 200, healthy=lambda: 3, stream=stream, bar=True, bar_interval=0.5, clock=clock
    )
    clock.now += 0.2
    progress.add(rows=10, output_tokens=50)
    assert stream.getvalue() == ""  # not yet time
    clock.now += 9.8  # 10 s in: 100 rows in this process
    progress.add(rows=90, failed=2, output_tokens=450)
    line = stream.getvalue()
    assert line.startswith("\r300/1000 rows (30.0%)")
    assert "10.0 rows/s" in line and "50 out tok/s" in line
    assert "3 servers" in line and "2 failed" in line
    assert "ETA 1m10s" in line  # 700 rows left at 10 rows/s
    progress.close()
    assert stream.getvalue().endswith("\n")


def test_without_a_terminal_it_logs_progress_events() -> None:
    """Off a terminal, a progress event is logged every log_interval seconds."""
    clock = Clock()
    progress = Progress(
        50, 0, healthy=lambda: 1, stream=io.StringIO(), bar=False, log_interval=10, clock=clock
    )
    with structlog.testing.capture_logs() as logs:
        for _ in range(25):
            clock.now += 1.0
            progress.add()
    events = [log for log in logs if log["event"] == "progress"]
    assert [e["done"] for e in events] == [10, 20]
    assert events[-1]["total"] == 50 and events[-1]["healthy_servers"] == 1
