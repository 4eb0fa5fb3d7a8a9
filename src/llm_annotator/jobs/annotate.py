"""Annotator: a dataset in, one result row per input row out, resumable after any crash."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Unpack

import numpy as np
import structlog

from llm_annotator._constants import (
    BATCH_SIZE,
    FLUSH_INTERVAL,
    MAX_CONCURRENT_BATCHES,
    STOP_GRACE,
    SYNC_INTERVAL,
)
from llm_annotator._sync import run_sync
from llm_annotator._validate import positive_int
from llm_annotator.clients.base import Client
from llm_annotator.errors import (
    ConfigurationError,
    FingerprintMismatchError,
    JobError,
    RunInterruptedError,
)
from llm_annotator.jobs.answers.records import RecordBuilder
from llm_annotator.jobs.answers.schema import OutputSchema
from llm_annotator.jobs.corpus import annotate_corpus, runs_as_units
from llm_annotator.jobs.files import check_entry
from llm_annotator.jobs.ids import hash_id
from llm_annotator.jobs.loop.driver import Finished, Prepared, Runner, run_job
from llm_annotator.jobs.loop.interrupt import Interrupt, handling_signals
from llm_annotator.jobs.loop.runner import Cadence, JobRun
from llm_annotator.jobs.loop.summary import REPORT_NAME
from llm_annotator.jobs.protocols import ModelSource
from llm_annotator.jobs.result import AnnotationResult
from llm_annotator.jobs.rows.corpus import is_corpus
from llm_annotator.jobs.rows.inputs import Row, open_input
from llm_annotator.jobs.rows.prompts import PromptTemplate, check_job_columns
from llm_annotator.jobs.rows.sample import Sample
from llm_annotator.jobs.rundir.changes import InputChanges, compare
from llm_annotator.jobs.rundir.consolidate import (
    INPUT_IDS_FILE,
    JSONL_FILE,
    PARQUET_FILE,
    STALE_FILE,
    consolidate,
)
from llm_annotator.jobs.rundir.fingerprint import job_fingerprint
from llm_annotator.jobs.rundir.partitions import CORPUS_FILE
from llm_annotator.jobs.rundir.store import (
    JOB_FILE,
    LOCK_FILE,
    SHARDS_DIR,
    ResultStore,
    output_write_error,
)
from llm_annotator.jobs.shards.merge import merge_if_complete
from llm_annotator.jobs.shards.shard import SHARDING_FILE, Shard, claim, not_sharded
from llm_annotator.jobs.spec import JobArgs, JobSpec, documents_options, retry_choice
from llm_annotator.jobs.watch.live_metrics import LiveMetrics
from llm_annotator.jobs.watch.progress import Progress
from llm_annotator.jobs.watch.status import STATUS_FILE, StatusFile
from llm_annotator.jobs.watch.timeline import TIMELINE_FILE

log = structlog.get_logger(__name__)

__all__ = ["REPORT_NAME", "AnnotationResult", "Annotator", "JobArgs", "JobSpec"]


class Annotator:
    """Annotate a dataset with any client: a pool of vLLM servers or a single one.

    Rows are streamed from the input, rendered into prompts, sent, checked against the
    output schema, and appended to the run directory as they complete, each id once.
    Running the same job again resumes it: ids already written are not sent again.
    At the end the results are consolidated into ``annotations.parquet`` (one row per
    input id, sorted by id) beside a ``report.json``.

    Args:
        client: Any client; a :class:`VLLMQueueAnnotator` streams over its servers,
            another client gets batches of ``batch_size`` through ``abatch_generate``.
        batch_size: Rows per batch for a single client (a pool uses its own).
        max_concurrent_batches: Batches in flight for a single client.
        progress: True for a progress bar, False for log lines, None for a bar only
            on a terminal.
        stop_grace: Seconds the requests in flight get to finish after SIGINT or
            SIGTERM before the job stops anyway.
        flush_interval: Seconds between flushes of the results to the file.
        sync_interval: Seconds between fsyncs of the results file.
        metrics_port: Serve live Prometheus metrics of the job on this port while it
            runs (0: any free port, logged as ``metrics_serving``); None serves none.
            See :mod:`llm_annotator.jobs.watch.live_metrics` for the metrics.
        metrics_host: The address to serve them on: loopback by default; ``0.0.0.0``
            for a scraper on another host.
        timeline: Keep ``timeline.jsonl`` in the run directory (what
            ``llm-annotator report`` draws); see :mod:`llm_annotator.jobs.watch.timeline`.
    """

    def __init__(
        self,
        client: Client[Any],
        *,
        batch_size: int = BATCH_SIZE,
        max_concurrent_batches: int = MAX_CONCURRENT_BATCHES,
        progress: bool | None = None,
        stop_grace: float = STOP_GRACE,
        flush_interval: float = FLUSH_INTERVAL,
        sync_interval: float = SYNC_INTERVAL,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        timeline: bool = True,
    ) -> None:
        positive_int("batch_size", batch_size)
        if metrics_port is not None and (
            not isinstance(metrics_port, int)
            or isinstance(metrics_port, bool)
            or not 0 <= metrics_port <= 65535
        ):
            raise ConfigurationError(
                f"metrics_port must be a port number from 0 to 65535 (0: any free port) or "
                f"None, got {metrics_port!r}"
            )
        positive_int("max_concurrent_batches", max_concurrent_batches)
        for name, seconds in (
            ("stop_grace", stop_grace),  # 0: stop at once; inf: wait for what is in flight
            ("flush_interval", flush_interval),  # 0: after every answer
            ("sync_interval", sync_interval),
        ):
            if not _is_seconds(seconds):
                raise ConfigurationError(
                    f"{name} must be a number of seconds >= 0, got {seconds!r}"
                )
        self.client = client
        self.batch_size = batch_size
        self.max_concurrent_batches = max_concurrent_batches
        self.progress = progress
        self.stop_grace = float(stop_grace)
        self.flush_interval = flush_interval
        self.sync_interval = sync_interval
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.timeline = timeline

    @documents_options
    def annotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        handle_signals: bool = True,
        **job: Unpack[JobArgs],
    ) -> AnnotationResult:
        """Annotate ``data`` into ``output_dir``; resume it if it holds this job already.

        Args:
            data: What :func:`~llm_annotator.jobs.rows.inputs.open_input` reads (a file
                of one of the :data:`~llm_annotator.jobs.rows.formats.FORMATS`, or rows
                in memory); or a corpus: a directory, a glob, a list of
                paths or a ``save_to_disk`` folder, read unit by unit into
                ``output_dir/annotations/`` (see :mod:`llm_annotator.jobs.corpus`).
            prompt_template: The user message, with ``{column}`` fields.
            output_dir: The run directory (created if needed).
            handle_signals: Turn SIGINT/SIGTERM into a clean stop (main thread only).

        Other Parameters:
            Every job option, from its declaration in :mod:`llm_annotator.jobs.spec`.

        Returns:
            An :class:`AnnotationResult`.

        Raises:
            InputError: The input cannot be read, an id is missing or repeated, or the
                template names a column the input lacks.
            PromptError: The template cannot be rendered safely.
            FingerprintMismatchError: ``output_dir`` holds a job with other settings.
            RunInterruptedError: A signal stopped the job; everything done is written.
            PoolExhaustedError: Every server stayed down; everything done is written.
        """
        spec = JobSpec.of(data, prompt_template, output_dir, job)
        interrupt = Interrupt(self.stop_grace)
        with handling_signals(interrupt, enabled=handle_signals):
            return run_sync(self._annotate(spec, interrupt))

    async def aannotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        stop: asyncio.Event | None = None,
        **job: Unpack[JobArgs],
    ) -> AnnotationResult:
        """Async twin of :meth:`annotate`. Signals are the caller's to handle: set
        ``stop`` for a clean stop, or cancel the task to stop at once."""
        spec = JobSpec.of(data, prompt_template, output_dir, job)
        interrupt = Interrupt(self.stop_grace, stop=stop)
        return await self._annotate(spec, interrupt)

    async def _annotate(self, spec: JobSpec, interrupt: Interrupt) -> AnnotationResult:
        interrupt.bind()
        metrics = LiveMetrics() if self.metrics_port is not None else None
        try:
            async with _serving(metrics, self.metrics_port, self.metrics_host):
                return await self._annotate_bound(spec, interrupt, metrics)
        except asyncio.CancelledError:
            if not interrupt.hard:
                raise
            interrupt.uncancel()  # a signal's stop, at any phase: one line, 128 + signal
            if interrupt.sending:
                message = (
                    f"stopped by {interrupt.reason}: every row written so far is kept in "
                    f"{spec.output_dir}. Run the same job again to resume; rows already "
                    "written are not sent again."
                )
            else:
                message = (
                    f"stopped by {interrupt.reason} before any row was sent. Run the same "
                    f"job again to start it in {spec.output_dir}."
                )
            raise RunInterruptedError(
                message,
                output_dir=str(spec.output_dir),
                signum=interrupt.signals[0] if interrupt.signals else None,
            ) from None

    async def _annotate_bound(
        self, spec: JobSpec, interrupt: Interrupt, metrics: LiveMetrics | None
    ) -> AnnotationResult:
        claiming = isinstance(spec.shard, str) and spec.shard.strip() == "claim"
        if await asyncio.to_thread(is_corpus, spec.data) or (
            _is_path(spec.data) and await asyncio.to_thread(runs_as_units, spec)
        ):  # one file cut into units: claimed, or taken by static shards, as a corpus's
            return await annotate_corpus(self._runner(metrics), spec, interrupt)
        if claiming:
            raise ConfigurationError(
                "shard='claim' (--shard claim) takes files (a file, a directory, a glob or "
                "several files), whose units workers claim; rows in memory are one job"
            )
        if spec.skip_bad_files:
            raise ConfigurationError(
                "skip_bad_files (--skip-bad-files) is for a corpus (a directory, a glob or "
                "several files); a single input file that cannot be read is an error"
            )
        started = time.monotonic()
        template = PromptTemplate(spec.prompt_template)
        raw_schema = getattr(spec.options, "output_schema", None)
        schema = OutputSchema(raw_schema) if raw_schema is not None else None
        sample = Sample(spec.limit, spec.shuffle_seed)
        shard = Shard.of(spec.shard)
        if shard is not None and not sample.everything:
            raise ConfigurationError(
                "a trial run (limit) is not sharded: run it without shard (--shard), "
                "in a run directory of its own"
            )
        retry = retry_choice(spec.retry_errors)
        spec.hook_names()  # refuses a hook that is not callable
        source = await asyncio.to_thread(open_input, spec.data, id_column=spec.id_column)
        if shard is None:
            selection = None
            total = sample.size(input_rows := await asyncio.to_thread(source.scan))
        else:  # the scan finds and counts the shard's rows as well
            selection = await asyncio.to_thread(shard.select, source)
            input_rows, total = selection.rows, selection.taken
        check_job_columns(template, source, keep=spec.columns, group_by=spec.group_by)
        try:
            await asyncio.to_thread(Path(spec.output_dir).mkdir, parents=True, exist_ok=True)
        except OSError as error:  # before asking any server: the run could not be kept
            raise output_write_error(error, spec.output_dir, spec.output_dir) from None
        model = await _model_of(self.client)
        fingerprint = job_fingerprint(spec, model, **_extras(sample, spec, input_rows))
        run_dir = spec.output_dir
        await asyncio.to_thread(check_run_directory, run_dir)
        if shard is None:
            await asyncio.to_thread(not_sharded, run_dir)
        else:
            await asyncio.to_thread(claim, run_dir, shard, fingerprint, force=spec.force)
            fingerprint = {**fingerprint, "shard": {"index": shard.index, "count": shard.count}}
            spec = dataclasses.replace(spec, output_dir=shard.directory(run_dir))
            await asyncio.to_thread(check_run_directory, spec.output_dir)
        store = await _open_store(spec, fingerprint, retry, source.identity.to_json())

        def job_rows() -> Iterator[Row]:
            return sample.rows(source, input_rows) if selection is None else source.rows(selection)

        resumed, keep, stale = store.num_done, None, None
        if store.num_records:  # resumed: what changed in the input since?
            try:
                changes = await asyncio.to_thread(_changes, job_rows(), store)
                _accept_changes(changes, spec, input_changed=store.input_changed)
            except BaseException:
                await asyncio.to_thread(store.undo_record)  # refused: job.json as it was
                await asyncio.to_thread(store.close)
                raise
            store.redo(changes.redo, changes.demoted)
            resumed, stale = changes.done, changes.stale
            if store.mixed_inputs or changes.left_out:  # results of rows not in this input
                keep = changes.keep
        layout = _FileLayout(
            spec=spec,
            store=store,
            rows_of=job_rows,
            total=total,
            resumed=resumed,
            keep=keep,
            stale=stale,
            told={
                "input": source.description,
                "rows": total,
                "sample": sample.describe(),
                "model": model,
            },
            merge_into=run_dir if shard is not None else None,
        )
        builder = RecordBuilder(schema, spec.columns, validate=spec.checks_answers)
        prepared = Prepared(template, schema, builder, started)
        return await run_job(self._runner(metrics), spec, interrupt, layout, prepared)

    def _runner(self, metrics: LiveMetrics | None) -> Runner:
        """How this annotator runs a job."""
        return Runner(
            client=self.client,
            cadence=Cadence(
                batch_size=self.batch_size,
                max_concurrent_batches=self.max_concurrent_batches,
                flush_interval=self.flush_interval,
                sync_interval=self.sync_interval,
            ),
            bar=self.progress,
            timeline=self.timeline,
            metrics=metrics,
            model=lambda: _model_of(self.client),
        )


@dataclasses.dataclass(slots=True, kw_only=True)
class _FileLayout:
    """A job over one input for the driver: its rows into one store, consolidated at
    the end into ``annotations.parquet`` (only the ids to ``keep``, if given, never the
    ``stale`` records); a shard's run directory is its own folder, and the last shard
    to finish merges them all into ``merge_into``."""

    spec: JobSpec
    store: ResultStore
    rows_of: Callable[[], Iterator[Row]]
    total: int
    resumed: int
    keep: np.ndarray[Any, np.dtype[np.uint64]] | None
    stale: np.ndarray[Any, np.dtype[np.uint64]] | None
    told: dict[str, Any]
    merge_into: Path | None
    run_dir: Path = dataclasses.field(init=False)
    status_dir: Path = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.run_dir = self.status_dir = self.spec.output_dir

    def rows(self, job: JobRun, progress: Progress, status: StatusFile) -> Iterator[Row]:
        return self.rows_of()

    def said(self) -> dict[str, Any]:
        return self.told

    def running(self, client: Client[Any]) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.store.close()

    async def finish(self, job: JobRun, progress: Progress) -> Finished:
        spec, total = self.spec, self.total
        done = self.store.num_done
        try:
            result = await asyncio.to_thread(
                consolidate,
                spec.output_dir,
                jsonl=spec.write_jsonl,
                column_order=job.builder.output_columns(),
                keep=self.keep,
                stale=self.stale,
            )
        except OSError as error:
            raise output_write_error(
                error, error.filename or spec.output_dir, spec.output_dir, done=done
            ) from None
        problem = None
        if result.num_rows < total:
            # Never silent: a done-id set that claimed a row it never saw (an 8-byte hash
            # collision) would otherwise skip that row without a trace.
            log.error("rows_missing", expected=total, written=result.num_rows)
            problem = JobError(
                f"{total - result.num_rows} of the {total} input rows have no result in "
                f"{spec.output_dir} ({result.num_rows} written): the input changed while the "
                "job read it, or the set of done ids mistook a new id for a done one (an "
                "8-byte hash collision, about 1 in 10^4 at 10^8 string ids). The rows "
                "written are kept; please report this with the run directory's job.json."
            )
        return Finished(
            result=result,
            output_path=result.parquet_path,
            jsonl_path=result.jsonl_path,
            left_out=result.left_out,
            problem=problem,
        )

    async def after(self, result: AnnotationResult) -> AnnotationResult:
        if self.merge_into is None:
            return result
        merged = await asyncio.to_thread(
            merge_if_complete, self.merge_into, jsonl=self.spec.write_jsonl
        )
        if merged is None:
            return result
        return dataclasses.replace(result, merged_path=merged.output_path)


@contextlib.asynccontextmanager
async def _serving(metrics: LiveMetrics | None, port: int | None, host: str) -> AsyncIterator[None]:
    """Serve ``metrics`` while the block runs (nothing when there are none)."""
    if metrics is None or port is None:
        yield
        return
    await asyncio.to_thread(metrics.serve, port, host)
    try:
        yield
    finally:
        await asyncio.to_thread(metrics.stop)


def _is_path(data: object) -> bool:
    """Whether the input is a path (a file), not rows in memory."""
    return isinstance(data, str | os.PathLike)


def _is_seconds(value: object) -> bool:
    """A number of seconds >= 0 (infinity included)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


async def _model_of(client: Client[Any]) -> str | None:
    """The model the job runs on, for the fingerprint."""
    if isinstance(client, ModelSource):
        return await client.aresolve_model()
    model = getattr(client, "model", None)
    return model if isinstance(model, str) else None


def _extras(sample: Sample, spec: JobSpec, input_rows: int) -> dict[str, Any]:
    """Fingerprint entries of the settings a job may leave out; left out when unused, so
    that the fingerprint of a job without them is what it was before they existed."""
    extras: dict[str, Any] = {}
    if not sample.everything:
        extras["sample"] = sample.fingerprint(input_rows)
    extras.update(spec.hook_names())
    return extras


RUN_FILES = (
    JOB_FILE,
    LOCK_FILE,
    STATUS_FILE,
    TIMELINE_FILE,
    REPORT_NAME,
    PARQUET_FILE,
    JSONL_FILE,
    SHARDING_FILE,
    INPUT_IDS_FILE,
    STALE_FILE,
)
"""The files a run writes at the top of its directory (``report.html`` is written by
``llm-annotator report``, which checks it then)."""


def check_run_directory(directory: Path) -> None:
    """Refuse, before any request, a run directory where one of the job's own names is
    a link, a FIFO, a folder or anything but a regular file (``shards/``: a real
    folder), so that nothing is written through it at the end of a long run.

    Raises:
        RunDirectoryError: Naming the first such entry.
    """
    for name in RUN_FILES:
        check_entry(directory / name)
    check_entry(directory / SHARDS_DIR, directory=True)
    if check_entry(directory / CORPUS_FILE):
        raise ConfigurationError(
            f"{directory} holds a corpus job (many input files): give this job another "
            "--output-dir, or the corpus as its input"
        )


def _changes(rows: Iterator[Row], store: ResultStore) -> InputChanges:
    """The job's input compared with the records its run directory holds."""
    stored = store.records()
    return compare(
        ((row.id, hash_id(row.id), row.content(), store.is_done(row.id)) for row in rows),
        stored,
    )


def _accept_changes(changes: InputChanges, spec: JobSpec, *, input_changed: bool) -> None:
    """Refuse, unless forced, to replace answers of rows whose content changed, or to
    keep answers that hold no content hash (made before contents were recorded) for an
    input that is not the one they were made from; log what changed either way.

    Raises:
        FingerprintMismatchError: Answers would be replaced, or kept without knowing
            their rows' content, and ``spec.force`` is False.
    """
    if changes.unknown and input_changed and not spec.force:
        raise FingerprintMismatchError(
            f"{spec.output_dir} holds results of {changes.unknown} rows of this input made "
            "before row contents were recorded, and its input changed since: pass force=True "
            "(CLI --force) to keep them as they are (only other rows are sent), or choose a "
            "new output directory",
            changes=["input changed"],
        )
    if not changes.changed and not changes.left_out:
        return
    shown = ", ".join(repr(row_id) for row_id in changes.examples)
    more = ", ..." if changes.changed > len(changes.examples) else ""
    if changes.replaced and not spec.force:
        raise FingerprintMismatchError(
            f"{spec.output_dir} holds answers to {changes.replaced} rows whose content "
            f"changed since they were annotated (ids {shown}{more}): pass force=True (CLI "
            "--force) to annotate them again, or choose a new output directory",
            changes=[f"{changes.replaced} rows changed"],
        )
    log.warning(
        "input_changed",
        output_dir=str(spec.output_dir),
        changed=changes.changed,
        answers_replaced=changes.replaced,
        left_out=changes.left_out,
        examples=list(changes.examples),
    )


async def _open_store(
    spec: JobSpec,
    fingerprint: dict[str, Any],
    retry: bool | frozenset[str],
    identity: dict[str, Any],
) -> ResultStore:
    """Open the run's store in a thread; if the job is cancelled meanwhile (a signal),
    the store is still closed, so that its lock and empty shard do not linger."""
    opening = asyncio.ensure_future(
        asyncio.to_thread(
            ResultStore.open,
            spec.output_dir,
            fingerprint,
            force=spec.force,
            retry_errors=retry,
            input_identity=identity,
        )
    )
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            store = await opening
            await asyncio.to_thread(store.close)
        raise
