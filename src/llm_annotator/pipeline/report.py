"""A pipeline drawn on one HTML page: a table of its steps, then each step's run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

from llm_annotator.errors import JobError
from llm_annotator.jobs.files import check_entry
from llm_annotator.jobs.run_report import write_runs_report
from llm_annotator.pipeline.run import PIPELINE_FILE, REPORT_FILE, STEPS_DIR

_COLUMNS = (
    "step",
    "reads",
    "state",
    "last run",
    "rows",
    "succeeded",
    "failed",
    "sent",
    "resumed",
    "seconds",
)


def is_pipeline(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` is a pipeline's (it holds ``pipeline.json``)."""
    return check_entry(Path(directory) / PIPELINE_FILE)


def write_pipeline_report(
    directory: str | os.PathLike[str], output: str | os.PathLike[str] | None = None
) -> Path:
    """Draw a pipeline's steps into one HTML file (``directory/report.html`` by
    default): a table of every step (what it read, its state, its figures from its last
    run), then each step's own report, as ``llm-annotator report`` draws a run.

    Raises:
        JobError: The directory holds no pipeline.
        RunDirectoryError: A file there is a link or not a regular file.
        ConfigurationError: matplotlib is not installed (the ``report`` extra).
    """
    folder = Path(directory)
    if not is_pipeline(folder):
        raise JobError(f"{folder} holds no pipeline ({PIPELINE_FILE})")
    record = _read(folder / PIPELINE_FILE).get("steps", {})
    report = _read(folder / REPORT_FILE) if check_entry(folder / REPORT_FILE) else {}
    listed = [s for s in report.get("steps", []) if isinstance(s, dict) and "name" in s]
    names = [str(s["name"]) for s in listed] + [
        n for n in record if n not in {s["name"] for s in listed}
    ]
    figures = {str(s["name"]): s for s in listed}
    rows: list[list[Any]] = []
    for name in names:
        entry = record.get(name) if isinstance(record.get(name), dict) else {}
        shown = figures.get(name, {})
        numbers = entry.get("figures") or shown
        rows.append(
            [
                name,
                shown.get("reads", "-"),
                entry.get("state", "not run"),
                shown.get("action", "-"),
                *(
                    numbers.get(key, "-")
                    for key in ("rows", "succeeded", "failed", "sent", "resumed", "seconds")
                ),
            ]
        )
    runs = [
        (f"Step {name}", folder / STEPS_DIR / name if name in record else None) for name in names
    ]
    return write_runs_report(folder, "Pipeline report", (_COLUMNS, rows), runs, output)


def _read(path: Path) -> dict[str, Any]:
    try:
        value = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError) as error:
        raise JobError(f"cannot read {path}: {error}") from None
    return value if isinstance(value, dict) else {}
