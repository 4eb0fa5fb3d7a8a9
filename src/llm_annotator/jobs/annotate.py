"""Annotator: a dataset in, one result row per input row out, resumable after any crash."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

import orjson
import structlog

from llm_annotator._constants import (
    BATCH_SIZE,
    FLUSH_INTERVAL,
    MAX_CONCURRENT_BATCHES,
    MAX_REGENERATIONS,
    STOP_GRACE,
    SYNC_INTERVAL,
)
from llm_annotator._sync import run_sync
from llm_annotator._validate import positive_int
from llm_annotator.clients.base import Client, Messages
from llm_annotator.errors import (
    ConfigurationError,
    InputError,
    JobError,
    PromptError,
    RunInterruptedError,
)
from llm_annotator.jobs.consolidate import consolidate
from llm_annotator.jobs.fingerprint import make_fingerprint
from llm_annotator.jobs.ids import RowId
from llm_annotator.jobs.inputs import RowSource, open_input
from llm_annotator.jobs.interrupt import Interrupt, handling_signals
from llm_annotator.jobs.progress import Progress
from llm_annotator.jobs.prompts import PromptTemplate, build_messages
from llm_annotator.jobs.records import RecordBuilder
from llm_annotator.jobs.schema import OutputSchema
from llm_annotator.jobs.store import ResultStore, output_write_error
from llm_annotator.jobs.streaming import ModelSource, Streamer, stream
from llm_annotator.response import Response

log = structlog.get_logger(__name__)

REPORT_NAME = "report.json"


@dataclass(frozen=True, slots=True)
class AnnotationResult:
    """What an annotation job produced.

    Attributes:
        output_dir: The run directory.
        output_path: ``annotations.parquet``: one row per input id, sorted by id.
        jsonl_path: ``annotations.jsonl`` when asked for, else None.
        report_path: ``report.json``: counts, token rates, per-server statistics.
        num_rows: Rows in the consolidated output.
        num_succeeded: Rows with an answer.
        num_failed: Error rows (their ``error`` and ``error_type`` say why).
        num_resumed: Rows already done by an earlier run of the same job.
        num_sent: Rows sent to the model by this run (regenerations not counted).
        seconds: Wall time of this run.
    """

    output_dir: Path
    output_path: Path
    jsonl_path: Path | None
    report_path: Path
    num_rows: int
    num_succeeded: int
    num_failed: int
    num_resumed: int
    num_sent: int
    seconds: float


class JobArgs(TypedDict, total=False):
    """The keyword arguments of a job, written once: :meth:`Annotator.annotate` takes
    them, and ``VLLMQueueAnnotator.annotate`` forwards them (see there for each)."""

    system_message: str | None
    id_column: str | None
    options: Any
    gen_kwargs: dict[str, Any] | None
    columns: Sequence[str] | None
    retry_errors: bool
    force: bool
    write_jsonl: bool
    max_regenerations: int


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What defines one job: the arguments of :meth:`Annotator.annotate`, with their
    defaults, written once (:class:`JobArgs` types the keywords)."""

    data: Any
    prompt_template: str
    output_dir: Path
    system_message: str | None = None
    id_column: str | None = None
    options: Any = None
    gen_kwargs: dict[str, Any] | None = None
    columns: Sequence[str] | None = None
    retry_errors: bool = False
    force: bool = False
    write_jsonl: bool = False
    max_regenerations: int = MAX_REGENERATIONS

    @classmethod
    def of(
        cls,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        job: Mapping[str, Any],
    ) -> JobSpec:
        """The spec of a call's arguments.

        Raises:
            TypeError: If ``job`` names an argument that does not exist.
        """
        unknown = sorted(set(job) - _JOB_ARGS)
        if unknown:
            raise TypeError(
                f"annotate() got unexpected keyword arguments {unknown}; "
                f"it takes {sorted(_JOB_ARGS)}"
            )
        return cls(data, prompt_template, Path(output_dir), **job)


_JOB_ARGS = frozenset(JobArgs.__annotations__)
"""The keyword arguments of a job (``tests/unit/test_annotate.py`` checks that
:class:`JobSpec` has the same)."""


class _Item:
    """One row on its way through the model (the key of the stream)."""

    __slots__ = ("attempt", "id", "messages", "values")

    def __init__(
        self, row_id: RowId, values: dict[str, Any], messages: Messages, attempt: int
    ) -> None:
        self.id = row_id
        self.values = values
        self.messages = messages
        self.attempt = attempt


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
    ) -> None:
        positive_int("batch_size", batch_size)
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
            data: A ``.jsonl``/``.parquet``/``.csv`` path, a list of dicts, or a
                ``datasets.Dataset``.
            prompt_template: The user message, with ``{column}`` fields.
            output_dir: The run directory (created if needed).
            system_message: A system message for every row, or None.
            id_column: The column holding each row's id; None numbers rows by position.
            options: The client's runtime options (e.g. ``VLLMOnlineRuntimeOptions``);
                an ``output_schema`` there makes answers parsed and validated.
            gen_kwargs: Raw request parameters that override ``options``.
            columns: The input columns to keep in the output; None keeps all.
            retry_errors: Send again the rows whose result is an error.
            force: Resume even if the directory was made with other settings.
            write_jsonl: Also write ``annotations.jsonl``.
            max_regenerations: With an output schema, times an invalid or truncated
                answer is generated again before it is kept as an error row.
            handle_signals: Turn SIGINT/SIGTERM into a clean stop (main thread only).

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
        try:
            return await self._annotate_bound(spec, interrupt)
        except asyncio.CancelledError:
            if not interrupt.hard or interrupt.sending:
                raise
            interrupt.uncancel()
            raise RunInterruptedError(
                f"stopped by {interrupt.reason} before any row was sent. Run the same "
                f"job again to start it in {spec.output_dir}.",
                output_dir=str(spec.output_dir),
                signum=interrupt.signals[0] if interrupt.signals else None,
            ) from None

    async def _annotate_bound(self, spec: JobSpec, interrupt: Interrupt) -> AnnotationResult:
        started = time.monotonic()
        template = PromptTemplate(spec.prompt_template)
        raw_schema = getattr(spec.options, "output_schema", None)
        schema = OutputSchema(raw_schema) if raw_schema is not None else None
        source = open_input(spec.data, id_column=spec.id_column)
        total = await asyncio.to_thread(source.scan)
        _check_columns(source, template, spec.columns)
        try:
            await asyncio.to_thread(Path(spec.output_dir).mkdir, parents=True, exist_ok=True)
        except OSError as error:  # before asking any server: the run could not be kept
            raise output_write_error(error, spec.output_dir, spec.output_dir) from None
        model = await _model_of(self.client)
        fingerprint = make_fingerprint(
            prompt_template=spec.prompt_template,
            system_message=spec.system_message,
            model=model,
            options=spec.options.to_payload() if spec.options is not None else {},
            gen_kwargs=spec.gen_kwargs or {},
            output_schema=raw_schema,
            id_column=spec.id_column,
            columns=list(spec.columns) if spec.columns is not None else None,
        )
        store = await _open_store(spec, fingerprint)
        resumed = store.num_done
        hedged_before = _hedged(self.client)
        log.info(
            "job_started",
            input=source.description,
            rows=total,
            done_before=resumed,
            output_dir=str(spec.output_dir),
            model=model,
        )
        job = _Job(
            annotator=self,
            source=source,
            template=template,
            system_message=spec.system_message,
            builder=RecordBuilder(schema, spec.columns),
            schema=schema,
            store=store,
            regenerate=spec.max_regenerations if _varies(spec.options, spec.gen_kwargs) else 0,
            progress=Progress(
                total, resumed, healthy=lambda: _healthy(self.client), bar=self.progress
            ),
        )
        interrupt.sending = True
        try:
            await job.run(spec.options, spec.gen_kwargs, interrupt)
        except asyncio.CancelledError:
            if not interrupt.hard:
                raise
            interrupt.uncancel()
        finally:
            job.progress.close()
            await asyncio.to_thread(store.close)
        done = store.num_done
        if interrupt.triggered:
            message = (
                f"stopped by {interrupt.reason}: {done} of {total} rows are written in "
                f"{spec.output_dir}. Run the same job again to resume; rows already written "
                "are not sent again."
            )
            log.warning("job_interrupted", done=done, total=total, output_dir=str(spec.output_dir))
            raise RunInterruptedError(
                message,
                output_dir=str(spec.output_dir),
                num_done=done,
                signum=interrupt.signals[0] if interrupt.signals else None,
            )
        try:
            result = await asyncio.to_thread(
                consolidate,
                spec.output_dir,
                jsonl=spec.write_jsonl,
                column_order=job.builder.output_columns(),
            )
        except OSError as error:
            raise output_write_error(
                error, error.filename or spec.output_dir, spec.output_dir, done=done
            ) from None
        seconds = time.monotonic() - started
        report = _report(job, result, total, resumed, seconds, self.client)
        report["this_run"]["hedged_requests"] = _hedged(self.client) - hedged_before
        report_path = spec.output_dir / REPORT_NAME
        try:
            await asyncio.to_thread(_write_json, report_path, report)
        except OSError as error:
            raise output_write_error(error, report_path, spec.output_dir, done=done) from None
        log.info(
            "job_finished",
            rows=result.num_rows,
            succeeded=result.num_succeeded,
            failed=result.num_failed,
            sent=job.sent,
            seconds=round(seconds, 2),
            output=str(result.parquet_path),
        )
        if result.num_rows < total:
            # Never silent: a done-id set that claimed a row it never saw (an 8-byte hash
            # collision) would otherwise skip that row without a trace.
            log.error("rows_missing", expected=total, written=result.num_rows)
            raise JobError(
                f"{total - result.num_rows} of the {total} input rows have no result in "
                f"{spec.output_dir} ({result.num_rows} written): the input changed while the "
                "job read it, or the set of done ids mistook a new id for a done one (an "
                "8-byte hash collision, about 1 in 10^4 at 10^8 string ids). The rows "
                "written are kept; please report this with the run directory's job.json."
            )
        return AnnotationResult(
            output_dir=spec.output_dir,
            output_path=result.parquet_path,
            jsonl_path=result.jsonl_path,
            report_path=report_path,
            num_rows=result.num_rows,
            num_succeeded=result.num_succeeded,
            num_failed=result.num_failed,
            num_resumed=resumed,
            num_sent=job.sent,
            seconds=seconds,
        )


_READY_LIMIT = 4096
"""Records of rows that need no request (unreadable rows, templates that fail) held
for the consumer at most; the input waits beyond that."""


class _Job:
    """The moving parts of one run: rows out to the model, records into the store.

    Three parts, each with one job:

    - the *requests* (:meth:`_requests`, read by the client's stream) only produce: a
      row that needs no request (unreadable, or its template fails) becomes a record
      put in :attr:`ready`; the others become requests, regenerations first;
    - the *pump* (:meth:`_pump`) moves the stream's answers into :attr:`answers`;
    - the *consumer* (:meth:`_consume`, the job's own task) is the only writer of the
      store: it concludes every answer (a record, or a regeneration put on the job's
      queue :attr:`retries`) and writes the ready records.
    """

    def __init__(
        self,
        *,
        annotator: Annotator,
        source: RowSource,
        template: PromptTemplate,
        system_message: str | None,
        builder: RecordBuilder,
        schema: OutputSchema | None,
        store: ResultStore,
        regenerate: int,
        progress: Progress,
    ) -> None:
        self.annotator = annotator
        self.source = source
        self.template = template
        self.system_message = system_message
        self.builder = builder
        self.schema = schema
        self.store = store
        self.regenerate = regenerate
        self.progress = progress
        self.retries: deque[_Item] = deque()
        """Regenerations, owned by the job: the requests send them first."""
        self.retry_ready = asyncio.Event()
        self.ready: deque[dict[str, Any]] = deque()
        """Error records of rows that were never sent, for the consumer to write."""
        self.answers: deque[tuple[_Item, Response]] = deque()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._stream_over = False
        self._failure: Exception | None = None
        self.out = 0
        """Items handed to the model and not yet concluded."""
        self.sent = 0
        self.regenerated = 0
        self.prompt_tokens = 0

    async def run(
        self, options: Any, gen_kwargs: dict[str, Any] | None, interrupt: Interrupt
    ) -> None:
        annotator = self.annotator
        results = stream(
            annotator.client,
            self._requests(),
            options=options,
            gen_kwargs=gen_kwargs,
            stop=interrupt.stop,
            batch_size=annotator.batch_size,
            max_concurrent_batches=annotator.max_concurrent_batches,
        )
        pump = asyncio.ensure_future(self._pump(results))
        try:
            await self._consume()
        finally:
            if not pump.done():
                pump.cancel()  # closes the stream: the work in flight is cancelled
            with contextlib.suppress(asyncio.CancelledError):
                await pump

    async def _pump(self, results: AsyncGenerator[tuple[_Item, Response], None]) -> None:
        """Move the stream's answers to the consumer; hand it the stream's failure."""
        try:
            async with contextlib.aclosing(results):
                async for pair in results:
                    self.answers.append(pair)
                    self._wake.set()
        except Exception as exc:  # PoolExhaustedError, a failed input: the job's to raise
            self._failure = exc
        finally:
            self._stream_over = True
            self._wake.set()

    async def _consume(self) -> None:
        """Write every record, in the job's task, until the stream is over."""
        annotator, store = self.annotator, self.store
        answers, ready = self.answers, self.ready
        flushed = synced = time.monotonic()
        while True:
            while ready or answers:
                while ready:
                    self._write(ready.popleft(), failed=True)
                self._drained.set()
                while answers:
                    item, response = answers.popleft()
                    self._conclude(item, response)
                now = time.monotonic()
                if now - flushed >= annotator.flush_interval:
                    store.flush()
                    flushed = now
                    if now - synced >= annotator.sync_interval:
                        await asyncio.to_thread(store.sync)
                        synced = time.monotonic()
            if self._stream_over:
                if self._failure is not None:
                    raise self._failure
                return
            self._wake.clear()
            await self._wake.wait()

    async def _requests(self) -> AsyncIterator[tuple[_Item, Messages]]:
        """Rows not done yet, as prompts; regenerations go first. Rows that need no
        request become records for the consumer (never written here)."""
        store, retries = self.store, self.retries
        scanned = 0
        for row in self.source:
            scanned += 1
            if scanned % 4096 == 0:
                await asyncio.sleep(0)  # a long run of done rows must not starve the loop
            while retries:
                item = retries.popleft()
                yield item, item.messages
            if store.is_done(row.id):
                continue
            if row.error is not None:
                await self._put_ready(self.builder.error_record(row.id, {}, row.error))
                continue
            try:
                prompt = self.template.render(row.values, row.where)
            except PromptError as exc:
                await self._put_ready(self.builder.error_record(row.id, row.values, str(exc)))
                continue
            messages = build_messages(prompt, self.system_message)
            self.out += 1
            self.sent += 1
            yield _Item(row.id, row.values, messages, 0), messages
        while True:
            while retries:
                item = retries.popleft()
                yield item, item.messages
            if self.out == 0:
                return
            self.retry_ready.clear()
            await self.retry_ready.wait()

    async def _put_ready(self, record: dict[str, Any]) -> None:
        """Hand a record to the consumer; wait while it has many to write."""
        self.ready.append(record)
        self._wake.set()
        if len(self.ready) >= _READY_LIMIT:
            self._drained.clear()
            await self._drained.wait()

    def _conclude(self, item: _Item, response: Response) -> None:
        """Write the row's record, or send it again for a better answer."""
        # Every answer's tokens count, regenerated ones too: what the servers generated
        # for this run. The bar's and report.json's rates are both this one figure.
        self.progress.add_tokens(response.num_output_tokens or 0)
        self.prompt_tokens += response.num_prompt_tokens or 0
        parsed = None
        if self.schema is not None and response.ok:
            parsed = self.schema.parse(response.text, response.finish_reason)
            if not parsed.valid:
                if item.attempt < self.regenerate:
                    item.attempt += 1
                    self.regenerated += 1
                    self.retries.append(item)
                    self.retry_ready.set()
                    return
                response = _invalid(response, parsed.error, parsed.kind)
        self.out -= 1
        if self.out == 0:
            self.retry_ready.set()  # the stream of items may end now
        record = self.builder.build(item.id, item.values, response, parsed)
        self._write(record, failed=not response.ok)

    def _write(self, record: dict[str, Any], *, failed: bool) -> None:
        self.store.append(record)
        self.progress.add(failed=int(failed))


def _invalid(response: Response, error: str | None, kind: Any) -> Response:
    """The Response as an error row that keeps the raw text."""
    return dataclasses.replace(
        response,
        error=error or "the answer does not follow the output_schema",
        error_type=str(kind) if kind is not None else "invalid_output",
    )


def _varies(options: Any, gen_kwargs: dict[str, Any] | None) -> bool:
    """Whether generating again can give another answer (no fixed seed)."""
    seed = (gen_kwargs or {}).get("seed", getattr(options, "seed", None))
    return seed is None


def _check_columns(
    source: RowSource, template: PromptTemplate, columns: Sequence[str] | None
) -> None:
    if source.columns is None:
        return
    template.check_columns(source.columns, source.description)
    if columns is not None:
        unknown = [c for c in columns if c not in source.columns]
        if unknown:
            raise InputError(
                f"{source.description}: columns to keep {unknown} are not in the input; "
                f"its columns are {list(source.columns)}"
            )


def _is_seconds(value: object) -> bool:
    """A number of seconds >= 0 (infinity included)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


async def _model_of(client: Client[Any]) -> str | None:
    """The model the job runs on, for the fingerprint."""
    if isinstance(client, ModelSource):
        return await client.aresolve_model()
    model = getattr(client, "model", None)
    return model if isinstance(model, str) else None


def _hedged(client: Client[Any]) -> int:
    """Duplicate requests the pool sent to shorten the tail (first answer kept)."""
    return client.statistics().hedged if isinstance(client, Streamer) else 0


def _healthy(client: Client[Any]) -> int:
    return client.statistics().healthy if isinstance(client, Streamer) else 1


async def _open_store(spec: JobSpec, fingerprint: dict[str, Any]) -> ResultStore:
    """Open the run's store in a thread; if the job is cancelled meanwhile (a signal),
    the store is still closed, so that its lock and empty shard do not linger."""
    opening = asyncio.ensure_future(
        asyncio.to_thread(
            ResultStore.open,
            spec.output_dir,
            fingerprint,
            force=spec.force,
            retry_errors=spec.retry_errors,
        )
    )
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            store = await opening
            await asyncio.to_thread(store.close)
        raise


def _report(
    job: _Job, result: Any, total: int, resumed: int, seconds: float, client: Client[Any]
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
        "rows": result.num_rows,
        "input_rows": total,
        "succeeded": result.num_succeeded,
        "failed": result.num_failed,
        "by_finish_reason": result.by_finish_reason,
        "by_error_type": result.by_error_type,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": result.output_tokens,
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


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(orjson.dumps(value, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(temporary, path)
