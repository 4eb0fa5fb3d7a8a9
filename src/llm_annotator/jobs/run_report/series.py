"""What the report shows, as numbers: a run's timeline and status read into series and
table rows, without matplotlib or HTML, so they are tested on their own."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from llm_annotator.jobs.watch.status import RunStatus
from llm_annotator.jobs.watch.timeline import RunRecord

MAX_POINTS = 400
"""Points per line at most (a long run's ticks are averaged down to this many)."""


@dataclass
class RunSeries:
    """What the plots draw, computed from a timeline (x: seconds since the job's first
    start, over all its runs).

    Attributes:
        rate: ``(x, answers/s)`` over all servers (rows written a second, for a client
            that is not a pool).
        server_rate: Per server URL, its ``(x, answers/s)``: what the pool received from
            it (answers and error rows; a regeneration and a hedged copy count too).
        written: ``(x, rows/s)`` written to the run directory (behind the answers while
            the job syncs its file; never ahead).
        done: ``(x, rows done)``, resumed rows included.
        errors: Per error type, ``(x, error rows so far)``.
        evictions: ``(x, server, reason)`` of each eviction (and of a start while down).
        readmissions: ``(x, server)`` of each re-admission.
        runs: ``(x, ended)`` of each run's start (a resumed job has several).
        total: Rows the job takes.
        server_rows: Rows each server answered, over all runs.
        seconds_per_row: Per server, the mean time a request spent in flight there (from
            requests in flight and rows answered, by Little's law), or None.
        tail: ``(x at 99% of the rows, x at the last row)``, or None if not reached.
        end: The last x.
    """

    rate: list[tuple[float, float]] = field(default_factory=list)
    server_rate: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    written: list[tuple[float, float]] = field(default_factory=list)
    done: list[tuple[float, int]] = field(default_factory=list)
    errors: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    evictions: list[tuple[float, str, str | None]] = field(default_factory=list)
    readmissions: list[tuple[float, str]] = field(default_factory=list)
    runs: list[tuple[float, str | None]] = field(default_factory=list)
    total: int = 0
    server_rows: dict[str, int] = field(default_factory=dict)
    seconds_per_row: dict[str, float | None] = field(default_factory=dict)
    tail: tuple[float, float] | None = None
    end: float = 0.0


def run_series(runs: Sequence[RunRecord], max_points: int = MAX_POINTS) -> RunSeries:
    """The series of a job's runs (see :class:`RunSeries`).

    Examples:
        >>> from llm_annotator.jobs.watch.timeline import RunRecord
        >>> tick = lambda t, rows: {"t": t, "wall": 100.0 + t, "done": rows, "rows": rows,
        ...     "errors": {}, "servers": {"http://a/v1": {"rows": rows, "in_flight": 4}}}
        >>> run = RunRecord(wall=100.0, total=40, done_before=0,
        ...     ticks=[tick(0.0, 0), tick(1.0, 10), tick(2.0, 30), tick(3.0, 40)])
        >>> series = run_series([run])
        >>> series.rate
        [(1.0, 10.0), (2.0, 20.0), (3.0, 10.0)]
        >>> series.server_rows, series.tail
        ({'http://a/v1': 40}, (2.96, 3.0))
    """
    series = RunSeries()
    if not runs:
        return series
    origin = runs[0].wall
    series.total = runs[-1].total
    busy: dict[str, float] = {}
    answers: dict[str, int] = {}
    errors_before: dict[str, int] = {}
    for run in runs:
        series.runs.append((run.wall - origin, run.ended))
        ticks = _thin(run.ticks, max(2, max_points // len(runs)))
        last: dict[str, Any] | None = None
        for tick in ticks:
            x = float(tick["wall"]) - origin
            series.done.append((x, int(tick["done"])))
            for kind, count in (tick.get("errors") or {}).items():
                series.errors.setdefault(kind, []).append((x, errors_before.get(kind, 0) + count))
            if last is not None:
                dt = float(tick["wall"]) - float(last["wall"])
                if dt > 0:
                    written = (int(tick["rows"]) - int(last["rows"])) / dt
                    series.written.append((x, written))
                    overall = 0.0
                    for url, now in tick["servers"].items():
                        before = last["servers"].get(url, {})
                        got = max(0, _answers(now) - _answers(before))
                        answers[url] = answers.get(url, 0) + got
                        overall += got / dt
                        series.server_rate.setdefault(url, []).append((x, got / dt))
                        held = (now.get("in_flight", 0) + before.get("in_flight", 0)) / 2
                        busy[url] = busy.get(url, 0.0) + held * dt
                    series.rate.append((x, overall if tick["servers"] else written))
            last = tick
            series.end = max(series.end, x)
        if last is not None:
            for url, now in last["servers"].items():
                series.server_rows[url] = series.server_rows.get(url, 0) + int(now.get("rows", 0))
            for kind, count in (last.get("errors") or {}).items():
                errors_before[kind] = errors_before.get(kind, 0) + int(count)
        for change in run.changes:
            x = float(change["wall"]) - origin
            if change.get("to") == "evicted":
                series.evictions.append((x, str(change["server"]), change.get("reason")))
            elif change.get("to") == "healthy" and change.get("from") == "evicted":
                series.readmissions.append((x, str(change["server"])))
            series.end = max(series.end, x)
    for url in series.server_rows:
        got = answers.get(url, 0)
        series.seconds_per_row[url] = busy.get(url, 0.0) / got if got else None
    series.tail = _tail(series.done, series.total)
    return series


def _answers(server: dict[str, Any]) -> int:
    """What the pool received from a server so far (its rows, in a line without the
    pool's counters)."""
    if "completed" not in server:
        return int(server.get("rows", 0))
    return int(server["completed"]) + int(server.get("errors", 0))


def _thin(ticks: list[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """At most ``most`` ticks, evenly spread, the first and last kept (the counters are
    cumulative, so rates between the kept ones are averages of those between)."""
    if len(ticks) <= most:
        return ticks
    step = (len(ticks) - 1) / (most - 1)
    return [ticks[round(i * step)] for i in range(most)]


def _tail(done: list[tuple[float, int]], total: int) -> tuple[float, float] | None:
    """When 99% of the rows were done and when the last was (interpolated), or None."""
    if not done or total <= 0 or done[-1][1] < total:
        return None
    mark = 0.99 * total
    start = end = None
    for (x0, d0), (x1, d1) in itertools.pairwise(done):
        if start is None and d1 >= mark:
            start = x0 + (x1 - x0) * ((mark - d0) / (d1 - d0)) if d1 > d0 and d0 < mark else x1
        if end is None and d1 >= total:
            end = x1
    if start is None or end is None:
        return None
    return round(start, 3), round(end, 3)


# -- the tables ------------------------------------------------------------------------------


def state_line(status: RunStatus, runs: Sequence[RunRecord]) -> str:
    """The line above a run's tables: its state, its model, its first start, its runs."""
    started = (
        datetime.fromtimestamp(runs[0].wall, UTC).isoformat(timespec="seconds") if runs else "-"
    )
    return (
        f"state: {status.state}; model: {status.model or '-'}; first started {started}; "
        f"{len(runs)} run(s) in the timeline"
    )


def summary_rows(
    status: RunStatus, summary: dict[str, Any], series: RunSeries
) -> list[tuple[str, Any]]:
    """The summary table's rows: rows done, answered, error rows by type, the last
    run's figures from ``report.json`` (``summary``), the tail, evictions."""
    total = status.total or series.total or None
    done = status.done
    if done is None:  # a directory of mixed inputs whose job has not counted its own
        shown = "not known yet"
    else:
        shown = f"{done}" + (f" of {total} ({done / total:.1%})" if total else "")
    every = " (every input)" if status.mixed_inputs else ""
    rows: list[tuple[str, Any]] = [
        ("rows done" + (" of this input" if status.mixed_inputs else ""), shown),
        ("answered" + every, status.succeeded),
        ("error rows" + every, status.failed),
    ]
    for kind, count in status.by_error_type.items():
        rows.append((f"  {kind}", count))
    this_run = summary.get("this_run")
    if not isinstance(this_run, dict):
        this_run = {}
    for key, label in (
        ("wall_seconds", "wall seconds (last run)"),
        ("rows_per_second", "rows / s (last run)"),
        ("output_tokens_per_second", "output tokens / s (last run)"),
        ("hedged_requests", "hedged requests (last run)"),
    ):
        if key in this_run:
            rows.append((label, this_run[key]))
    if series.tail is not None:
        start, end = series.tail
        rows.append(("the tail: 99% to 100% of the rows", f"{end - start:.1f} s"))
    rows.append(("evictions", len(series.evictions)))
    rows.append(("re-admissions", len(series.readmissions)))
    return rows


def server_rows(
    status: RunStatus, series: RunSeries, runs: Sequence[RunRecord], summary: Any = None
) -> list[tuple[Any, ...]]:
    """One row a server; its prefix-cache hit rate from ``report.json`` (``summary``),
    where its ``/metrics`` said it."""
    reported = summary.get("per_server") if isinstance(summary, dict) else None
    reported = reported if isinstance(reported, dict) else {}
    last: dict[str, dict[str, Any]] = {}
    counts: dict[str, dict[str, int]] = {}
    for run in runs:
        if run.ticks:
            for url, values in run.ticks[-1]["servers"].items():
                last[url] = values
                total = counts.setdefault(url, {})
                for key in ("evictions", "readmissions", "requeued", "hedged"):
                    total[key] = total.get(key, 0) + int(values.get(key, 0))
    urls = list(dict.fromkeys([*last, *status.per_server]))
    rows = []
    for url in urls:
        per_row = series.seconds_per_row.get(url)
        total = counts.get(url, {})
        rows.append(
            (
                url,
                status.per_server.get(url, 0),
                series.server_rows.get(url, 0) if url in last else "-",
                f"{per_row:.2f}" if per_row is not None else "-",
                total.get("evictions", "-"),
                total.get("readmissions", "-"),
                total.get("requeued", "-"),
                total.get("hedged", "-"),
                _hit_rate(reported.get(url)),
                last.get(url, {}).get("state", "-"),
            )
        )
    return rows


def _hit_rate(server: Any) -> str:
    """A server's prefix-cache hit rate as a percentage, or ``-``."""
    rate = server.get("prefix_cache_hit_rate") if isinstance(server, dict) else None
    if isinstance(rate, int | float) and not isinstance(rate, bool):
        return f"{100 * rate:.1f}%"
    return "-"


def change_rows(runs: Sequence[RunRecord]) -> list[tuple[Any, ...]]:
    """One row a change of a server's state: seconds since the job's first start, the
    server, its state before and after, the reason."""
    origin = runs[0].wall
    rows = []
    for run in runs:
        for change in run.changes:
            rows.append(
                (
                    f"{float(change['wall']) - origin:.1f}",
                    change.get("server"),
                    change.get("from"),
                    change.get("to"),
                    change.get("reason") or "",
                )
            )
    return rows
