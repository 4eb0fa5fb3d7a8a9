"""``report.json``: what a run did, from the consolidated output and the run's counts.

It is written whole under a fresh temporary name, never through a link planted in the
run directory (:func:`write_json`); read back, only its parts of the shape written here
are kept (:func:`read_report`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from llm_annotator.clients.base import Client
from llm_annotator.errors import RunDirectoryError
from llm_annotator.jobs.files import atomic_write, read_run_file
from llm_annotator.jobs.protocols import Streamer
from llm_annotator.pool.member import COUNTERS

if TYPE_CHECKING:
    from llm_annotator.jobs.loop.runner import JobRun

REPORT_NAME = "report.json"


def hedged_requests(client: Client[Any]) -> int:
    """Duplicate requests the pool sent to shorten the tail (first answer kept)."""
    return client.statistics().hedged if isinstance(client, Streamer) else 0


def healthy_servers(client: Client[Any]) -> int:
    return client.statistics().healthy if isinstance(client, Streamer) else 1


def job_report(
    job: JobRun, result: Any, total: int, resumed: int, seconds: float, client: Client[Any]
) -> dict[str, Any]:
    per_server: dict[str, Any] = {}
    if isinstance(client, Streamer):
        for member in client.statistics().members:
            per_server[member.server] = {
                "state": member.state,
                **{name: getattr(member, name) for name in COUNTERS},
            }
            rate = member.prefix_cache_hit_rate
            if rate is not None:  # the server's /metrics say it
                per_server[member.server].update(
                    prefix_cache_queries=member.prefix_cache_queries,
                    prefix_cache_hits=member.prefix_cache_hits,
                    prefix_cache_hit_rate=round(rate, 4),
                )
    elapsed = max(seconds, 1e-9)
    return {
        **result_summary(result),
        "input_rows": total,
        "this_run": {
            "resumed_rows": resumed,
            "sent_rows": job.sent,
            "regenerations": job.regenerated,
            "wall_seconds": round(seconds, 3),
            "rows_per_second": round(job.progress.rows / elapsed, 2),
            "output_tokens_per_second": round(job.progress.output_tokens / elapsed, 2),
            "prompt_tokens_per_second": round(job.prompt_tokens / elapsed, 2),
        },
        "per_server": per_server,
    }


def result_summary(result: Any) -> dict[str, Any]:
    """The counts of a consolidation (:class:`~llm_annotator.jobs.rundir.consolidate.
    Consolidated`), as ``report.json`` gives them."""
    return {
        "rows": result.num_rows,
        "succeeded": result.num_succeeded,
        "failed": result.num_failed,
        "by_finish_reason": result.by_finish_reason,
        "by_error_type": result.by_error_type,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
        "left_out_rows": result.left_out,
    }


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``value`` as indented JSON, whole (a fresh temporary file,
    fsynced, renamed over it).

    Raises:
        RunDirectoryError: ``path`` is a link or not a regular file (left alone).
        OSError: It cannot be written.
    """
    with atomic_write(path) as file:
        file.write(orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n")


def read_report(directory: Path) -> dict[str, Any]:
    """A run directory's ``report.json`` ({} if it has none), with ``this_run`` kept only
    as its numbers and ``per_server`` only as its servers' numbers and words (other
    values dropped).

    Raises:
        RunDirectoryError: The file is a link, not a regular file, not JSON or not a
            JSON object.

    Examples:
        >>> _checked({"this_run": {"wall_seconds": 1.5, "rows_per_second": "x"},
        ...     "per_server": {"a": {"completed": 2, "state": "up"}, "b": 3}})
        {'this_run': {'wall_seconds': 1.5}, 'per_server': {'a': {'completed': 2, 'state': 'up'}}}
    """
    path = directory / REPORT_NAME
    data = read_run_file(path)
    if data is None:
        return {}
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        problem = f"not JSON ({error})"
    else:
        if isinstance(value, dict):
            return _checked(value)
        problem = f"a JSON {type(value).__name__}, not an object"
    raise RunDirectoryError(
        f"{path} is not a run report: {problem}; remove it (running the job again writes it anew)",
        path=str(path),
    )


def _checked(report: dict[str, Any]) -> dict[str, Any]:
    checked = {key: value for key, value in report.items() if key not in _PARTS}
    this_run = report.get("this_run")
    if isinstance(this_run, dict):
        checked["this_run"] = {k: v for k, v in this_run.items() if _figure(v)}
    per_server = report.get("per_server")
    if isinstance(per_server, dict):
        checked["per_server"] = {
            str(url): {k: v for k, v in values.items() if _figure(v) or isinstance(v, str)}
            for url, values in per_server.items()
            if isinstance(values, dict)
        }
    return checked


_PARTS = ("this_run", "per_server")


def _figure(value: Any) -> bool:
    """Whether a value is a count or a rate as a report holds them (a finite number, not
    negative, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return (isinstance(value, int) or math.isfinite(value)) and value >= 0
