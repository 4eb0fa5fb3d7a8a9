"""``llm-annotator merge RUN_DIR``: the shards of a sharded job, consolidated into one
output with one row per id.

Each shard keeps its own results (:mod:`llm_annotator.jobs.shards.shard`); the merge checks that
every shard of the count in ``sharding.json`` finished with all its rows, then
consolidates all their records at once (the same rules as one run's consolidation: a
success beats an error, the last record of a kind wins) into ``RUN_DIR/
annotations.parquet`` and ``RUN_DIR/report.json``. It names the shards that are missing,
still running or incomplete instead of merging silently (the first
:data:`LISTED_SHARDS` of them, and how many more). The last shard to finish runs it by
itself (:func:`merge_if_complete`); it can also be a final step of its own.

The shard folders are found by listing the run directory
(:func:`~llm_annotator.jobs.shards.shard.shard_folders`), and every file read there is checked:
a link, a FIFO or a ``report.json`` of the wrong shape is refused naming it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import structlog

from llm_annotator.errors import JobError, RunDirectoryError
from llm_annotator.jobs.files import check_entry, open_binary
from llm_annotator.jobs.loop.summary import REPORT_NAME, read_report, result_summary, write_json
from llm_annotator.jobs.rundir.claims import LEASE
from llm_annotator.jobs.rundir.consolidate import (
    INPUT_IDS_FILE,
    PARQUET_FILE,
    Consolidated,
    _consolidate,
    read_input_ids,
    read_stale,
)
from llm_annotator.jobs.rundir.fingerprint import read_job_record
from llm_annotator.jobs.rundir.leftovers import (
    is_stale,
    remove_leftovers,
    stale_temporaries,
    store_leftovers,
    unit_leftovers,
)
from llm_annotator.jobs.rundir.partitions import (
    ANNOTATIONS_DIR,
    CORPUS_FILE,
    MANIFEST_FILE,
    RECORDS_DIR,
    UNITS_DIR,
    UnitCounts,
    read_corpus_record,
    read_unit_records,
    write_manifest,
)
from llm_annotator.jobs.rundir.store import JOB_FILE, DirectoryLock, shard_paths
from llm_annotator.jobs.shards.shard import Shard, read_sharding, shard_folders
from llm_annotator.jobs.watch.status import run_state, run_status

log = structlog.get_logger(__name__)

_ATTEMPTS = 5
"""Tries of the last shard's merge while another process holds a lock it needs."""
LISTED_SHARDS = 20
"""Shards named one by one in a message (a count of the others follows)."""


@dataclass(frozen=True, slots=True)
class ShardState:
    """How one shard of a sharded job stands.

    Attributes:
        index: The shard's index.
        directory: Its folder.
        state: ``finished``, ``running``, ``interrupted``, ``failed``, ``stopped``
            (killed, or it did not say) or ``missing`` (never started).
        done: Rows it has done, if it said.
        total: Rows it takes, if it said.
        mixed_inputs: Its folder also holds rows of another input (a job over another
            input was forced in it): the merge keeps only the ids its last
            consolidation kept.
    """

    index: int
    directory: Path
    state: str
    done: int | None
    total: int | None
    mixed_inputs: bool = False

    @property
    def complete(self) -> bool:
        return self.state == "finished" and self.total is not None and self.done == self.total

    def describe(self, count: int) -> str:
        """The shard's state in words, with what to do."""
        name = f"shard {self.index} of {count}"
        if self.state == "missing":
            return f"{name}: not started (run it with --shard {self.index}/{count})"
        rows = f"{self.done} of {self.total} rows" if self.total is not None else "rows unknown"
        if self.state == "running":
            return f"{name}: still running ({rows})"
        return f"{name}: {self.state} with {rows} (run it again with --shard {self.index}/{count})"


def shard_states(
    run_dir: str | os.PathLike[str], *, rows: bool = True
) -> tuple[int, list[ShardState]]:
    """The shard count and each shard's state; with ``rows=False`` only what each
    shard's lock and ``status.json`` say, without counting the rows its files hold
    (``done`` and ``total`` are None).

    The shard folders are listed, not looked for one index at a time: a shard with no
    folder is ``missing`` without a look at the disk.

    Raises:
        JobError: The directory is not a sharded run directory.
        RunDirectoryError: Its ``sharding.json`` or a shard's entry is not the job's
            own (a link, a FIFO, a record of the wrong shape).
    """
    directory = Path(run_dir)
    sharding = read_sharding(directory)
    if sharding is None:
        raise JobError(
            f"{directory} is not a sharded run directory (no sharding.json): a job run "
            "without --shard consolidates its own output"
        )
    count: int = sharding["count"]
    folders = shard_folders(directory, count)
    states = [
        _state(i, folders[i], rows)
        if i in folders
        else ShardState(i, Shard(i, count).directory(directory), "missing", None, None)
        for i in range(count)
    ]
    return count, states


def _state(index: int, folder: Path, rows: bool) -> ShardState:
    """The shard's state as ``llm-annotator status`` sees it (a lock held on this host,
    or a fresh ``status.json`` from another), with the rows its files hold."""
    if not check_entry(folder / JOB_FILE):
        return ShardState(index, folder, "missing", None, None)
    if not rows:
        return ShardState(index, folder, _shard_state(run_state(folder)), None, None)
    try:
        status = run_status(folder)
    except RunDirectoryError:
        raise
    except JobError:  # removed meanwhile
        return ShardState(index, folder, "missing", None, None)
    state = _shard_state(status.state)
    return ShardState(index, folder, state, status.done, status.total, status.mixed_inputs)


def waiting_lines(states: list[ShardState], count: int) -> str:
    """The first :data:`LISTED_SHARDS` shards that are not complete, one indented line
    each, and how many more."""
    waiting = [s for s in states if not s.complete]
    listed = "".join(f"\n  {s.describe(count)}" for s in waiting[:LISTED_SHARDS])
    if len(waiting) > LISTED_SHARDS:
        listed += f"\n  and {len(waiting) - LISTED_SHARDS} more"
    return listed


def is_merged(run_dir: Path) -> bool:
    """Whether a sharded run directory holds a merged output (a regular file)."""
    try:
        return check_entry(run_dir / PARQUET_FILE)
    except RunDirectoryError:
        return False


def _shard_state(run_state: str) -> str:
    return "running" if run_state in ("running", "consolidating") else run_state


@dataclass(frozen=True, slots=True)
class Merged:
    """What :func:`merge` wrote.

    Attributes:
        output_path: ``RUN_DIR/annotations.parquet``.
        report_path: ``RUN_DIR/report.json``.
        shards: Shards merged.
        result: The consolidation's counts.
    """

    output_path: Path
    report_path: Path
    shards: int
    result: Consolidated


def merge(run_dir: str | os.PathLike[str], *, jsonl: bool = False) -> Merged:
    """Consolidate every shard of a sharded job into one output.

    Raises:
        JobError: The directory is not sharded, a shard is missing, running or
            incomplete (the message names each, and what to run), or another process
            merges it now.
        RunDirectoryError: A file of the run directory or of a shard is a link, not a
            regular file, or not of the shape the job writes (the message names it).
    """
    directory = Path(run_dir)
    if read_corpus_record(directory) is not None:
        return merge_corpus(directory)
    count, states = shard_states(directory)
    waiting = [s for s in states if not s.complete]
    if waiting:
        raise JobError(
            f"cannot merge {directory}: {len(waiting)} of its {count} shards are not "
            f"complete:{waiting_lines(states, count)}\nRun those, then llm-annotator "
            f"merge {directory}."
        )
    with _locked([directory, *(s.directory for s in states)]):
        _one_input(states, count)
        files, keep, kept_in = _shard_files(states, count)
        order = _column_order(states[0].directory)
        parts = _shard_reports(states)  # checked before anything is written
        stale = [k for k in (read_stale(s.directory) for s in states) if k is not None]
        result = _consolidate(
            directory,
            jsonl=jsonl,
            column_order=order,
            shards=files,
            keep=keep,
            kept_in=kept_in,
            stale=np.unique(np.concatenate(stale)) if stale else None,
        )
        expected = sum(s.total or 0 for s in states)
        if result.num_rows != expected:
            for path in (result.parquet_path, result.jsonl_path):
                if path is not None:
                    path.unlink(missing_ok=True)  # no output that looks final
            log.error(
                "merge_refused", output_dir=str(directory), rows=result.num_rows, expected=expected
            )
            raise JobError(
                f"merged {result.num_rows} rows in {directory} where its shards said "
                f"{expected}: a shard's rows changed while merging, or the input differs "
                "between shards. Nothing is merged; the shards' own outputs are kept."
            )
        report = {**result_summary(result), "shards": parts}
        report_path = directory / REPORT_NAME
        write_json(report_path, report)
    log.info("shards_merged", output_dir=str(directory), shards=count, rows=result.num_rows)
    return Merged(result.parquet_path, report_path, count, result)


def merge_corpus(run_dir: Path) -> Merged:
    """A corpus job's merge: check that every unit is finished and write the manifest
    (``annotations/_manifest.json``); the units' files are never rewritten. Once every
    unit is finished, no worker writes one any more: the temporaries that workers
    killed while writing left are removed (:func:`remove_corpus_leftovers`).

    Raises:
        JobError: Units are not finished (the message names the first
            :data:`LISTED_SHARDS`, and how many more).
        RunDirectoryError: ``corpus.json`` or a unit's record is not the job's own.
    """
    record = read_corpus_record(run_dir)
    if record is None:
        raise JobError(f"{run_dir} holds no corpus job")
    manifest = write_manifest(run_dir, record["corpus"])
    if not manifest["complete"]:
        waiting = manifest["waiting"]
        listed = ", ".join(waiting[:LISTED_SHARDS])
        more = f" and {len(waiting) - LISTED_SHARDS} more" if len(waiting) > LISTED_SHARDS else ""
        raise JobError(
            f"cannot merge {run_dir}: {len(waiting)} of its {manifest['units']} units are not "
            f"finished ({listed}{more}). Run the job (each shard, or more workers) until they "
            f"are; the manifest {run_dir / ANNOTATIONS_DIR / MANIFEST_FILE} says which."
        )
    outputs = set(record["corpus"].get("units", ()))
    remove_corpus_leftovers(run_dir, outputs)
    totals = UnitCounts()
    for unit in read_unit_records(run_dir).values():
        if unit["output"] in outputs:
            totals.add(unit)
    result = totals.consolidated(run_dir / ANNOTATIONS_DIR)
    report_path = run_dir / REPORT_NAME
    sharding = read_sharding(run_dir)
    if sharding is not None:  # one job's own report.json is left as it wrote it
        write_json(report_path, {**result_summary(result), "units": manifest["units"]})
    log.info("corpus_merged", output_dir=str(run_dir), units=manifest["units"])
    return Merged(result.parquet_path, report_path, sharding["count"] if sharding else 1, result)


def remove_corpus_leftovers(
    run_dir: Path, outputs: set[str], *, now: float | None = None, idle: float = LEASE
) -> int:
    """Remove what workers killed while writing left in a corpus run directory whose
    units (``outputs``) are all finished: each unit's temporaries
    (:mod:`~llm_annotator.jobs.rundir.leftovers`), and those of the manifest and of
    ``corpus.json`` not modified for ``idle`` seconds (a worker that finishes or starts
    may be writing those right now); how many files were removed.

    A unit's temporaries modified within ``idle`` seconds are kept too, as is every one
    of a unit whose store's lock another process holds: a unit retried now (with
    ``retry_errors``) is written by a live worker, which renames its file and writes its
    record after it lets go of the lock."""
    annotations = run_dir / ANNOTATIONS_DIR
    found = unit_leftovers(annotations, annotations / RECORDS_DIR)
    removed = 0
    now = time.time() if now is None else now
    for output in sorted(outputs):
        store = run_dir / UNITS_DIR / output.removesuffix(".parquet")
        paths = [
            path
            for path in (*found.get(output, []), *store_leftovers(store))
            if _idle_for(path, idle, now)
        ]
        if not paths:
            continue
        with _unused(store) as unused:
            if unused:
                removed += remove_leftovers(paths, unit=output)
            else:
                log.info("leftovers_kept", unit=output, reason="the unit is being written")
    shared = [
        *stale_temporaries(annotations, [MANIFEST_FILE], idle=idle, now=now),
        *stale_temporaries(run_dir, [CORPUS_FILE], idle=idle, now=now),
    ]
    return removed + remove_leftovers(shared)


def _idle_for(path: Path, idle: float, now: float) -> bool:
    """Whether the file was not modified for ``idle`` seconds (or is gone)."""
    try:
        return is_stale(os.lstat(path).st_mtime, now, idle)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _unused(store: Path) -> Iterator[bool]:
    """Whether no process writes the unit of this store folder: its lock, held for the
    block when it can be taken (a folder that is gone is no one's)."""
    try:
        if not check_entry(store, directory=True):
            yield True
            return
        lock = DirectoryLock.acquire(store, "clean up")
    except JobError:  # in use, or not the job's own folder (a link planted there)
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def _one_input(states: list[ShardState], count: int) -> None:
    """Refuse to merge shards that last ran over different inputs (some forced onto
    another input, the others not yet): each would pass its own row count, and the
    output would mix the two.

    Raises:
        JobError: Naming the input of each group of shards, and what to run.
    """
    groups: dict[tuple[Any, Any], list[ShardState]] = {}
    where: dict[tuple[Any, Any], str] = {}
    for state in states:
        record = read_job_record(state.directory / JOB_FILE) or {}
        said = record.get("input")
        said = said if isinstance(said, dict) else {}
        key = (said.get("digest"), said.get("rows"))
        groups.setdefault(key, []).append(state)
        where.setdefault(key, str(said.get("where") or "an input it did not record"))
    if len(groups) < 2:
        return
    lines = [
        f"\n  {where[key]}: shard{'s' if len(group) > 1 else ''} "
        + ", ".join(str(s.index) for s in group[:LISTED_SHARDS])
        + (f" and {len(group) - LISTED_SHARDS} more" if len(group) > LISTED_SHARDS else "")
        for key, group in groups.items()
    ]
    raise JobError(
        f"cannot merge the {count} shards of {states[0].directory.parent}: they last ran "
        f"over {len(groups)} different inputs:{''.join(lines)}\nRun every shard over the "
        "same input (with --force where it changed), then merge."
    )


def _shard_files(
    states: list[ShardState], count: int
) -> tuple[list[Path], np.ndarray[Any, np.dtype[np.uint64]] | None, frozenset[int] | None]:
    """Every shard's files, and for shards of mixed inputs the id hashes to keep and
    the indexes of their files (None and None when no shard is mixed).

    Raises:
        JobError: A shard of mixed inputs has no list of the ids it kept.
    """
    files: list[Path] = []
    kept: list[np.ndarray[Any, np.dtype[np.uint64]]] = []
    kept_in: set[int] = set()
    for state in states:
        paths = shard_paths(state.directory)
        if state.mixed_inputs:
            hashes = read_input_ids(state.directory)
            if hashes is None:
                raise JobError(
                    f"shard {state.index} ({state.directory}) also holds rows of another "
                    f"input, and no list of its input's ids ({INPUT_IDS_FILE}): run it again "
                    f"with --shard {state.index}/{count} to write the list, then merge"
                )
            kept.append(hashes)
            kept_in.update(range(len(files), len(files) + len(paths)))
        files += paths
    if not kept:
        return files, None, None
    return files, np.unique(np.concatenate(kept)), frozenset(kept_in)


def merge_if_complete(run_dir: Path, *, jsonl: bool = False) -> Merged | None:
    """Merge if every shard is complete, no other process merges now and none has
    since the shards wrote their outputs (two shards that finish at the same moment
    merge once); None otherwise (logged: which shards it waits for)."""
    try:
        # What the shards' status files say: a shard that finishes while others run
        # need not count the rows of those that finished before it (the merge counts
        # them all, and names any shard whose rows are not all there).
        count, states = shard_states(run_dir, rows=False)
    except JobError:
        return None
    waiting = [s.index for s in states if s.state != "finished"]
    if waiting:
        log.info("merge_waits", output_dir=str(run_dir), shards=count, waiting_for=waiting)
        return None
    for attempt in range(_ATTEMPTS):
        if _merged_since(run_dir, states):  # by a shard that finished at the same moment
            log.info("merged_by_another", output_dir=str(run_dir), shards=count)
            return None
        try:
            return merge(run_dir, jsonl=jsonl)
        except JobError as error:  # another shard merges it right now, or one restarted
            reason = str(error)
            if "another run" not in reason or attempt == _ATTEMPTS - 1:
                log.warning("merge_skipped", output_dir=str(run_dir), reason=reason)
                return None
        except Exception as error:  # a full disk, say: this shard's own work is done
            log.warning(
                "merge_failed",
                output_dir=str(run_dir),
                error=f"{type(error).__name__}: {error}",
                fix=f"llm-annotator merge {run_dir}",
            )
            return None
        time.sleep(0.2 * (attempt + 1))
    return None


def _merged_since(run_dir: Path, states: list[ShardState]) -> bool:
    """Whether the merged output was written after every shard's own output."""
    merged = _written(run_dir / PARQUET_FILE) if is_merged(run_dir) else None
    if merged is None:
        return False
    shards = [_written(state.directory / PARQUET_FILE) for state in states]
    return all(shard is not None and shard < merged for shard in shards)


def _written(path: Path) -> int | None:
    """When ``path`` was last written (ns), or None if it is not there (the entry
    itself: a link is not followed)."""
    try:
        return os.lstat(path).st_mtime_ns
    except OSError:
        return None


@contextlib.contextmanager
def _locked(directories: list[Path]) -> Iterator[None]:
    locks: list[DirectoryLock] = []
    try:
        for directory in directories:
            locks.append(DirectoryLock.acquire(directory, "merge"))
        yield
    finally:
        for lock in locks:
            lock.release()


def _column_order(directory: Path) -> list[str]:
    """The columns of a shard's own output, in its order ([] if it has none readable)."""
    try:
        with open_binary(directory / PARQUET_FILE) as file:
            return list(pq.read_schema(file).names)
    except (OSError, ValueError):  # none, or not Parquet (pyarrow's ArrowInvalid)
        return []


def _shard_reports(states: list[ShardState]) -> list[dict[str, Any]]:
    """What the merged report keeps of each shard's own ``report.json`` (its checked
    ``this_run`` and ``per_server``).

    Raises:
        RunDirectoryError: A shard's report is a link, not a regular file, or not a
            report.
    """
    shards = []
    for state in states:
        own = read_report(state.directory)
        parts = {key: own[key] for key in ("this_run", "per_server") if key in own}
        shards.append({"shard": state.index, "rows": state.total, **parts})
    return shards
