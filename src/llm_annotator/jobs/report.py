"""``report.json``: what a run did, from the consolidated output and the run's counts."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from llm_annotator.clients.base import Client
from llm_annotator.jobs.streaming import Streamer

if TYPE_CHECKING:
    from llm_annotator.jobs.runner import JobRun

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
                "completed": member.completed,
                "errors": member.errors,
                "evictions": member.evictions,
                "readmissions": member.readmissions,
                "requeued": member.requeued,
                "hedged": member.hedged,
            }
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
    """The counts of a consolidation (:class:`~llm_annotator.jobs.consolidate.
    Consolidated`), as ``report.json`` gives them."""
    return {
        "rows": result.num_rows,
        "succeeded": result.num_succeeded,
        "failed": result.num_failed,
        "by_finish_reason": result.by_finish_reason,
        "by_error_type": result.by_error_type,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
    }


def write_json(path: Path, value: Mapping[str, Any]) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(temporary, path)
