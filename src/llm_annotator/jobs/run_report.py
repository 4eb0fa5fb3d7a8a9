"""``report.html``: a run drawn from its timeline, one self-contained file to look at.

:func:`write_html_report` reads a run directory (its ``timeline.jsonl``, the shards and
``report.json``) and writes one HTML file with inline SVG plots and tables, and no
script, style sheet, font or image from anywhere else: it opens offline, from a mail or
a shared folder. It works for a run that finished, one that was interrupted or killed,
and one still running (drawn as far as it got).

What it shows: throughput over time (answers a second, overall and per server, and the
rows written), with evictions and re-admissions marked; the time a request spends in
flight on each server; error rows by type over time; the progress and its tail (the
time from 99% of the rows to the last); a summary table of the run and one row per
server; every change of a server's state. For a sharded job (``--shard``), a table of
its shards, then each shard's sections.

Everything it reads is checked (:mod:`llm_annotator.jobs.files`, the readers of each
file): a link, a FIFO or a file of the wrong shape in the run directory is one
:class:`~llm_annotator.errors.RunDirectoryError` naming it, and ``report.html`` is
written under a fresh temporary name, never through an entry planted there.

The plots need matplotlib (``pip install 'llm-annotator[report]'``); the series are
computed here without it (:func:`run_series`), so they are tested on their own.
"""

from __future__ import annotations

import html
import io
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llm_annotator.errors import ConfigurationError, JobError
from llm_annotator.jobs.files import atomic_write, check_entry
from llm_annotator.jobs.loop.summary import REPORT_NAME, read_report
from llm_annotator.jobs.rundir.consolidate import PARQUET_FILE
from llm_annotator.jobs.rundir.partitions import CORPUS_FILE
from llm_annotator.jobs.rundir.store import JOB_FILE
from llm_annotator.jobs.shards.merge import LISTED_SHARDS, is_merged, shard_states
from llm_annotator.jobs.shards.shard import read_sharding
from llm_annotator.jobs.watch.status import RunStatus, corpus_status, run_status
from llm_annotator.jobs.watch.timeline import TIMELINE_FILE, RunRecord, read_timeline

HTML_REPORT_NAME = "report.html"
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


# -- the file --------------------------------------------------------------------------------


def write_html_report(
    run_dir: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> Path:
    """Write the run's HTML report; returns its path (``RUN_DIR/report.html`` by default).

    ``output`` is the user's own path: a link there is followed (the file at its end
    replaced whole). ``RUN_DIR/report.html`` is the run directory's: an entry planted
    there that is not a regular file is refused.

    Raises:
        JobError: The directory holds no job.
        RunDirectoryError: A file of the run directory is a link, not a regular file, or
            not of the shape the job writes (the message names it).
        ConfigurationError: matplotlib is not installed (the ``report`` extra).
    """
    directory = Path(run_dir)
    path = directory / HTML_REPORT_NAME if output is None else Path(output).resolve()
    check_entry(path)  # before the work: refused now rather than after drawing it
    corpus = corpus_status(directory) if directory.is_dir() else None
    if corpus is not None:
        body = _corpus_parts(directory, corpus)
    elif check_entry(directory.parent / CORPUS_FILE):
        raise JobError(
            f"{directory} is one process of the corpus job in {directory.parent}: draw "
            f"the job, llm-annotator report {directory.parent}"
        )
    elif read_sharding(directory) is None:
        body = _run_parts(directory, "h2")  # raises JobError for a directory without a job
    else:
        body = _sharded_parts(directory)
    page = _page(directory, body)
    with atomic_write(path, durable=False) as file:
        file.write(page.encode("utf-8"))
    return path


def write_runs_report(
    directory: str | os.PathLike[str],
    title: str,
    summary: tuple[Sequence[str], Sequence[Sequence[Any]]],
    runs: Sequence[tuple[str, Path | None]],
    output: str | os.PathLike[str] | None = None,
) -> Path:
    """Write several runs on one HTML page (a pipeline's steps): a summary table, then
    each run's sections under its own heading; returns the page's path
    (``directory/report.html`` by default).

    Args:
        directory: The directory the runs belong to.
        title: The page's heading.
        summary: The summary table: its header and rows.
        runs: Each run's heading and run directory (None: not begun, said so).
        output: Where to write the page, as for :func:`write_html_report`.

    Raises:
        RunDirectoryError: A file of a run directory, or the page's own path in
            ``directory``, is a link or not a regular file.
        ConfigurationError: matplotlib is not installed (the ``report`` extra).
    """
    folder = Path(directory)
    path = folder / HTML_REPORT_NAME if output is None else Path(output).resolve()
    check_entry(path)
    e = html.escape
    body = ["<h2>Summary</h2>", _table(*summary)]
    for heading, run_dir in runs:
        body.append(f"<h2>{e(heading)}</h2>")
        corpus = corpus_status(run_dir) if run_dir is not None and run_dir.is_dir() else None
        if corpus is not None:
            body += _corpus_parts(run_dir, corpus)  # type: ignore[arg-type]
        elif run_dir is not None and check_entry(run_dir / JOB_FILE):
            body += _run_parts(run_dir, "h3")
        else:
            body.append('<p class="note">Not begun.</p>')
    page = _page(folder, body, title)
    with atomic_write(path, durable=False) as file:
        file.write(page.encode("utf-8"))
    return path


def _plots(series: RunSeries) -> list[tuple[str, str]]:
    """(title, inline SVG) of each plot. Drawn on figures of their own (no pyplot), in
    a context of their own: a caller's backend, figures and settings stay as they are."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigurationError(
            "the HTML report draws its plots with matplotlib, which is not installed: "
            "pip install 'llm-annotator[report]'"
        ) from None

    def figure(width: float, height: float) -> tuple[Any, Any]:
        drawn = Figure(figsize=(width, height))
        return drawn, drawn.subplots()

    style: dict[Any, Any] = {"svg.fonttype": "path", "font.size": 9, "svg.hashsalt": "report"}
    with matplotlib.rc_context(style):
        plots = [
            ("Throughput over time", _throughput(figure, series)),
            ("Time a request spends in flight, by server", _per_row(figure, series)),
            ("Error rows by type over time", _errors(figure, series)),
            ("Progress and the tail", _progress(figure, series)),
        ]
    return [(title, svg) for title, svg in plots if svg]


def _svg(figure: Any) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", bbox_inches="tight", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.find("<svg") :]


def _marks(axes: Any, series: RunSeries) -> None:
    for number, (x, server, _) in enumerate(series.evictions):
        axes.axvline(
            x,
            color="#c0392b",
            linestyle="--",
            linewidth=1,
            label="eviction" if number == 0 else None,
        )
        axes.annotate(
            _short(server),
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color="#c0392b",
        )
    for number, (x, _) in enumerate(series.readmissions):
        axes.axvline(
            x,
            color="#27ae60",
            linestyle=":",
            linewidth=1.2,
            label="re-admission" if number == 0 else None,
        )
    for number, (x, _) in enumerate(series.runs[1:]):
        axes.axvline(
            x,
            color="#7f8c8d",
            linestyle="-.",
            linewidth=1,
            label="resumed" if number == 0 else None,
        )


def _time_axes(axes: Any, series: RunSeries, ylabel: str) -> None:
    """The events marked, and the axes of a plot over the job's time."""
    _marks(axes, series)
    axes.set_xlim(0, max(series.end, 1.0))
    axes.set_xlabel("seconds since the job started")
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)


def _throughput(figure: Any, series: RunSeries) -> str:
    drawn, axes = figure(9, 3.6)
    if series.rate:
        xs, ys = zip(*series.rate, strict=True)
        axes.plot(xs, ys, color="#222222", linewidth=1.8, label="all servers")
    for url, points in series.server_rate.items():
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, linewidth=1, label=_short(url))
    if series.written and series.server_rate:
        xs, ys = zip(*series.written, strict=True)
        axes.plot(xs, ys, color="#999999", linewidth=1, linestyle="--", label="rows written")
    _time_axes(axes, series, "answers / s")
    _legend(axes)
    return _svg(drawn)


def _per_row(figure: Any, series: RunSeries) -> str:
    known = {u: s for u, s in series.seconds_per_row.items() if s is not None}
    if not known:
        return ""
    drawn, axes = figure(9, 0.5 + 0.35 * len(known))
    names = [_short(u) for u in known]
    values = list(known.values())
    axes.barh(names, values, color="#2e86c1")
    for y, value in enumerate(values):
        axes.annotate(f" {value:.2f} s", (value, y), va="center", fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("mean seconds in flight per answer (requests in flight / answers per second)")
    axes.grid(axis="x", alpha=0.3)
    return _svg(drawn)


def _errors(figure: Any, series: RunSeries) -> str:
    drawn, axes = figure(9, 2.8)
    for kind, points in sorted(series.errors.items()):
        xs, ys = zip(*points, strict=True)
        axes.step(xs, ys, where="post", label=kind)
    if not series.errors:
        axes.text(
            0.5,
            0.5,
            "no error rows",
            ha="center",
            va="center",
            transform=axes.transAxes,
            color="#555555",
        )
    _time_axes(axes, series, "error rows")
    _legend(axes)
    return _svg(drawn)


def _progress(figure: Any, series: RunSeries) -> str:
    if not series.done or series.total <= 0:
        return ""
    drawn, axes = figure(9, 2.8)
    xs, ys = zip(*series.done, strict=True)
    axes.plot(xs, [100.0 * y / series.total for y in ys], color="#8e44ad", linewidth=1.5)
    if series.tail is not None:
        start, end = series.tail
        axes.axvspan(
            start,
            end,
            color="#f39c12",
            alpha=0.25,
            label=f"tail: 99% to 100% in {end - start:.1f} s",
        )
        axes.legend(loc="lower right", fontsize=8)
    _time_axes(axes, series, "% of the rows done")
    axes.set_ylim(0, 101)
    return _svg(drawn)


def _legend(axes: Any) -> None:
    if axes.get_legend_handles_labels()[0]:
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False)


def _short(url: str) -> str:
    for prefix in ("http://", "https://"):
        if url.startswith(prefix):
            url = url[len(prefix) :]
    return url.removesuffix("/v1")


# -- the page --------------------------------------------------------------------------------

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1100px;
       color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ccc; padding: 3px 9px; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f3f3f3; }
.note { color: #555; font-size: 13px; }
figure { margin: 10px 0 18px 0; } svg { max-width: 100%; height: auto; }
"""


def _page(directory: Path, body: list[str], title: str = "Run report") -> str:
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>llm-annotator {e(title.lower())}: {e(directory.name)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{e(title)}: {e(str(directory))}</h1>",
        *body,
        f'<p class="note">Written {e(_now())} by llm-annotator report from '
        f"{TIMELINE_FILE}, the shards and {REPORT_NAME}.</p></body></html>",
    ]
    return "\n".join(parts) + "\n"


def _sharded_parts(directory: Path) -> list[str]:
    """A sharded job: a table of its shards, then each shard's own sections."""
    count, states = shard_states(directory)
    merged = is_merged(directory)
    missing = [state for state in states if state.state == "missing"]
    shown = {state.index for state in missing[:LISTED_SHARDS]}
    rows = [
        (
            state.index,
            state.state,
            state.done if state.done is not None else "-",
            state.total if state.total is not None else "-",
            state.directory.name,
        )
        for state in states
        if state.state != "missing" or state.index in shown
    ]
    parts = [
        f'<p class="note">A job in {count} shards; '
        + (f"merged into {PARQUET_FILE}" if merged else "not merged yet")
        + ".</p>",
        "<h2>Shards</h2>",
        _table(["shard", "state", "rows done", "rows", "folder"], rows),
    ]
    if len(missing) > LISTED_SHARDS:
        parts.append(
            f'<p class="note">and {len(missing) - LISTED_SHARDS} more shards not started.</p>'
        )
    for state in states:
        if state.state != "missing":
            parts.append(f"<h2>Shard {state.index} of {count}</h2>")
            parts.extend(_run_parts(state.directory, "h3"))
    return parts


def _corpus_parts(directory: Path, status: dict[str, Any]) -> list[str]:
    """A corpus job: its units and rows (from the units' records, never the results),
    a table of its processes, then each process's throughput and servers over time."""
    e = html.escape
    done = "all finished" if status["complete"] else f"{status['units_done']} finished"
    parts = [
        f'<p class="note">A corpus job of {status["files"]} files in {status["units"]} units: '
        f"{e(done)}; the output is annotations/ (a Parquet file per unit).</p>",
        "<h2>Summary</h2>",
        _table(
            ["figure", "value"],
            [
                ("files", status["files"]),
                ("files skipped", status["skipped_files"]),
                ("units", status["units"]),
                ("units finished", status["units_done"]),
                ("rows in finished units", status["rows"]),
                ("answered", status["succeeded"]),
                ("failed", status["failed"]),
                ("model", status["model"] or "-"),
            ]
            + [(f"failed: {kind}", n) for kind, n in status["by_error_type"].items()],
        ),
        "<h2>Processes</h2>",
        _table(
            ["folder", "state", "rows done", "rows", "rows/s"],
            [
                (
                    p["where"],
                    p["state"],
                    _dash(p["done"]),
                    _dash(p["total"]),
                    _dash(p["rows_per_second"]),
                )
                for p in status["processes"]
            ],
        ),
    ]
    for process in status["processes"]:
        place = directory if process["where"] == "." else directory / process["where"]
        runs = read_timeline(place)
        if not runs:
            continue
        series = run_series(runs)
        parts.append(f"<h2>{e(process['where'])}</h2>")
        for title, svg in _plots(series):
            parts.append(f"<h3>{e(title)}</h3><figure>{svg}</figure>")
        parts.append("<h3>Changes of the servers' states</h3>")
        parts.append(_table(["seconds", "server", "from", "to", "reason"], _change_rows(runs)))
    return parts


def _dash(value: Any) -> Any:
    return "-" if value is None else value


def _run_parts(directory: Path, h: str) -> list[str]:
    """The sections of one run directory's report, under headings ``h``."""
    e = html.escape
    status = run_status(directory)
    runs = read_timeline(directory)
    series = run_series(runs)
    summary = read_report(directory)
    plots = _plots(series) if runs else []
    parts = [
        f'<p class="note">{e(_state_line(status, runs))}</p>',
        f"<{h}>Summary</{h}>",
        _table(["figure", "value"], _summary_rows(status, summary, series)),
        f"<{h}>Servers</{h}>",
        _table(
            [
                "server",
                "rows in the output",
                "rows in the timeline",
                "s in flight per answer",
                "evictions",
                "re-admissions",
                "requeued",
                "hedged",
                "prefix-cache hits",
                "state",
            ],
            _server_rows(status, series, runs, summary),
        ),
    ]
    if not runs:
        parts.append(
            f'<p class="note">This run directory has no {TIMELINE_FILE} (a job from before '
            "the timeline, or one started with timeline=False): only the tables.</p>"
        )
    for title, svg in plots:
        parts.append(f"<{h}>{e(title)}</{h}><figure>{svg}</figure>")
    if runs:
        parts.append(f"<{h}>Changes of the servers' states</{h}>")
        parts.append(_table(["seconds", "server", "from", "to", "reason"], _change_rows(runs)))
    return parts


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(cell) for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return f'<td class="n">{value}</td>' if number else f"<td>{html.escape(str(value))}</td>"


def _state_line(status: RunStatus, runs: Sequence[RunRecord]) -> str:
    started = (
        datetime.fromtimestamp(runs[0].wall, UTC).isoformat(timespec="seconds") if runs else "-"
    )
    return (
        f"state: {status.state}; model: {status.model or '-'}; first started {started}; "
        f"{len(runs)} run(s) in the timeline"
    )


def _summary_rows(
    status: RunStatus, summary: dict[str, Any], series: RunSeries
) -> list[tuple[str, Any]]:
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


def _server_rows(
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


def _change_rows(runs: Sequence[RunRecord]) -> list[tuple[Any, ...]]:
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


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
