"""The job loop: rows out to the model, records into the store, regenerations back in."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from typing import Any, Protocol

import orjson

from llm_annotator.clients.base import Client, Messages
from llm_annotator.errors import ConfigurationError, ErrorKind, PromptError
from llm_annotator.jobs.answers.records import RecordBuilder
from llm_annotator.jobs.answers.schema import OutputSchema, Parsed
from llm_annotator.jobs.ids import CONTENT_FIELD, RowId, content_text
from llm_annotator.jobs.loop.interrupt import Interrupt
from llm_annotator.jobs.loop.streaming import stream
from llm_annotator.jobs.rows.inputs import Row
from llm_annotator.jobs.rows.prompts import PromptTemplate, build_messages
from llm_annotator.jobs.rundir.store import ResultStore
from llm_annotator.jobs.spec import Postprocess, Validate
from llm_annotator.jobs.watch.progress import Progress
from llm_annotator.response import Response


class _Item:
    """One row on its way through the model (the key of the stream)."""

    __slots__ = ("attempt", "content", "id", "messages", "unit", "values")

    def __init__(
        self,
        row_id: RowId,
        values: dict[str, Any],
        messages: Messages,
        attempt: int,
        unit: int | None = None,
        content: str = "",
    ) -> None:
        self.id = row_id
        self.values = values
        self.messages = messages
        self.attempt = attempt
        self.unit = unit
        self.content = content
        """The row's content hash as its record holds it (see :meth:`Row.content`)."""


class Sink(Protocol):
    """Where a run's records go: a store that keeps the rows of a corpus's units apart
    (:class:`~llm_annotator.jobs.rundir.partitions.PartitionedStore`), or one store."""

    def take(self, row: Row) -> bool:
        """Whether ``row`` is still to be done (it has no result yet)."""

    def append(self, record: Mapping[str, Any], unit: int | None) -> None:
        """Write the record of a row of ``unit``."""

    def flush(self) -> None: ...

    def sync(self) -> None: ...


class OneStore:
    """One :class:`ResultStore` as a run's :class:`Sink`."""

    __slots__ = ("store",)

    def __init__(self, store: ResultStore) -> None:
        self.store = store

    def take(self, row: Row) -> bool:
        return not self.store.is_done(row.id)

    def append(self, record: Mapping[str, Any], unit: int | None) -> None:
        self.store.append(record)

    def flush(self) -> None:
        self.store.flush()

    def sync(self) -> None:
        self.store.sync()


_READY_LIMIT = 4096
"""Records of rows that need no request (unreadable rows, templates that fail) held
for the consumer at most; the input waits beyond that."""
_BUGGY_CHECK = 20
"""Answers a ``validate`` check may refuse, all with the same exception and none
accepted, before the job takes it for a bug in the check and stops."""
_ANSWERS_LIMIT = 4096
"""Answers held for the consumer at most (while it syncs the store, say); beyond that
the pump stops reading the stream, and the pool stops taking rows."""


@dataclasses.dataclass(frozen=True, slots=True)
class Cadence:
    """How a run paces itself: batches for a client that does not stream (the pool
    does, and ignores both), and how often its records are flushed and synced."""

    batch_size: int
    max_concurrent_batches: int
    flush_interval: float
    sync_interval: float


class JobRun:
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
        client: Client[Any],
        cadence: Cadence,
        rows: Iterator[Row] | AsyncIterator[Row | None],
        template: PromptTemplate,
        system_message: str | None,
        group_by: str | None = None,
        builder: RecordBuilder,
        schema: OutputSchema | None,
        store: ResultStore | Sink,
        validate: Validate | None = None,
        postprocess: Postprocess | None = None,
        regenerate: int,
        progress: Progress,
    ) -> None:
        self.client = client
        self.cadence = cadence
        self.rows = rows
        self.template = template
        self.system_message = system_message
        self.group_by = group_by
        self.builder = builder
        self.schema = schema
        self.validate = validate
        self.postprocess = postprocess
        self.store = store
        self.sink: Sink = OneStore(store) if isinstance(store, ResultStore) else store
        self.regenerate = regenerate
        self.progress = progress
        self.retries: deque[_Item] = deque()
        """Regenerations, owned by the job: the requests send them first."""
        self.retry_ready = asyncio.Event()
        self.ready: deque[tuple[dict[str, Any], int | None]] = deque()
        """Error records of rows that were never sent, for the consumer to write."""
        self.answers: deque[tuple[_Item, Response]] = deque()
        self._wake = asyncio.Event()
        self._drained = asyncio.Event()
        self._answers_taken = asyncio.Event()
        self._stream_over = False
        self._failure: Exception | None = None
        self.out = 0
        """Items handed to the model and not yet concluded."""
        self.sent = 0
        self.regenerated = 0
        self.prompt_tokens = 0
        self.accepted = 0
        """Answers the ``validate`` check accepted."""
        self.refusals: dict[str, int] = {}
        """Refusals by exception type before the check accepted any answer."""

    async def run(
        self, options: Any, gen_kwargs: dict[str, Any] | None, interrupt: Interrupt
    ) -> None:
        cadence = self.cadence
        results = stream(
            self.client,
            self._requests(),
            options=options,
            gen_kwargs=gen_kwargs,
            stop=interrupt.stop,
            batch_size=cadence.batch_size,
            max_concurrent_batches=cadence.max_concurrent_batches,
            group=self._group,
            warmup=self._warmup(),
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
                    if len(self.answers) >= _ANSWERS_LIMIT:
                        self._answers_taken.clear()
                        await self._answers_taken.wait()
        except Exception as exc:  # PoolExhaustedError, a failed input: the job's to raise
            self._failure = exc
        finally:
            self._stream_over = True
            self._wake.set()

    async def _consume(self) -> None:
        """Write every record, in the job's task, until the stream is over.

        Records are flushed every ``flush_interval`` and synced every ``sync_interval``
        seconds, also when no answer comes for a while (a timer wakes the consumer): what
        a job has written is on disk for ``status`` and ``report`` to read, and is not
        redone after a crash, however long the servers then stay quiet.
        """
        cadence, store = self.cadence, self.sink
        answers, ready = self.answers, self.ready
        flushed = synced = time.monotonic()
        dirty = unsynced = False
        timer: asyncio.TimerHandle | None = None
        timer_due = math.inf
        loop = asyncio.get_running_loop()

        def wake_to_write() -> None:
            nonlocal timer
            timer = None
            self._wake.set()

        try:
            while True:
                while ready or answers:
                    while ready:
                        record, unit = ready.popleft()
                        self._write(record, unit, failed=True)
                    self._drained.set()
                    while answers:
                        item, response = answers.popleft()
                        self._conclude(item, response)
                    self._answers_taken.set()
                    dirty = unsynced = True
                now = time.monotonic()
                if dirty and now - flushed >= cadence.flush_interval:
                    store.flush()
                    flushed, dirty = now, False
                if unsynced and not dirty and now - synced >= cadence.sync_interval:
                    await asyncio.to_thread(store.sync)
                    synced, unsynced = time.monotonic(), False
                    if ready or answers:
                        continue  # they came during the sync: write them first
                if self._stream_over:
                    if self._failure is not None:
                        raise self._failure
                    return
                self._wake.clear()
                if dirty or unsynced:
                    # Wake for the next flush (or, with everything flushed, the next
                    # sync: a sync follows a flush); a timer set for a later sync is
                    # moved up to the flush.
                    if dirty:
                        due = flushed + cadence.flush_interval
                    else:
                        due = synced + cadence.sync_interval
                    if timer is None or due < timer_due:
                        if timer is not None:
                            timer.cancel()
                        timer_due = due
                        delay = min(max(0.0, due - now), 3600.0)
                        timer = loop.call_later(delay, wake_to_write)
                await self._wake.wait()
        finally:
            if timer is not None:
                timer.cancel()

    def _group(self, item: _Item) -> int | None:
        """The group of a request, for prefix affinity: a hash of the ``group_by``
        column's value, or else of the template's first field's (the end of the
        prompt's first row-specific part); None (a group of its own) for a row
        without a value there."""
        value = item.values.get(self.group_by or self.template.fields[0])
        return None if value is None else hash(str(value))

    def _warmup(self) -> Messages | None:
        """The conversation of the prompts' shared prefix (the system message and the
        template's text before its first field), or None if there is none to cache."""
        head = self.template.head
        if not head.strip() and not self.system_message:
            return None
        return build_messages(head, self.system_message)

    async def _requests(self) -> AsyncIterator[tuple[_Item, Messages]]:
        """Rows not done yet, as prompts; regenerations go first. Rows that need no
        request become records for the consumer (never written here)."""
        sink, retries = self.sink, self.retries
        scanned = 0
        rows = self.rows if isinstance(self.rows, AsyncIterator) else _async(self.rows)
        async for row in rows:
            scanned += 1
            if scanned % 4096 == 0:
                await asyncio.sleep(0)  # a long run of done rows must not starve the loop
            while retries:
                item = retries.popleft()
                yield item, item.messages
            if row is None:  # no row yet (a worker waiting for a unit): regenerations go
                continue
            if not sink.take(row):
                continue
            content = content_text(row.content())
            if row.error is not None:
                record = self.builder.error_record(row.id, {}, row.error)
                await self._put_ready(record, row, content)
                continue
            try:
                prompt = self.template.render(row.values, row.where)
            except PromptError as exc:
                record = self.builder.error_record(row.id, row.values, str(exc))
                await self._put_ready(record, row, content)
                continue
            problem = self._unsendable(row, prompt)
            if problem is not None:  # found before sending: this row's error, not the job's
                values = {k: v for k, v in row.values.items() if k not in problem[1]}
                record = self.builder.error_record(row.id, values, problem[0])
                await self._put_ready(record, row, content)
                continue
            messages = build_messages(prompt, self.system_message)
            self.out += 1
            self.sent += 1
            yield _Item(row.id, row.values, messages, 0, row.unit, content), messages
        while True:
            while retries:
                item = retries.popleft()
                yield item, item.messages
            if self.out == 0:
                return
            self.retry_ready.clear()
            await self.retry_ready.wait()

    def _unsendable(self, row: Row, prompt: str) -> tuple[str, frozenset[str]] | None:
        """Why ``row`` cannot be sent and stored, and the columns at fault, or None: a
        value its record keeps that cannot be written (see
        :meth:`RecordBuilder.unstorable`), or a prompt that is not valid Unicode."""
        bad = self.builder.unstorable(row.values)
        if bad:
            listed = "; ".join(
                f"column {name!r}: {why}" if name else why for name, why in bad.items()
            )
            return (
                f"{row.where}: a value cannot be stored ({listed}); fix the input (text "
                "must be valid Unicode, values JSON: strings, numbers, lists, objects)",
                frozenset(bad),
            )
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            return (
                f"{row.where}: the prompt holds text that is not valid Unicode (a lone "
                "surrogate, as undecodable bytes become); fix the input",
                frozenset(),
            )
        return None

    async def _put_ready(self, record: dict[str, Any], row: Row, content: str) -> None:
        """Hand a row's record to the consumer; wait while it has many to write."""
        record[CONTENT_FIELD] = content
        self.ready.append((record, row.unit))
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
        if self.validate is not None and response.ok and (parsed is None or parsed.valid):
            parsed = self._validated(item, response, parsed)
        if self.postprocess is not None and response.ok and (parsed is None or parsed.valid):
            parsed = self._postprocessed(item, response, parsed)
        if parsed is not None and not parsed.valid:
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
        record[CONTENT_FIELD] = item.content
        self._write(record, item.unit, failed=not response.ok)

    def _validated(self, item: _Item, response: Response, parsed: Parsed | None) -> Parsed:
        """The user's check of one answer, as a :class:`Parsed` (its values joined to the
        schema's); an exception it raises makes the answer invalid.

        Raises:
            ConfigurationError: What the check returned cannot be a row's columns (not
                JSON-able, or a key that names a column), or it refused every one of the
                first answers with the same exception: a bug in the check, not bad
                answers. The rows written so far are kept.
        """
        assert self.validate is not None
        try:
            value = self.validate(response.text or "")
        except Exception as error:  # the user's check refused it: any exception says so
            self._note_refusal(error)
            message = f"validate refused the answer: {type(error).__name__}: {error}"
            return Parsed(
                values=self.builder.empty_validated(parsed),
                valid=False,
                error=message[:500],
                kind=ErrorKind.INVALID_OUTPUT,
            )
        return self._accepted(value, parsed, item, "validate")

    def _postprocessed(self, item: _Item, response: Response, parsed: Parsed | None) -> Parsed:
        """The user's ``postprocess`` hook on one accepted answer, as a :class:`Parsed`
        (its columns joined to the answer's); an exception it raises makes the answer
        invalid, as a ``validate`` refusal does.

        Raises:
            ConfigurationError: It returned something other than a dict or None, or
                columns that cannot be written (see :meth:`_validated`).
        """
        assert self.postprocess is not None
        answer = dict(parsed.values) if parsed is not None else response.text
        try:
            added = self.postprocess(dict(item.values), answer)
        except Exception as error:  # the user's hook refused it: any exception says so
            self._note_refusal(error, "postprocess")
            message = f"postprocess failed on the answer: {type(error).__name__}: {error}"
            return Parsed(
                values=dict(parsed.values) if parsed is not None else {},
                valid=False,
                error=message[:500],
                kind=ErrorKind.INVALID_OUTPUT,
            )
        if added is None:
            added = {}
        if not isinstance(added, Mapping):
            raise ConfigurationError(
                f"postprocess returned {type(added).__name__} for row {item.id!r}; it "
                "returns a dict of columns to add, or None"
            )
        return self._accepted(dict(added), parsed, item, "postprocess")

    def _accepted(self, value: Any, parsed: Parsed | None, item: _Item, check: str) -> Parsed:
        """What a user's ``check`` made of an answer it accepted, as the row's columns.

        Raises:
            ConfigurationError: They cannot be a row's columns (a key that names a
                column, a value that is not JSON).
        """
        self.accepted += 1
        values = self.builder.validated(value, parsed, item.values, check)
        try:
            orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as error:
            raise ConfigurationError(
                f"{check} returned a value for row {item.id!r} that cannot be written as "
                f"JSON ({error}): return dicts, lists, strings, numbers, booleans or None"
            ) from None
        return Parsed(values=values, valid=True)

    def _note_refusal(self, error: Exception, check: str = "validate") -> None:
        """Stop the job when the check has refused every answer so far, each time with
        the same kind of exception, ``_BUGGY_CHECK`` times."""
        if self.accepted:
            return
        kind = type(error).__name__
        self.refusals[kind] = self.refusals.get(kind, 0) + 1
        if len(self.refusals) == 1 and self.refusals[kind] >= _BUGGY_CHECK:
            raise ConfigurationError(
                f"{check} refused each of the first {_BUGGY_CHECK} answers with {kind} "
                f"({error}); that looks like a bug in the check rather than bad answers. "
                "Try it on a few answers by hand (a trial with --limit), fix it, and run the "
                "same command again: the rows written are kept."
            ) from error

    def _write(self, record: dict[str, Any], unit: int | None, *, failed: bool) -> None:
        self.sink.append(record, unit)
        self.progress.add(
            failed=int(failed),
            server=record.get("server"),
            error_type=record.get("error_type") if failed else None,
        )


def _invalid(response: Response, error: str | None, kind: Any) -> Response:
    """The Response as an error row that keeps the raw text."""
    return dataclasses.replace(
        response,
        error=error or "the answer does not follow the output_schema",
        error_type=str(kind) if kind is not None else "invalid_output",
    )


async def _async(rows: Iterator[Row]) -> AsyncIterator[Row | None]:
    """A reader's rows, as the job's loop takes them."""
    for row in rows:
        yield row


def varies(options: Any, gen_kwargs: dict[str, Any] | None) -> bool:
    """Whether generating again can give another answer (no fixed seed)."""
    seed = (gen_kwargs or {}).get("seed", getattr(options, "seed", None))
    return seed is None
