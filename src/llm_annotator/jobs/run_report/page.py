"""The report's HTML: the page of one run directory (a job, a sharded job, a corpus job)
or of several (a pipeline's steps), its sections and tables, written whole under a
fresh temporary name; every file of a run directory is read through its checked reader.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from llm_annotator.errors import JobError
from llm_annotator.jobs.files import atomic_write, check_entry
from llm_annotator.jobs.loop.summary import REPORT_NAME, read_report
from llm_annotator.jobs.run_directory import RunDirectory
from llm_annotator.jobs.run_report.plots import svg_plots
from llm_annotator.jobs.run_report.series import (
    change_rows,
    run_series,
    server_rows,
    state_line,
    summary_rows,
)
from llm_annotator.jobs.rundir.consolidate import PARQUET_FILE
from llm_annotator.jobs.rundir.store import JOB_FILE
from llm_annotator.jobs.shards.merge import LISTED_SHARDS, is_merged, shard_states
from llm_annotator.jobs.watch.status import corpus_status, run_status
from llm_annotator.jobs.watch.timeline import TIMELINE_FILE, read_timeline

HTML_REPORT_NAME = "report.html"


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
    run = RunDirectory.open(directory)
    corpus = corpus_status(directory) if run.kind == "corpus" else None
    if corpus is not None:
        body = _corpus_parts(directory, corpus)
    elif run.part_of is not None:
        raise JobError(
            f"{directory} is one process of the corpus job in {run.part_of}: draw "
            f"the job, llm-annotator report {run.part_of}"
        )
    elif run.kind == "shards":
        body = _sharded_parts(directory)
    else:
        body = _run_parts(directory, "h2")  # raises JobError for a directory without a job
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
        for title, svg in svg_plots(series):
            parts.append(f"<h3>{e(title)}</h3><figure>{svg}</figure>")
        parts.append("<h3>Changes of the servers' states</h3>")
        parts.append(_table(["seconds", "server", "from", "to", "reason"], change_rows(runs)))
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
    plots = svg_plots(series) if runs else []
    parts = [
        f'<p class="note">{e(state_line(status, runs))}</p>',
        f"<{h}>Summary</{h}>",
        _table(["figure", "value"], summary_rows(status, summary, series)),
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
            server_rows(status, series, runs, summary),
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
        parts.append(_table(["seconds", "server", "from", "to", "reason"], change_rows(runs)))
    return parts


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    e = html.escape
    head = "".join(f"<th>{e(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(cell) for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value: Any) -> str:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return f'<td class="n">{value}</td>' if number else f"<td>{html.escape(str(value))}</td>"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
