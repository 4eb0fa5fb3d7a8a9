"""The run directory of a corpus job: a store per unit in progress, a Parquet file per
unit finished, and a manifest.

A corpus job's run directory looks like this::

    RUN_DIR/
      corpus.json                 the corpus's files (name, size, time), the settings'
                                  fingerprint, and how it is cut and split; written once
      units/<unit>/               the store of a unit in progress (job.json, .lock,
                                  shards/part-*.jsonl), as a one-file job keeps its own
      annotations/
        <unit>.parquet            one per finished unit, named after it
        _units/<unit>.json        the record of a finished unit: rows, counts, schema
        _manifest.json            every unit's record and the corpus's totals

Rows of a unit go to the unit's own store as they are answered; only the units being
read, or with rows still in flight, are open, so the bookkeeping is that of a few units
however large the corpus. Once every row of a unit has its record, the unit is
finished in a worker thread: its store is consolidated into
``annotations/<unit>.parquet`` (written under a fresh name, fsynced, renamed), then its
record is written the same way. A unit begun afresh is followed as its store writes
it, its records held in memory up to :data:`HOLD_BYTES` over the units in progress, so
that finishing it reads back none of its store (past that, the records not held, once);
a unit resumed from an earlier run's shards is consolidated from them. A unit with a
record is finished and is skipped on resume without being read; a unit killed between
the two renames is consolidated again from its store, which gives the same file. A
worker killed while it wrote leaves temporaries
(:mod:`~llm_annotator.jobs.rundir.leftovers`): whoever begins the unit next removes
them. Dataset readers skip names that begin with ``_``, so
``pyarrow.dataset.dataset(RUN_DIR/annotations)``, DuckDB's
``read_parquet('RUN_DIR/annotations/*.parquet')`` and ``datasets.load_dataset`` read the
units' files as one dataset.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import structlog

from llm_annotator.errors import JobError, RunDirectoryError
from llm_annotator.jobs.answers.records import ANSWER_COLUMNS, VALID_COLUMN
from llm_annotator.jobs.files import (
    atomic_write,
    check_entry,
    fsync_directory,
    make_directory,
    read_run_file,
)
from llm_annotator.jobs.ids import RowId
from llm_annotator.jobs.rows.corpus import FILE_COLUMN, Unit
from llm_annotator.jobs.rows.inputs import Row
from llm_annotator.jobs.rundir.claims import Claim, Claims
from llm_annotator.jobs.rundir.consolidate import Consolidated, consolidate
from llm_annotator.jobs.rundir.leftovers import (
    consolidating_name,
    remove_leftovers,
    store_leftovers,
    unit_leftovers,
)
from llm_annotator.jobs.rundir.loading import HoldBudget, Written
from llm_annotator.jobs.rundir.store import ResultStore, output_write_error

log = structlog.get_logger(__name__)

CORPUS_FILE = "corpus.json"
ANNOTATIONS_DIR = "annotations"
UNITS_DIR = "units"
RECORDS_DIR = "_units"
MANIFEST_FILE = "_manifest.json"
MANIFEST_FORMAT = 1
_TYPES: Mapping[str, pa.DataType] = {
    **{name: pa.string() for name in ANSWER_COLUMNS},
    "num_prompt_tokens": pa.int64(),
    "num_output_tokens": pa.int64(),
    VALID_COLUMN: pa.bool_(),
}
"""The types of the answer columns when a unit has no value in one (no error at all)."""
_COUNTS = ("rows", "succeeded", "failed", "prompt_tokens", "output_tokens")
HOLD_BYTES = 128 << 20
"""Bytes of records a corpus job holds in memory, over its units in progress, so that
finishing a unit does not read its store back."""


@dataclass(slots=True)
class _Open:
    """A unit in progress: its store, and how many of its rows are read and written."""

    unit: Unit
    store: ResultStore
    claim: Claim | None = None
    """The unit's claim, for a worker that takes units by claims."""
    followed: Written | None = None
    """The records its store writes, for a unit begun afresh."""
    read: int = 0
    """Rows of the unit read so far, done before or not."""
    expected: int = 0
    """Rows handed on to be done (not done before)."""
    written: int = 0
    all_read: bool = False
    bad: str | None = None
    """Why the rest of the unit could not be read, when it could not."""


@dataclass(slots=True)
class UnitCounts:
    """What the units finished so far hold, summed."""

    units: int = 0
    by_finish_reason: dict[str, int] = field(default_factory=dict)
    by_error_type: dict[str, int] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))

    def add(self, record: Mapping[str, Any]) -> None:
        self.units += 1
        for name in _COUNTS:
            self.counts[name] += int(record.get(name) or 0)
        for key, into in (
            ("by_finish_reason", self.by_finish_reason),
            ("by_error_type", self.by_error_type),
        ):
            for label, count in dict(record.get(key) or {}).items():
                into[label] = into.get(label, 0) + int(count)

    def consolidated(self, path: Path) -> Consolidated:
        """The sums as a consolidation's result (for ``report.json``)."""
        counts = self.counts
        return Consolidated(
            parquet_path=path,
            jsonl_path=None,
            num_rows=counts["rows"],
            num_succeeded=counts["succeeded"],
            num_failed=counts["failed"],
            by_finish_reason=self.by_finish_reason,
            by_error_type=self.by_error_type,
            prompt_tokens=counts["prompt_tokens"],
            output_tokens=counts["output_tokens"],
        )


class PartitionedStore:
    """Where a corpus job's results go: a :class:`ResultStore` per unit in progress, a
    Parquet file per unit finished.

    The job's loop uses it as its store: :meth:`take` says whether a row is still to
    be done, :meth:`append` writes a row's record into its unit's store, :meth:`flush`
    and :meth:`sync` reach every open unit. The reader of the rows says when a unit
    begins (:meth:`begin`) and when all of it is read (:meth:`end_of`); a unit whose
    rows are all read and written is finished in a worker thread (:meth:`drain` waits
    for those).

    Args:
        run_dir: The run directory.
        fingerprint: The settings' fingerprint, recorded in each unit's store.
        retry_errors: As for a :class:`ResultStore`; a finished unit with error rows is
            then opened again.
        force: Open units whose store was made with other settings.
        column_order: The output's first columns; with ``types``, every unit's file has
            these columns of these types, even where no row has a value.
        types: The types of output columns known up front (an output schema's).
        claims: For a worker that takes units by claims: its claims, checked before
            each write (a unit lost to another worker is written no more).
        hold_bytes: Bytes of records held in memory over the units in progress, so
            that finishing a unit begun afresh does not read its store back.
    """

    def __init__(
        self,
        run_dir: Path,
        fingerprint: Mapping[str, Any],
        *,
        retry_errors: bool | frozenset[str] = False,
        force: bool = False,
        column_order: Sequence[str] = (),
        types: Mapping[str, pa.DataType] | None = None,
        claims: Claims | None = None,
        hold_bytes: int = HOLD_BYTES,
    ) -> None:
        self.run_dir = run_dir
        self.claims = claims
        self._types = {**_TYPES, **(types or {})}
        self._opened_at = time.time()
        self.output_dir = run_dir / ANNOTATIONS_DIR
        self._fingerprint = dict(fingerprint)
        self._retry = retry_errors
        self._force = force
        self._columns = list(column_order)
        self._open: dict[int, _Open] = {}
        self._lost: set[int] = set()
        self._held: dict[int, Claim] = {}
        """The claims of the units open or being finished."""
        self._finishing: set[asyncio.Future[None]] = set()
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="finish-unit")
        """One thread finishes the units, one after another: consolidating a unit is
        far faster than annotating it, and one thread keeps the memory of one."""
        self._failure: BaseException | None = None
        self._budget = HoldBudget(hold_bytes)
        self._lock = threading.Lock()
        """Held while open stores are synced or a finished one is closed."""
        self.finished_now = UnitCounts()
        """The units this store finished."""
        for folder in (run_dir / UNITS_DIR, self.output_dir, self.output_dir / RECORDS_DIR):
            try:
                make_directory(folder)
            except OSError as error:
                raise output_write_error(error, folder, run_dir) from None
        self.records = read_unit_records(run_dir)
        """The records of the finished units, by output name."""
        self._leftovers = unit_leftovers(self.output_dir, self.output_dir / RECORDS_DIR)
        """What holders killed before this store opened left, by unit (removed as each
        unit begins: until then, a live holder may still be writing it)."""

    def __repr__(self) -> str:
        return (
            f"<PartitionedStore {str(self.run_dir)!r} open={len(self._open)} "
            f"finished={len(self.records)}>"
        )

    def is_finished(self, unit: Unit) -> bool:
        """Whether the unit is finished (and, with ``retry_errors``, has no error row
        of a type to retry)."""
        record = self.records.get(unit.output_name)
        if record is None or record.get("file") != unit.file.identity():
            return False
        if not self._retry or not record.get("failed"):
            return True
        if float(record.get("finished_at") or 0) >= self._opened_at:
            return True  # retried in this run (by this worker or another): final for it
        if isinstance(self._retry, frozenset):
            return not self._retry & set(record.get("by_error_type") or {})
        return False

    def refresh(self, unit: Unit) -> bool:
        """Read the unit's record again (another worker may have finished it); whether
        it is finished."""
        if self.is_finished(unit):
            return True
        path = self.output_dir / RECORDS_DIR / (unit.output_name + ".json")
        if check_entry(path):  # new, or rewritten by a retry of another worker
            self.records.update(_read_records(self.run_dir, [path.name]))
        return self.is_finished(unit)

    def begin(self, unit: Unit, claim: Claim | None = None) -> int:
        """Open the unit's store (held by ``claim``, for a worker that takes units by
        claims); return how many of its rows are done already."""
        self._raise()
        directory = self.run_dir / UNITS_DIR / unit.output_name.removesuffix(".parquet")
        try:
            make_directory(directory)  # the job's own: a link planted there is refused
        except OSError as error:
            raise output_write_error(error, directory, self.run_dir) from None
        store = ResultStore.open(
            directory,
            self._fingerprint,
            force=self._force,
            retry_errors=self._retry,
            exclusive=claim is None,
        )
        self._lost.discard(unit.index)  # claimed again: this worker's once more
        written = None
        if store.is_fresh:  # else resumed: its finish reads the shards it found
            written = Written(store.shard_path, self._budget)
            store.follow(written)
        self._open[unit.index] = _Open(unit, store, claim, written)
        if claim is not None:
            self._held[unit.index] = claim
        self._remove_leftovers(unit, directory, claim)
        return store.num_done

    def _remove_leftovers(self, unit: Unit, directory: Path, claim: Claim | None) -> None:
        """Remove the temporaries the unit's earlier holders left (this worker holds it
        now: no one else writes them)."""
        found = self._leftovers.pop(unit.output_name, [])
        if claim is not None and claim.generation > 1:  # taken over: its holder may have
            # died after this store's first look, so look again
            found = unit_leftovers(self.output_dir, self.output_dir / RECORDS_DIR).get(
                unit.output_name, []
            )
        remove_leftovers([*found, *store_leftovers(directory)], unit=unit.name)

    def held(self) -> list[Claim]:
        """The claims of the units open or being finished (for their renewal)."""
        return list(self._held.values())

    def lose(self, claim: Claim) -> None:
        """The claim's unit was taken over by another worker: give it up."""
        for work in list(self._open.values()):
            if work.claim is claim:
                self._lose(work)

    def is_lost(self, unit: Unit) -> bool:
        """Whether another worker took the unit over from this one."""
        return unit.index in self._lost

    def _holds(self, work: _Open) -> bool:
        """Whether this worker may still write the unit: unclaimed, or its claim good."""
        claim = work.claim
        if claim is None or self.claims is None or self.claims.valid(claim):
            return True
        self._lose(work)
        return False

    def _lose(self, work: _Open) -> None:
        """Drop a unit taken over by another worker: nothing more of it is written."""
        index = work.unit.index
        self._lost.add(index)
        self._open.pop(index, None)
        self._held.pop(index, None)
        with self._lock:
            work.store.discard()
        if work.followed is not None:
            work.followed.release()
        log.warning("unit_given_up", unit=work.unit.name, written=work.written)

    def take(self, row: Row) -> bool:
        """Whether the row is still to be done; counts it in its unit either way."""
        work = self._open.get(_unit_of(row.unit))
        if work is None:  # its unit was lost to another worker meanwhile
            return False
        work.read += 1
        if work.store.is_done(row.id):
            return False
        work.expected += 1
        return True

    def append(self, record: Mapping[str, Any], unit: int | None) -> None:
        """Write a row's record into its unit's store; finish the unit if it was its
        last row."""
        self._raise()
        index = _unit_of(unit)
        if index in self._lost:
            return  # a row of a unit another worker took over: it writes it
        work = self._open[index]
        if not self._holds(work):
            return
        work.store.append(record)
        work.written += 1
        self._finish_if_done(work)

    def end_of(self, unit: Unit, *, bad: str | None = None) -> None:
        """Every row of the unit is read (or, ``bad``, the rest could not be and is
        left out, saying why): finish it once its rows are written."""
        work = self._open.get(unit.index)
        if work is None:  # lost meanwhile
            return
        work.all_read = True
        work.bad = bad
        self._finish_if_done(work)

    def skip(self, unit: Unit, reason: str) -> None:
        """Record a unit that cannot be read at all as finished with no row, and why."""
        self._write_record(unit, {"rows": 0, "succeeded": 0, "failed": 0, "skipped": reason})

    def is_done(self, row_id: RowId, unit: int | None) -> bool:
        """Whether a row of an open unit has a result (a unit no longer open: yes)."""
        work = self._open.get(_unit_of(unit))
        return work is None or work.store.is_done(row_id)

    def flush(self) -> None:
        self._raise()
        for work in list(self._open.values()):
            if self._holds(work):
                work.store.flush()

    def sync(self) -> None:
        with self._lock:
            for work in list(self._open.values()):
                if work.claim is None or not work.claim.lost:
                    work.store.sync()

    def close(self) -> None:
        """Close the stores of the units still open (what they hold is kept), once the
        units being finished are (:meth:`drain` waits for them without blocking)."""
        self._finisher.shutdown(wait=True)
        with self._lock:
            for work in list(self._open.values()):
                work.store.close()
                if work.followed is not None:
                    work.followed.release()
            self._open.clear()

    async def drain(self) -> None:
        """Wait for the units being finished; raise the first failure."""
        while self._finishing:
            await asyncio.wait(list(self._finishing))
        self._raise()

    def _raise(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _finish_if_done(self, work: _Open) -> None:
        if not work.all_read or work.written < work.expected:
            return
        del self._open[work.unit.index]
        future = asyncio.get_running_loop().run_in_executor(self._finisher, self._finish, work)
        self._finishing.add(future)
        future.add_done_callback(self._finished)

    def _finished(self, future: asyncio.Future[None]) -> None:
        self._finishing.discard(future)
        if not future.cancelled() and future.exception() is not None and self._failure is None:
            self._failure = future.exception()

    def _finish(self, work: _Open) -> None:
        """Close a unit's store and write its Parquet file and record (a worker thread)."""
        try:
            self._finish_unit(work)
        finally:
            if work.followed is not None:
                work.followed.release()

    def _finish_unit(self, work: _Open) -> None:
        unit = work.unit
        claim = work.claim
        if claim is not None and self.claims is not None and not self.claims.renew(claim):
            self._lose(work)
            return
        with self._lock:
            work.store.close()
        target = self.output_dir / unit.output_name
        written = self.output_dir / consolidating_name(unit.output_name)  # unseen by readers
        try:
            result = consolidate(
                work.store.output_dir,
                column_order=self._columns,
                target=written,
                constants={FILE_COLUMN: unit.file.name},
                types=self._types,
                written=work.followed,
            )
        except OSError as error:
            if self._taken_meanwhile(work):  # its taker removed this worker's temporary
                return
            raise output_write_error(error, error.filename or target, self.run_dir) from None
        complete = result.num_rows == work.read or (work.bad and result.num_rows > work.read)
        if not complete:
            written.unlink(missing_ok=True)
            raise JobError(
                f"{unit.name}: {work.read} rows read but {result.num_rows} have a result in "
                f"{work.store.output_dir}: the file changed while the job read it, or two "
                "ids were taken for one (an 8-byte hash collision). Nothing of the unit is "
                "lost; please report this with the unit's job.json."
            )
        try:
            if result.num_rows:
                os.replace(written, target)  # whole, checked: now readers see it
            else:  # no file for no rows (it would hide the others' columns from readers)
                written.unlink()
                target.unlink(missing_ok=True)
            fsync_directory(self.output_dir)
        except OSError as error:
            if self._taken_meanwhile(work):
                return
            raise output_write_error(error, target, self.run_dir) from None
        counts = {
            "rows": result.num_rows,
            "succeeded": result.num_succeeded,
            "failed": result.num_failed,
            "prompt_tokens": result.prompt_tokens,
            "output_tokens": result.output_tokens,
            "by_finish_reason": result.by_finish_reason,
            "by_error_type": result.by_error_type,
            "schema": _schema_text(result.schema) if result.num_rows else [],
        }
        if work.bad is not None:
            counts["skipped"] = work.bad
        self._write_record(unit, counts)

    def _taken_meanwhile(self, work: _Open) -> bool:
        """After a failed write: whether the unit was taken over by another worker
        meanwhile (this one stalled past its lease), which removed what this one was
        writing; then the unit is given up, not failed."""
        claim = work.claim
        if claim is None or self.claims is None:
            return False
        try:
            if self.claims.renew(claim):
                return False
        except OSError:
            return False
        self._lose(work)
        return True

    def _write_record(self, unit: Unit, counts: Mapping[str, Any]) -> None:
        """Write a finished unit's record (whole, fsynced, renamed in place)."""
        record = {
            "unit": unit.name,
            "output": unit.output_name,
            "file": unit.file.identity(),
            "groups": list(unit.groups) if unit.groups is not None else None,
            "finished_at": time.time(),
            "by": self.claims.owner if self.claims is not None else None,
            **counts,
        }
        path = self.output_dir / RECORDS_DIR / (unit.output_name + ".json")
        try:
            with atomic_write(path) as file:
                file.write(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
        except OSError as error:
            raise output_write_error(error, path, self.run_dir) from None
        self.records[unit.output_name] = record
        self.finished_now.add(record)
        self._held.pop(unit.index, None)
        log.info(
            "unit_skipped" if "skipped" in record else "unit_finished",
            unit=unit.name,
            rows=record["rows"],
            failed=record["failed"],
            reason=record.get("skipped"),
        )


def _unit_of(unit: int | None) -> int:
    if unit is None:
        raise JobError("a row of a corpus job has no unit")
    return unit


def _schema_text(schema: pa.Schema | None) -> list[list[str]]:
    """A Parquet file's columns and their types, as text."""
    return [[f.name, str(f.type)] for f in schema or ()]


def read_unit_records(run_dir: Path) -> dict[str, dict[str, Any]]:
    """The records of a corpus run's finished units, by output name; records that are
    not a unit's are skipped with a warning.

    Raises:
        RunDirectoryError: A record is a link or not a regular file.
    """
    folder = run_dir / ANNOTATIONS_DIR / RECORDS_DIR
    if not check_entry(folder, directory=True):
        return {}
    with os.scandir(folder) as entries:
        names = sorted(e.name for e in entries if e.name.endswith(".parquet.json"))
    return _read_records(run_dir, names)


def unit_finished(run_dir: Path, output: str) -> bool:
    """Whether the unit of output file ``output`` (``<unit>.parquet``) of a corpus run
    is finished: its record is there and whole, and so is its file if it has rows."""
    name = output + ".json"
    if not check_entry(run_dir / ANNOTATIONS_DIR / RECORDS_DIR / name):
        return False  # not finished yet
    return bool(_read_records(run_dir, [name]))


def _read_records(run_dir: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The unit records of these names (in ``annotations/_units``) that are whole."""
    folder = run_dir / ANNOTATIONS_DIR / RECORDS_DIR
    records: dict[str, dict[str, Any]] = {}
    for name in names:
        data = read_run_file(folder / name)
        try:
            record = orjson.loads(data) if data is not None else None
        except orjson.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or record.get("output") != name.removesuffix(".json"):
            log.warning("unit_record_skipped", path=str(folder / name))
            continue
        has_file = check_entry(run_dir / ANNOTATIONS_DIR / name.removesuffix(".json"))
        if not has_file and record.get("rows"):
            continue  # its file is gone: the unit is done again (no rows: no file)
        records[record["output"]] = record
    return records


def write_manifest(run_dir: Path, listing: Mapping[str, Any], *, again: int = 5) -> dict[str, Any]:
    """Write ``annotations/_manifest.json`` from the finished units' records: which
    units are done (and which are not), the rows and counts, and the schema.

    Args:
        run_dir: The run directory.
        listing: The corpus as ``corpus.json`` records it (its files and units).

    Returns:
        The manifest.
    """
    records = read_unit_records(run_dir)
    files = {tuple(f) for f in listing.get("files", ()) if isinstance(f, list)}
    totals = UnitCounts()
    done, waiting, schemas = [], [], []
    skipped = [list(entry) for entry in listing.get("skipped", [])]
    for output in listing.get("units", ()):
        record = records.get(output)
        if record is None or tuple(record.get("file") or ()) not in files:
            waiting.append(output)
            continue
        totals.add(record)
        entry = {k: record[k] for k in ("unit", "output", "rows", "succeeded", "failed")}
        if record.get("skipped"):
            entry["skipped"] = record["skipped"]
            skipped.append([record["unit"], record["skipped"]])
        done.append(entry)
        schemas.append(record.get("schema") or [])
    manifest = {
        "format": MANIFEST_FORMAT,
        "complete": not waiting,
        "units": len(done) + len(waiting),
        "units_done": len(done),
        **totals.counts,
        "by_error_type": totals.by_error_type,
        "skipped_files": skipped,
        "schema": _unified(schemas),
        "done": done,
        "waiting": waiting,
    }
    path = run_dir / ANNOTATIONS_DIR / MANIFEST_FILE
    try:
        with atomic_write(path) as file:
            file.write(orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n")
    except OSError as error:
        raise output_write_error(error, path, run_dir) from None
    if waiting and again > 0 and len(read_unit_records(run_dir)) != len(records):
        # A worker finished a unit while this one wrote: its manifest may have come
        # first; look again, so the last manifest written counts every unit.
        return write_manifest(run_dir, listing, again=again - 1)
    return manifest


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """``annotations/_manifest.json``, or None if there is none.

    Raises:
        RunDirectoryError: It is a link, not a regular file, or not a manifest.
    """
    path = run_dir / ANNOTATIONS_DIR / MANIFEST_FILE
    data = read_run_file(path)
    if data is None:
        return None
    try:
        manifest = orjson.loads(data)
    except orjson.JSONDecodeError:
        manifest = None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise RunDirectoryError(
            f"{path} is not a corpus job's manifest; run llm-annotator merge {run_dir} to "
            "write it anew",
            path=str(path),
        )
    return manifest


def _unified(schemas: list[list[list[str]]]) -> list[list[str]]:
    """The columns of every unit's file, in first-seen order, each with its type, or
    the types seen where the units differ (``"int64 | string"``)."""
    types: dict[str, list[str]] = {}
    for schema in schemas:
        for name, kind in schema:
            seen = types.setdefault(name, [])
            if kind not in seen and kind != "null":
                seen.append(kind)
    return [[name, " | ".join(kinds) or "null"] for name, kinds in types.items()]


def read_corpus_record(run_dir: Path) -> dict[str, Any] | None:
    """``corpus.json`` of a run directory, or None.

    Raises:
        RunDirectoryError: It is a link, not a regular file, or not a corpus record.
    """
    path = run_dir / CORPUS_FILE
    data = read_run_file(path)
    if data is None:
        return None
    try:
        record = orjson.loads(data)
    except orjson.JSONDecodeError:
        record = None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("fingerprint"), dict)
        or not isinstance(record.get("corpus"), dict)
    ):
        raise RunDirectoryError(
            f"{path} is not a corpus job's record; restore it, or give the job another "
            "--output-dir",
            path=str(path),
        )
    return record


def write_corpus_record(run_dir: Path, record: Mapping[str, Any]) -> None:
    """Write ``corpus.json`` (whole, fsynced, renamed in place)."""
    path = run_dir / CORPUS_FILE
    try:
        with atomic_write(path) as file:
            file.write(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
    except OSError as error:
        raise output_write_error(error, path, run_dir) from None
