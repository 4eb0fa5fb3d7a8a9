"""A corpus job: many input files, read unit by unit, into a partitioned output.

:func:`annotate_corpus` is what :meth:`~llm_annotator.jobs.annotate.Annotator.annotate`
runs when ``data`` names a corpus (a directory, a glob, several paths, a
``save_to_disk`` folder; :func:`~llm_annotator.jobs.rows.corpus.is_corpus`). One job
loop streams the rows of the process's units one after the other, so the servers never
wait at a unit's end; each row's record goes to its unit's store, and each unit, once
all its rows are written, becomes ``RUN_DIR/annotations/<unit>.parquet``
(:mod:`llm_annotator.jobs.rundir.partitions`). Nothing is read before the first
request but the listing, and the footers of this process's Parquet units (their row
counts, for the progress); a finished unit is skipped on resume without being read.

With ``shard=(i, n)`` the process takes the units the split rule gives shard ``i``
(:mod:`llm_annotator.jobs.shards.split`), keeping its status, timeline and report in
``RUN_DIR/shard-IIII-of-NNNN``; whichever shard finishes the last unit writes the
manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from llm_annotator._validate import size_in_bytes
from llm_annotator.clients.base import Client
from llm_annotator.errors import (
    ConfigurationError,
    FingerprintMismatchError,
    InputError,
    JobError,
    RunDirectoryError,
)
from llm_annotator.jobs.answers.records import RecordBuilder
from llm_annotator.jobs.answers.schema import OutputSchema
from llm_annotator.jobs.files import check_entry, make_directory
from llm_annotator.jobs.loop.driver import Finished, Prepared, Rows, Runner, run_job
from llm_annotator.jobs.loop.interrupt import Interrupt
from llm_annotator.jobs.loop.runner import JobRun
from llm_annotator.jobs.protocols import MemberWatchable, SharesServers, SuspectsServers
from llm_annotator.jobs.result import AnnotationResult
from llm_annotator.jobs.rows.corpus import (
    FILE_COLUMN,
    UNIT_BYTES,
    Corpus,
    Unit,
    UnitFeed,
    list_corpus,
)
from llm_annotator.jobs.rows.inputs import Row
from llm_annotator.jobs.rows.prompts import PromptTemplate, check_job_columns
from llm_annotator.jobs.rundir.claims import LEASE, Claims
from llm_annotator.jobs.rundir.fingerprint import describe_changes, job_fingerprint
from llm_annotator.jobs.rundir.fleet import (
    Fleet,
    fleet_lease,
    keep_share,
    share_evictions,
    worker_slot,
)
from llm_annotator.jobs.rundir.partitions import (
    ANNOTATIONS_DIR,
    CORPUS_FILE,
    PartitionedStore,
    UnitCounts,
    read_corpus_record,
    write_corpus_record,
    write_manifest,
)
from llm_annotator.jobs.rundir.store import JOB_FILE, DirectoryLock, output_write_error
from llm_annotator.jobs.shards.merge import remove_corpus_leftovers
from llm_annotator.jobs.shards.shard import Shard, claim, not_sharded, read_sharding
from llm_annotator.jobs.shards.split import SPLIT_RULE, units_of_shard
from llm_annotator.jobs.spec import JobSpec, retry_choice
from llm_annotator.jobs.watch.progress import Progress
from llm_annotator.jobs.watch.status import StatusFile

log = structlog.get_logger(__name__)

CLAIM = "claim"
"""``shard="claim"``: take the corpus's units by claims, as any number of workers."""
_MODES = {
    "whole": "in one process",
    "shards": "in static shards (--shard INDEX/COUNT)",
    CLAIM: "by claims (--shard claim)",
}
_LISTED_CHANGES = 10
"""Changed files named one by one when a corpus is refused on resume."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one process of a corpus job does, decided before its first request."""

    corpus: Corpus
    units: list[Unit]
    """The units this process takes (all, for a worker that claims them)."""
    builder: RecordBuilder
    template: PromptTemplate
    schema: OutputSchema | None
    fingerprint: dict[str, Any]
    retry: bool | frozenset[str]
    status_dir: Path
    """Where this process keeps its status, timeline and report."""
    claims: Claims | None
    started: float
    feed: UnitFeed | None = None
    """The corpus as a pipeline's step takes it: its worker leaves when it can take no
    unit now, and a growing feed's files are written as they are claimed."""


async def annotate_corpus(runner: Runner, spec: JobSpec, interrupt: Interrupt) -> AnnotationResult:
    """Annotate the corpus ``spec.data`` into ``spec.output_dir`` (see the module).

    Raises:
        InputError: The corpus cannot be listed, a file of it is unreadable (without
            ``skip_bad_files``), a file changed since the run began, or the template
            names a column the first unit lacks.
        ConfigurationError: An option a corpus job does not take (``limit``,
            ``write_jsonl``), or the directory holds another kind of job, or the same
            corpus run in another mode (whole, static shards, claims).
        FingerprintMismatchError: The directory holds the corpus job with other settings.
        RunInterruptedError: A signal stopped the job; every row written is kept.
    """
    started = time.monotonic()
    _refuse_options(spec)
    template = PromptTemplate(spec.prompt_template)
    raw_schema = getattr(spec.options, "output_schema", None)
    schema = OutputSchema(raw_schema) if raw_schema is not None else None
    retry = retry_choice(spec.retry_errors)
    spec.hook_names()  # refuses a hook that is not callable
    claiming = isinstance(spec.shard, str) and spec.shard.strip() == CLAIM
    feed = spec.data if isinstance(spec.data, UnitFeed) else None
    if feed is not None:
        if not claiming:
            raise ConfigurationError("a unit feed is taken by claims: give shard='claim'")
        if not feed.growing:
            spec = dataclasses.replace(spec, data=feed.data)
    shard = None if claiming else Shard.of(spec.shard)
    mode = CLAIM if claiming else "shards" if shard is not None else "whole"
    lease = _lease(spec.claim_lease)
    run_dir = spec.output_dir
    recorded = await asyncio.to_thread(_recorded, run_dir)
    unit_bytes, split_lines = _cutting(recorded, spec, shard)
    if feed is not None and feed.growing:
        corpus = feed.listed()
    else:
        corpus = await asyncio.to_thread(
            list_corpus,
            spec.data,
            skip_bad_files=spec.skip_bad_files,
            unit_bytes=unit_bytes,
            split_lines=split_lines,
        )
    log.info(
        "corpus_listed",
        corpus=corpus.description,
        files=len(corpus.files),
        units=len(corpus.units),
        bytes=corpus.size,
        skipped=len(corpus.skipped),
        mode=mode,
    )
    if recorded is not None:
        _check_unchanged(corpus, recorded["corpus"], run_dir)
    units = list(corpus.units) if shard is None else units_of_shard(corpus.units, *_pair(shard))
    builder = RecordBuilder(
        schema, spec.columns, validate=spec.checks_answers, reserved=(FILE_COLUMN,)
    )
    model = await runner.model()
    fingerprint = job_fingerprint(spec, model, **spec.hook_names())
    if shard is None:  # before anything is written: a sharded directory is refused as it is
        await asyncio.to_thread(not_sharded, run_dir)
    await asyncio.to_thread(_record, run_dir, recorded, fingerprint, corpus, mode, spec.force)
    claims = None
    if shard is not None:
        await asyncio.to_thread(
            claim, run_dir, shard, {**fingerprint, "corpus": corpus.digest()}, force=spec.force
        )
        status_dir = shard.directory(run_dir)
    else:
        if claiming:
            slot = worker_slot(os.environ)
            owner = feed.owner if feed is not None else None
            claims = await asyncio.to_thread(
                functools.partial(Claims, run_dir, lease, slot=slot, owner=owner)
            )
            status_dir = run_dir / f"worker-{claims.owner.replace(':', '-')}"
        else:
            status_dir = run_dir
    try:  # the job's own folder: a link planted under its name is refused
        await asyncio.to_thread(make_directory, status_dir)
    except OSError as error:
        raise output_write_error(error, status_dir, run_dir) from None
    lock = await asyncio.to_thread(DirectoryLock.acquire, status_dir, "annotate")
    plan = _Plan(
        corpus,
        units,
        builder,
        template,
        schema,
        fingerprint,
        retry,
        status_dir,
        claims,
        started,
        feed,
    )
    try:
        return await _run(runner, spec, interrupt, plan)
    finally:
        lock.release()


def _cutting(
    recorded: dict[str, Any] | None, spec: JobSpec, shard: Shard | None
) -> tuple[int, bool]:
    """How the corpus's files are cut into units: the size and whether JSONL files are
    cut into byte ranges (only with an id column). A run keeps what it began with (a
    run begun before JSONL files were cut keeps them whole)."""
    asked = _unit_bytes(spec, shard)
    if recorded is None:
        return asked, spec.id_column is not None
    listing = recorded["corpus"]
    size = int(listing.get("unit_bytes", UNIT_BYTES))
    if spec.unit_size is not None and asked != size:
        log.warning("unit_size_kept", asked=asked, kept=size, why="the run began with it")
    split = bool(listing.get("split_lines", False))
    if split and spec.id_column is None:
        raise ConfigurationError(
            "this run cut its large JSONL files into byte ranges, whose rows need an id "
            "column (a range does not know its rows' positions): give the id column it "
            "began with (--id-column), or run in a new output directory"
        )
    return size, split


SHARD_UNIT_MIN = 256 << 10
"""The smallest unit a static shard of one file cuts it into by itself (``--unit-size``
cuts smaller): below it, reading the whole file costs each shard less than bookkeeping
units does."""


def _unit_bytes(spec: JobSpec, shard: Shard | None) -> int:
    """The unit size asked for: ``unit_size``, or for static shards of one file a
    quarter of a shard's share of it (so that shard ``i`` of ``n`` reads about ``1/n``
    of the file, in units small enough to balance), between :data:`SHARD_UNIT_MIN` and
    :data:`~llm_annotator.jobs.rows.corpus.UNIT_BYTES`."""
    if spec.unit_size is not None:
        return size_in_bytes("unit_size", spec.unit_size)
    if shard is None or not isinstance(spec.data, str | os.PathLike):
        return UNIT_BYTES
    try:
        size = os.stat(spec.data).st_size
    except OSError:
        return UNIT_BYTES  # the listing says what is wrong with it
    share = -(-size // (4 * shard.count))
    return min(UNIT_BYTES, max(SHARD_UNIT_MIN, share))


def runs_as_units(spec: JobSpec) -> bool:
    """Whether a job over one input file runs as a corpus of units (this module)
    rather than as one store: with claims (``shard="claim"``) always; in a run
    directory that holds a corpus job (it resumes as it began, or says why not); and
    with static shards when the file cuts into more than one byte range (a large
    uncompressed JSONL file with an id column), so that each shard reads about its
    share of the file, not all of it. A run directory of a one-file job keeps
    its layout; so does a job the corpus does not take (``limit``, ``write_jsonl``).
    """
    run_dir = spec.output_dir
    if isinstance(spec.shard, str) and spec.shard.strip() == CLAIM:
        return True
    shard = Shard.of(spec.shard)
    try:
        sharding = read_sharding(run_dir)
        if sharding is not None and "corpus" not in sharding.get("fingerprint", {}):
            return False  # shards of one store, split by id: it goes on that way
        if check_entry(run_dir / CORPUS_FILE):
            return True
        if shard is None or spec.write_jsonl or spec.limit is not None:
            return False
        if check_entry(run_dir / JOB_FILE):
            return False  # begun as one store: it goes on that way
    except (OSError, RunDirectoryError):
        return False  # the one-file job says what is wrong with the run directory
    try:
        corpus = list_corpus(
            spec.data,
            unit_bytes=_unit_bytes(spec, shard),
            split_lines=spec.id_column is not None,
        )
    except InputError:
        return False  # the one-file job says what is wrong with it
    # Byte ranges only: a Parquet file's one-store shards read just its id column to
    # split it, and check its ids whole before the first request, which units cannot.
    return len(corpus.units) > 1 and all(unit.span is not None for unit in corpus.units)


def _pair(shard: Shard) -> tuple[int, int]:
    return shard.index, shard.count


def _lease(value: Any) -> float:
    if value is None:
        return LEASE
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigurationError(f"claim_lease must be a number of seconds > 0, got {value!r}")
    return float(value)


class _CorpusLayout:
    """A corpus job's rows and results for the driver: its units' rows, one after the
    other (or as this worker claims them), into a store of one file per unit."""

    def __init__(
        self,
        spec: JobSpec,
        plan: _Plan,
        store: PartitionedStore,
        todo: list[Unit],
        known: list[int | None],
        before: UnitCounts,
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.run_dir = spec.output_dir
        self.status_dir = plan.status_dir
        self.store = store
        self.todo = todo
        self.known = known
        self.before = before
        self.resumed = before.counts["rows"]
        self.total = self.resumed + sum(count for count in known if count is not None)

    def rows(self, job: JobRun, progress: Progress, status: StatusFile) -> Rows:
        estimate = _Estimate(self.todo, self.known, progress, status, base=self.resumed)
        claims = self.plan.claims
        if claims is None:
            return _rows(self.todo, self.store, self.spec, estimate)
        # a worker's rows also hand the loop its regenerations while it waits
        first = functools.partial(_check_written, template=self.plan.template, spec=self.spec)
        return _claimed_rows(
            self.todo, self.store, claims, self.spec, estimate, job, self.plan.feed, first
        )

    def said(self) -> dict[str, Any]:
        units = self.plan.units
        exact = all(count is not None for count in self.known)
        return {
            "input": self.plan.corpus.description,
            "files": len(self.plan.corpus.files),
            "units": len(units),
            "units_done": len(units) - len(self.todo),
            "rows": self.total if exact else None,
        }

    @contextlib.asynccontextmanager
    async def running(self, client: Client[Any]) -> AsyncIterator[None]:
        claims = self.plan.claims
        if claims is None:
            yield
            return
        beside = [asyncio.ensure_future(_renew(self.store, claims))]
        sharing = isinstance(client, SharesServers)
        lease = fleet_lease(claims.lease)
        feed = self.plan.feed
        fleet = Fleet(
            self.run_dir,
            claims.owner,
            claims.slot,
            claims.machine,
            lease,
            folder=feed.fleet if feed is not None else None,
            stays=feed is not None and feed.owner is not None,  # it comes back: a turn
        )
        if isinstance(client, SharesServers):  # its share of the servers, among the fleet
            busy = functools.partial(_holds_units, self.store)
            beside.append(asyncio.ensure_future(keep_share(fleet, busy, client.share_servers)))
        stop_watching = None
        if isinstance(client, SuspectsServers) and isinstance(client, MemberWatchable):
            changes: list[tuple[str, str, str | None]] = []
            stop_watching = client.watch_members(
                lambda change: changes.append((change.server, change.after, change.reason))
            )
            told = functools.partial(_taken, changes)
            evictions = share_evictions(fleet, told, client.suspect_server)
            beside.append(asyncio.ensure_future(evictions))
        try:
            yield
        finally:
            if stop_watching is not None:
                stop_watching()
            for task in beside:  # stopped before the store closes: no renewal meets a close
                task.cancel()
            for task in beside:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if sharing and isinstance(client, SharesServers):
                client.share_servers(1)  # the pool outlives the job: its whole budget back

    async def drain(self) -> None:
        await self.store.drain()

    def close(self) -> None:
        self.store.close()

    async def finish(self, job: JobRun, progress: Progress) -> Finished:
        """The manifest; once it is complete, what killed workers left goes."""
        store, plan, run_dir = self.store, self.plan, self.run_dir
        this = UnitCounts()
        if plan.claims is None:  # this process's part: the units it was given
            for unit in plan.units:
                record = store.records.get(unit.output_name)
                if record is not None:
                    this.add(record)
        else:  # a worker's: the units it finished
            this = store.finished_now
        listing = plan.corpus.listing()
        manifest = await asyncio.to_thread(write_manifest, run_dir, listing)
        if manifest["complete"]:  # no unit is written any more
            try:
                await asyncio.to_thread(remove_corpus_leftovers, run_dir, set(listing["units"]))
            except (OSError, JobError) as error:  # the annotations are whole all the same
                log.warning("leftovers_not_removed", output_dir=str(run_dir), error=str(error))
            await asyncio.to_thread(_check_ranges_ids, plan.corpus, run_dir / ANNOTATIONS_DIR)
        output = run_dir / ANNOTATIONS_DIR
        units = {"total": len(plan.units), "done": this.units, "done_before": self.before.units}
        return Finished(
            result=this.consolidated(output),
            output_path=output,
            merged_path=output if manifest["complete"] else None,
            report={"units": units},
            said={"units": this.units, "corpus_complete": manifest["complete"]},
        )

    async def after(self, result: AnnotationResult) -> AnnotationResult:
        return result


async def _run(
    runner: Runner, spec: JobSpec, interrupt: Interrupt, plan: _Plan
) -> AnnotationResult:
    store = await asyncio.to_thread(
        PartitionedStore,
        spec.output_dir,
        plan.fingerprint,
        retry_errors=plan.retry,
        force=spec.force,
        column_order=plan.builder.output_columns(),
        types=_schema_types(plan.schema),
        claims=plan.claims,
    )
    units = plan.units
    todo = [unit for unit in units if not store.is_finished(unit)]
    if plan.claims is None:
        todo, known = await asyncio.to_thread(_survey, todo, store, spec)
    else:  # each unit is looked at when claimed: a worker reads only what it takes
        known = [None] * len(todo)
    if todo and (plan.feed is None or not plan.feed.growing):  # else as it is written
        try:
            await asyncio.to_thread(_check_columns, todo[0], plan.template, spec)
        except InputError as error:
            if not spec.skip_bad_files or "cannot read" not in str(error):
                raise  # a template field or a column to keep that the input lacks
            log.warning("columns_not_checked", unit=todo[0].name, reason=str(error))
    before = UnitCounts()
    for unit in units:
        if store.is_finished(unit) and unit not in todo:
            before.add(store.records[unit.output_name])
    layout = _CorpusLayout(spec, plan, store, todo, known, before)
    prepared = Prepared(plan.template, plan.schema, plan.builder, plan.started)
    return await run_job(runner, spec, interrupt, layout, prepared)


def _check_ranges_ids(corpus: Corpus, output: Path) -> None:
    """Refuse, naming them, ids that stand in more than one byte range of a file: each
    range checks its own ids as it is read, but only the whole output knows them all.

    Raises:
        InputError: An id of a file cut into byte ranges is in two of them.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    ranges: dict[str, list[Unit]] = {}
    for unit in corpus.units:
        if unit.span is not None:
            ranges.setdefault(unit.file.name, []).append(unit)
    for name, units in ranges.items():
        columns = [
            pq.read_table(output / unit.output_name, columns=["id"]).column("id")
            for unit in units
            if (output / unit.output_name).exists()
        ]
        if not columns:
            continue
        try:
            ids = pa.chunked_array([chunk for column in columns for chunk in column.chunks])
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            raise InputError(
                f"{name}: its ids are of different types in different byte ranges (numbers "
                "in some, strings in others), which each range could not see: give ids of "
                "one type, and run it again in a new output directory"
            ) from None
        counts = pc.value_counts(ids)
        repeated = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
        if len(repeated):
            shown = ", ".join(repr(value) for value in repeated[:3].to_pylist())
            log.error("ids_repeated_across_ranges", file=name, ids=len(repeated))
            raise InputError(
                f"{name}: {len(repeated)} ids stand in more than one of its byte ranges "
                f"({shown}); ids must be unique within a file, and each range could check only "
                "its own. Each such row was annotated once per range: fix the input's ids and "
                "run it again in a new output directory"
            )


async def _renew(store: PartitionedStore, claims: Claims) -> None:
    """Renew the leases of the units this worker holds, every third of a lease; a
    renewal that fails (the file system stalls) is tried again at the next turn."""
    while True:
        await asyncio.sleep(claims.lease / 3)
        for held in store.held():
            try:
                still = await asyncio.to_thread(claims.renew, held)
            except OSError as error:
                log.warning("claim_not_renewed", unit=held.key, error=str(error))
                continue
            if not still:
                store.lose(held)


async def _claimed_rows(
    units: list[Unit],
    store: PartitionedStore,
    claims: Claims,
    spec: JobSpec,
    estimate: _Estimate,
    job: JobRun,
    feed: UnitFeed | None = None,
    first: Callable[[Unit], bool] | None = None,
) -> AsyncIterator[Row | None]:
    """The rows of the units this worker claims, one unit after another, in the
    corpus's order. Units another worker holds go to the back of the line; when every
    unit left is held by a live worker, it waits (a lease at most) for one to finish or
    to be left to take over, and ends once all are finished; once a lease it says which
    units it waits on, held by whom and until when. While it waits it hands the loop a
    None whenever the job has regenerations to send (they must not wait on it).

    Over a ``feed`` (a pipeline's step), a unit not ready yet goes to the back of the
    line too, and when no unit left can be taken now the rows end, unless the feed
    waits and every unit left is ready (held by others): the worker has other steps to
    go to. They end too once the feed's turn is over (no new unit is claimed then).
    The file of a growing feed's unit is written once the unit is claimed, and
    the first one written with rows is checked against the template (``first``, which
    says whether the unit had rows to check)."""
    pending = deque(units)
    misses = unready = 0
    checked = feed is None or not feed.growing
    turn_ends = None if feed is None or feed.turn is None else time.monotonic() + feed.turn
    while pending:
        unit = pending.popleft()
        if await asyncio.to_thread(store.refresh, unit):
            continue
        if turn_ends is not None and time.monotonic() >= turn_ends:
            log.info("turn_over", units_left=len(pending) + 1)
            return  # the worker's other steps have their turn; it comes back
        key = unit.output_name.removesuffix(".parquet")
        ready = feed is None or await asyncio.to_thread(feed.is_ready, unit)
        held = await asyncio.to_thread(claims.try_claim, key) if ready else None
        if held is None or await asyncio.to_thread(store.refresh, unit):
            if not store.is_finished(unit):
                pending.append(unit)  # another worker's, or not ready: back of the line
                misses += 1
                unready += not ready
            if misses >= len(pending) and pending:  # every unit left is held elsewhere
                if feed is not None and (unready or not feed.wait):
                    log.info("units_left_to_others", units=len(pending), not_ready=unready)
                    return
                misses = unready = 0
                keys = [left.output_name.removesuffix(".parquet") for left in pending]
                await asyncio.to_thread(claims.report_waiting, keys)
                one_finished = functools.partial(_any_finished, store, list(pending))
                async for nothing in _idle(job, min(claims.lease / 4, 5.0), one_finished):
                    yield nothing
            continue
        misses = unready = 0
        if feed is not None:
            await asyncio.to_thread(feed.make, unit)
            if not checked and first is not None:
                checked = await asyncio.to_thread(first, unit)
        known: int | None = None
        if unit.has_metadata:
            try:
                source = await asyncio.to_thread(unit.source, spec.id_column)
                known = unit.known_rows(source)
            except InputError as error:
                if not spec.skip_bad_files:
                    raise
                await asyncio.to_thread(store.skip, unit, str(error))
                continue
        progress = estimate.progress
        progress.total += known or 0
        progress.done += await asyncio.to_thread(store.begin, unit, held)
        read = [0]
        for row in _unit_rows(unit, store, spec, read):
            yield row
        if known is None:
            progress.total += read[0]
        if store.is_lost(unit):
            pending.append(unit)  # its taker may die too: it stays in the line


def _taken(changes: list[tuple[str, str, str | None]]) -> list[tuple[str, str, str | None]]:
    """The members' changes gathered since the last call, the list emptied."""
    taken = changes[:]
    del changes[: len(taken)]
    return taken


def _holds_units(store: PartitionedStore) -> bool:
    """Whether this worker holds a unit now (it works, and counts in the fleet)."""
    return bool(store.held())


def _any_finished(store: PartitionedStore, units: list[Unit]) -> bool:
    """Whether another worker has finished one of ``units`` (their records read again)."""
    return any(store.refresh(unit) for unit in units)


_LOOK_EVERY = 0.25
"""Seconds between two looks, while a worker waits, for a unit finished by another (a
record file's stat each): a step's end is seen at once, not a wait later."""


async def _idle(
    job: JobRun, seconds: float, ready: Callable[[], bool] | None = None
) -> AsyncIterator[None]:
    """Wait ``seconds``, yielding None each time the job has regenerations to send; end
    early once ``ready()`` (a look at the file system, in a thread) says so."""
    deadline = asyncio.get_running_loop().time() + seconds
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        if job.retries:
            yield None
            continue
        job.retry_ready.clear()
        if job.retries:
            continue
        wait = left if ready is None else min(left, _LOOK_EVERY)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(job.retry_ready.wait(), wait)
        if ready is not None and not job.retries and await asyncio.to_thread(ready):
            return


async def _rows(
    units: list[Unit], store: PartitionedStore, spec: JobSpec, estimate: _Estimate
) -> AsyncIterator[Row | None]:
    """The rows of the units, one unit after the other, each opened in the store as it
    begins (in a thread: opening a store reads it and syncs its files) and marked read
    at its end."""
    for unit in units:
        estimate.progress.done += await asyncio.to_thread(store.begin, unit)
        read = [0]
        for row in _unit_rows(unit, store, spec, read):
            yield row
        estimate.unit_read(unit, read[0])


def _unit_rows(
    unit: Unit, store: PartitionedStore, spec: JobSpec, read: list[int]
) -> Iterator[Row]:
    """A unit's rows, counted in ``read[0]``, until its end (or until it is lost to
    another worker); then the store is told the unit is read. A file that cannot be
    read on is an error naming it, or with ``skip_bad_files`` the end of its rows."""
    bad = None
    try:
        for row in unit.read(spec.id_column):
            if store.is_lost(unit):
                break
            read[0] += 1
            yield row
    except InputError as error:
        if not spec.skip_bad_files:
            raise _cut_short(unit, error) from None
        bad = str(error)
        log.warning("unit_cut_short", unit=unit.name, rows=read[0], reason=bad)
    store.end_of(unit, bad=bad)


class _Estimate:
    """The rows the job takes: counted from metadata where the files say so, and for
    the others (JSONL, CSV) estimated from the rows per byte of the units read so far,
    exact once every unit is read."""

    def __init__(
        self,
        units: list[Unit],
        known: list[int | None],
        progress: Progress,
        status: StatusFile,
        base: int,
    ) -> None:
        self.progress = progress
        self.status = status
        self._known = {u.index: k for u, k in zip(units, known, strict=True) if k is not None}
        self._unknown_bytes = sum(u.size for u, k in zip(units, known, strict=True) if k is None)
        self._base = base + sum(self._known.values())
        self._read_rows = 0
        self._read_bytes = 0
        self.exact = not self._unknown_bytes

    def unit_read(self, unit: Unit, rows: int) -> None:
        if unit.index in self._known:
            return
        self._read_rows += rows
        self._read_bytes += unit.size
        self._unknown_bytes -= unit.size
        per_byte = self._read_rows / max(self._read_bytes, 1)
        total = self._base + self._read_rows + round(per_byte * self._unknown_bytes)
        self.progress.total = self.status.total = max(total, self.progress.done)


def _survey(
    units: list[Unit], store: PartitionedStore, spec: JobSpec
) -> tuple[list[Unit], list[int | None]]:
    """Open each Parquet and Arrow unit's file before the first request (its footer or
    schema, for its rows), so that one that cannot be read is refused now, or with
    ``skip_bad_files`` recorded as skipped. A JSONL or CSV file (the listing found it a
    readable regular file) is first read with its rows: its count is None."""
    kept: list[Unit] = []
    known: list[int | None] = []
    for unit in units:
        if not unit.has_metadata:
            kept.append(unit)
            known.append(None)
            continue
        try:
            known.append(unit.known_rows(unit.source(spec.id_column)))
        except InputError as error:
            if not spec.skip_bad_files:
                raise InputError(
                    f"{error}; fix or remove the file, or pass --skip-bad-files "
                    "(skip_bad_files=True) to leave it out and list it in the manifest"
                ) from None
            store.skip(unit, str(error))
            continue
        kept.append(unit)
    return kept, known


_JSON_TYPES = {"string": "string", "integer": "int64", "number": "double", "boolean": "bool"}


def _schema_types(schema: OutputSchema | None) -> dict[str, Any]:
    """The column types an output schema says plainly (a string, an integer, a number,
    a boolean property), so that every unit's file agrees on them even where a unit has
    no value in one; other properties are typed by their values."""
    import pyarrow as pa

    if schema is None:
        return {}
    properties = schema.schema.get("properties")
    types: dict[str, Any] = {}
    for name in schema.columns:
        prop = properties.get(name) if isinstance(properties, dict) else None
        kind = prop.get("type") if isinstance(prop, dict) else None
        if isinstance(kind, str) and kind in _JSON_TYPES:
            types[name] = pa.type_for_alias(_JSON_TYPES[kind])
    if schema.columns:
        types["valid"] = pa.bool_()
    return types


def _cut_short(unit: Unit, error: InputError) -> InputError:
    return InputError(
        f"{error}. The rows of {unit.name} written so far are kept: fix the file and run "
        "again, or pass --skip-bad-files to leave the rest of it out"
    )


def _refuse_options(spec: JobSpec) -> None:
    if spec.limit is not None or spec.shuffle_seed is not None:
        raise ConfigurationError(
            "a trial run (limit) takes one input file, not a corpus: give one of the "
            "corpus's files as the input, in a run directory of its own"
        )
    if spec.write_jsonl:
        raise ConfigurationError(
            "a corpus job writes Parquet only (annotations/, one file per unit): leave "
            "out write_jsonl (--jsonl)"
        )


def _check_columns(unit: Unit, template: PromptTemplate, spec: JobSpec) -> None:
    """The template's fields and the columns to keep, against the first unit's columns
    (where its format says them up front)."""
    source = unit.source(spec.id_column)
    check_job_columns(template, source, keep=spec.columns, group_by=spec.group_by)


def _check_written(unit: Unit, template: PromptTemplate, spec: JobSpec) -> bool:
    """:func:`_check_columns` for a unit of a growing feed, just written; False (nothing
    checked) if it has no rows."""
    if not os.path.getsize(unit.file.path):
        return False
    _check_columns(unit, template, spec)
    return True


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    """The corpus record of the run directory, refusing a directory of a one-file job."""
    if run_dir.exists() and check_entry(run_dir / JOB_FILE):
        raise ConfigurationError(
            f"{run_dir} holds a job over one input file; give the corpus job another --output-dir"
        )
    return read_corpus_record(run_dir) if run_dir.exists() else None


def _check_unchanged(corpus: Corpus, recorded: dict[str, Any], run_dir: Path) -> None:
    changes = corpus.changes_since(recorded)
    if not changes:
        return
    listed = "; ".join(changes[:_LISTED_CHANGES])
    more = f"; and {len(changes) - _LISTED_CHANGES} more" if len(changes) > _LISTED_CHANGES else ""
    raise InputError(
        f"the corpus changed since the job in {run_dir} began: {listed}{more}. Its rows "
        "would no longer match what is done; restore the files, or start the changed "
        "corpus in another --output-dir"
    )


def _record(
    run_dir: Path,
    recorded: dict[str, Any] | None,
    fingerprint: dict[str, Any],
    corpus: Corpus,
    mode: str,
    force: bool,
) -> None:
    """Write ``corpus.json`` for a new run, or check the settings and the mode (whole,
    static shards or claims) of the one there."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise output_write_error(error, run_dir, run_dir) from None
    if recorded is not None:
        old = recorded["fingerprint"]
        said = recorded.get("mode", mode)
        if said != mode and not force:
            raise ConfigurationError(
                f"{run_dir} runs this corpus {_MODES.get(said, said)}, not {_MODES[mode]}: "
                "its units in progress are held that way. Run it as it began, or give "
                "--force once every process of it has stopped"
            )
        if old == fingerprint and said == mode:
            return
        if not force:
            changes = "; ".join(describe_changes(old, fingerprint)) or "the settings"
            raise FingerprintMismatchError(
                f"{run_dir} holds this corpus's job with other settings: {changes}. Give "
                "the same settings, another --output-dir, or --force to go on with these "
                "(rows already written keep their answers)"
            )
    write_corpus_record(
        run_dir,
        {"fingerprint": fingerprint, "mode": mode, "corpus": corpus.listing(), "split": SPLIT_RULE},
    )


__all__ = ["CORPUS_FILE", "Runner", "annotate_corpus", "runs_as_units"]
