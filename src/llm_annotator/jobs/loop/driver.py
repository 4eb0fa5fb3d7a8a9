"""The one driver of every job: a layout says where rows come from and results go.

:func:`run_job` runs the steps every job shares, in one order: the progress and
``status.json``, the job loop (:class:`~llm_annotator.jobs.loop.runner.JobRun`), the
watch (timeline, live metrics), a clean stop on a signal, the layout's end (one
consolidated file, or a corpus's manifest), ``report.json``, the logs and the
:class:`~llm_annotator.jobs.result.AnnotationResult`. What differs between a job over
one file and a corpus of units is a :class:`Layout`: its store, its rows, how it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from llm_annotator.clients.base import Client
from llm_annotator.errors import JobError, RunInterruptedError
from llm_annotator.jobs.answers.records import RecordBuilder
from llm_annotator.jobs.answers.schema import OutputSchema
from llm_annotator.jobs.loop.interrupt import Interrupt
from llm_annotator.jobs.loop.runner import Cadence, JobRun, Sink, varies
from llm_annotator.jobs.loop.summary import (
    REPORT_NAME,
    healthy_servers,
    hedged_requests,
    job_report,
    write_json,
)
from llm_annotator.jobs.result import AnnotationResult
from llm_annotator.jobs.rows.inputs import Row
from llm_annotator.jobs.rows.prompts import PromptTemplate
from llm_annotator.jobs.rundir.consolidate import Consolidated
from llm_annotator.jobs.rundir.store import ResultStore, output_write_error
from llm_annotator.jobs.spec import JobSpec
from llm_annotator.jobs.watch.live_metrics import LiveMetrics
from llm_annotator.jobs.watch.observer import Observer
from llm_annotator.jobs.watch.progress import Progress
from llm_annotator.jobs.watch.status import StatusFile
from llm_annotator.jobs.watch.timeline import RunWatch

log = structlog.get_logger(__name__)

Rows = Iterator[Row] | AsyncIterator[Row | None]


@dataclass(frozen=True, slots=True)
class Runner:
    """How the annotator runs a job: its client and its cadence, and what it shows.
    The one holder of the run's settings."""

    client: Client[Any]
    cadence: Cadence
    bar: bool | None
    timeline: bool
    metrics: LiveMetrics | None
    model: Callable[[], Any]
    """Awaitable factory: the model the job runs on, for the fingerprint."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """What every layout decides before its first request, the same way."""

    template: PromptTemplate
    schema: OutputSchema | None
    builder: RecordBuilder
    started: float
    """``time.monotonic()`` when the job began (its wall time counts from there)."""


@dataclass(frozen=True, slots=True)
class Finished:
    """What a layout made of a run's records once the loop is over."""

    result: Consolidated
    output_path: Path
    jsonl_path: Path | None = None
    merged_path: Path | None = None
    left_out: int = 0
    report: Mapping[str, Any] = field(default_factory=dict)
    """Entries the layout adds to ``report.json``."""
    said: Mapping[str, Any] = field(default_factory=dict)
    """Entries the layout adds to the ``job_finished`` log line."""
    problem: JobError | None = None
    """Raised once the report is written: the output lacks rows it should hold."""


class Layout(Protocol):
    """Where a job's rows come from and where its results go: one file and its
    consolidated output, or a corpus's units and their partitioned output."""

    run_dir: Path
    """The run directory the user named (what the messages speak of)."""
    status_dir: Path
    """Where this process keeps ``status.json``, ``timeline.jsonl`` and the report."""

    @property
    def store(self) -> ResultStore | Sink:
        """Where the loop writes the records."""

    total: int
    """The rows of the job, resumed ones included (an estimate until all are read)."""
    resumed: int
    """Rows done by earlier runs."""

    def rows(self, job: JobRun, progress: Progress, status: StatusFile) -> Rows:
        """The rows to send; ``progress`` and ``status`` follow what is learnt."""

    def said(self) -> dict[str, Any]:
        """Entries of the ``job_started`` log line."""

    def running(self, client: Client[Any]) -> contextlib.AbstractAsyncContextManager[None]:
        """What runs beside the loop (a worker's lease renewals, its share of the
        servers among the fleet)."""

    async def drain(self) -> None:
        """Wait for what the store still writes once every record is in."""

    def close(self) -> None:
        """Close the store (in a thread: it syncs)."""

    async def finish(self, job: JobRun, progress: Progress) -> Finished:
        """Make the output of the records written (consolidate, or a manifest)."""

    async def after(self, result: AnnotationResult) -> AnnotationResult:
        """What follows the report (the last shard merges them all)."""


async def run_job(
    runner: Runner, spec: JobSpec, interrupt: Interrupt, layout: Layout, prepared: Prepared
) -> AnnotationResult:
    """Run the job ``spec`` over ``layout`` to its end (see the module).

    Raises:
        RunInterruptedError: A signal stopped the job; every row written is kept.
        JobError: The output lacks rows of the input.
        OutputWriteError: The output or the report cannot be written.
    """
    client = runner.client
    resumed = layout.resumed
    progress = Progress(
        layout.total, resumed, healthy=lambda: healthy_servers(client), bar=runner.bar
    )
    status = StatusFile(layout.status_dir, layout.total)
    job = JobRun(
        client=client,
        cadence=runner.cadence,
        rows=iter(()),
        template=prepared.template,
        system_message=spec.system_message,
        group_by=spec.group_by,
        builder=prepared.builder,
        schema=prepared.schema,
        validate=spec.validate,
        postprocess=spec.postprocess,
        store=layout.store,
        regenerate=spec.max_regenerations if varies(spec.options, spec.gen_kwargs) else 0,
        progress=progress,
    )
    job.rows = layout.rows(job, progress, status)
    log.info("job_started", **layout.said(), done_before=resumed, output_dir=str(layout.run_dir))
    watch = RunWatch(
        layout.status_dir,
        progress,
        client,
        resumed,
        timeline=runner.timeline,
        publish=runner.metrics.publish if runner.metrics is not None else None,
    )
    hedged_before = hedged_requests(client)
    async with Observer(status, watch, progress.figures).kept():
        await _send(job, spec, interrupt, layout, status)
        if interrupt.triggered:
            _interrupted(interrupt, layout, progress)
        status.total = progress.total
        finished = await layout.finish(job, progress)
        seconds = time.monotonic() - prepared.started
        report = job_report(job, finished.result, progress.total, resumed, seconds, client)
        report["this_run"]["hedged_requests"] = hedged_requests(client) - hedged_before
        report.update(finished.report)
        report_path = layout.status_dir / REPORT_NAME
        try:
            await asyncio.to_thread(write_json, report_path, report)
        except OSError as error:
            raise output_write_error(
                error, report_path, layout.run_dir, done=finished.result.num_rows
            ) from None
        result = finished.result
        log.info(
            "job_finished",
            rows=result.num_rows,
            succeeded=result.num_succeeded,
            failed=result.num_failed,
            sent=job.sent,
            seconds=round(seconds, 2),
            output=str(finished.output_path),
            **finished.said,
        )
        if finished.problem is not None:
            raise finished.problem
    annotated = AnnotationResult(
        output_dir=layout.status_dir,
        output_path=finished.output_path,
        jsonl_path=finished.jsonl_path,
        report_path=report_path,
        num_rows=result.num_rows,
        num_succeeded=result.num_succeeded,
        num_failed=result.num_failed,
        num_resumed=resumed,
        num_sent=job.sent,
        seconds=seconds,
        merged_path=finished.merged_path,
        num_left_out=finished.left_out,
    )
    return await layout.after(annotated)


async def _send(
    job: JobRun, spec: JobSpec, interrupt: Interrupt, layout: Layout, status: StatusFile
) -> None:
    """Run the loop until its rows are done or a signal stops it; the store is closed
    either way, once what runs beside the loop has stopped."""
    try:
        async with layout.running(job.client):
            interrupt.sending = True
            try:
                await job.run(spec.options, spec.gen_kwargs, interrupt)
                await layout.drain()
            except asyncio.CancelledError:
                if not interrupt.hard:
                    raise
                interrupt.uncancel()
            finally:
                job.progress.close()
                if not interrupt.triggered:
                    status.state = "consolidating"
                    await asyncio.to_thread(status.write, job.progress.figures())
    finally:
        await asyncio.to_thread(layout.close)


def _interrupted(interrupt: Interrupt, layout: Layout, progress: Progress) -> None:
    """Raise the clean stop of a signal: what is written, and how to resume."""
    done = progress.done
    log.warning("job_interrupted", done=done, total=progress.total, output_dir=str(layout.run_dir))
    of = f" of {progress.total}" if progress.total >= max(done, 1) else ""  # a worker's: unknown
    raise RunInterruptedError(
        f"stopped by {interrupt.reason}: {done}{of} rows are written in "
        f"{layout.run_dir}. Run the same job again to resume; rows already written are not "
        "sent again.",
        output_dir=str(layout.run_dir),
        num_done=done,
        signum=interrupt.signals[0] if interrupt.signals else None,
    )


__all__ = ["Finished", "Layout", "Prepared", "Runner", "run_job"]
