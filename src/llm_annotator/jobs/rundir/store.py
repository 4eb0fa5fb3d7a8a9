"""The result store of an annotation job: append-only shards, each id once, resumable.

A run directory looks like this::

    output_dir/
      job.json                   the fingerprint of the settings, timestamps, history
      .lock                      flock'ed by the one process using the directory
      shards/part-<UTC time>-<pid>-<n>.jsonl   one JSON record a line; one new shard
                                                each time the store is opened
      annotations.parquet        written by consolidate() at the end

Each record is one line written whole: a process killed mid-write leaves at most a
truncated last line, which the next open cuts off (that row is simply run again).
Opening reads every shard and keeps the ids that have a result, not the records, in
compact :class:`~llm_annotator.jobs.ids.IdSet` s. A store that found no shard may hand
each line it writes to a :class:`LineSink` as well (:meth:`ResultStore.follow`), so
that what it wrote can be consolidated without reading it back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import re
import threading
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol

import numpy as np
import orjson
import structlog

from llm_annotator.errors import JobError, OutputWriteError
from llm_annotator.jobs.files import (
    atomic_write,
    check_entry,
    fsync_directory,
    make_directory,
    open_binary,
    open_file,
)
from llm_annotator.jobs.ids import (
    IdSet,
    RowId,
    content_of,
    hash_id,
    id_problem,
    is_valid_id,
)
from llm_annotator.jobs.rundir.fingerprint import job_record, read_job_record

log = structlog.get_logger(__name__)

__all__ = [
    "JOB_FILE",
    "LOCK_FILE",
    "SHARDS_DIR",
    "DirectoryLock",
    "LineSink",
    "ResultStore",
    "StoredRecords",
    "atomic_write",
    "is_error_record",
    "output_write_error",
    "read_shard",
    "shard_paths",
]

JOB_FILE = "job.json"
SHARDS_DIR = "shards"
LOCK_FILE = ".lock"
_WRITE_BUFFER = 1 << 20
"""Bytes of records buffered before they are written without waiting for flush()."""
_SHARD_NAME = re.compile(r"^part-.*-(\d+)\.jsonl$")


def is_error_record(record: Mapping[str, Any]) -> bool:
    """Whether a result record is an error row: its ``"error"`` field is truthy."""
    return bool(record.get("error"))


def output_write_error(
    error: OSError, path: Path | str, directory: Path | str, *, done: int | None = None
) -> OutputWriteError:
    """A write that failed, as one message: which file, why, what to do, that it resumes.

    Examples:
        >>> import errno, os
        >>> full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        >>> print(output_write_error(full, "/runs/a/shards/part-1.jsonl", "/runs/a", done=7))
        cannot write /runs/a/shards/part-1.jsonl: No space left on device. The 7 rows ...
    """
    reason = error.strerror or str(error) or type(error).__name__
    kept = f"The {done} rows written before are kept. " if done is not None else ""
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = f"Free space on the file system that holds {directory} (or raise the quota)"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"Make {directory} writable (or give another output directory)"
    else:
        fix = f"Check the file system that holds {directory}"
    return OutputWriteError(
        f"cannot write {path}: {reason}. {kept}{fix}, then run the same command again: it "
        "resumes, and sends only the rows that have no result yet.",
        path=str(path),
    )


def shard_paths(output_dir: str | os.PathLike[str]) -> list[Path]:
    """The shard files of a run directory, oldest first (by their sequence number).

    Raises:
        RunDirectoryError: ``shards`` or an entry in it named like a shard is a link or
            not a regular file (other names there are ignored).
    """
    folder = Path(output_dir) / SHARDS_DIR
    if not check_entry(folder, directory=True):
        return []
    numbered = []
    with os.scandir(folder) as entries:
        for entry in entries:
            match = _SHARD_NAME.match(entry.name)
            if match is None:
                continue
            path = folder / entry.name
            if not entry.is_file(follow_symlinks=False):
                check_entry(path)  # raises: a link, a FIFO, a folder named like a shard
                continue  # removed meanwhile
            numbered.append((int(match.group(1)), entry.name, path))
    return [path for _, _, path in sorted(numbered)]


def read_shard(path: Path, *, repair: bool = False) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """The records of one shard, as ``(byte offset, line length, record)``.

    A line that is not a JSON object with a valid ``"id"`` is skipped with a warning
    naming the shard and line (its row will be run again). If it is the last line, or
    the last line has no newline, it is a write cut short by a killed process: with
    ``repair`` the file is truncated back to the end of the line before it.

    Args:
        path: The shard file.
        repair: Truncate a cut-short last line away (only while holding the lock).
    """
    bad: tuple[int, int] | None = None  # (line number, offset) of the latest bad line
    offset = 0
    flags = os.O_RDWR if repair else os.O_RDONLY
    with open_binary(path, flags, single=repair) as raw, io.BufferedReader(raw) as file:
        for number, line in enumerate(file, 1):
            if bad is not None:
                log.warning("shard_line_skipped", shard=str(path), line=bad[0])
                bad = None
            record = _parse(line) if line.endswith(b"\n") else None
            if record is None:
                bad = (number, offset)
            else:
                yield offset, len(line), record
            offset += len(line)
        if bad is not None and repair:  # the file opened, not whatever the name is now
            os.ftruncate(raw.fileno(), bad[1])
            os.fsync(raw.fileno())
    if bad is not None:
        log.warning(
            "truncated_line_repaired" if repair else "truncated_line_ignored",
            shard=str(path),
            line=bad[0],
            dropped_bytes=offset - bad[1],
        )


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if isinstance(record, dict) and id_problem(record.get("id")) is None:
        return record
    return None


@dataclass(frozen=True, slots=True)
class StoredRecords:
    """What a run directory's records say of their rows, one entry per record in the
    order written.

    Attributes:
        ids: Each record's id hash (:func:`~llm_annotator.jobs.ids.hash_id`).
        contents: The content hash of the row it was made from, 0 where not recorded.
        ok: Whether it is a success.
    """

    ids: np.ndarray[Any, np.dtype[np.uint64]]
    contents: np.ndarray[Any, np.dtype[np.uint64]]
    ok: np.ndarray[Any, np.dtype[np.bool_]]


def _holds(hashes: np.ndarray[Any, np.dtype[np.uint64]], row_id: RowId) -> bool:
    """Whether the sorted id hashes hold ``row_id``'s."""
    hashed = np.uint64(hash_id(row_id))
    at = int(np.searchsorted(hashes, hashed))
    return at < len(hashes) and bool(hashes[at] == hashed)


class _Records:
    """:class:`StoredRecords` as they are read: 17 bytes a record."""

    __slots__ = ("contents", "ids", "ok")

    def __init__(self) -> None:
        self.ids = array("Q")
        self.contents = array("Q")
        self.ok = bytearray()

    def add(self, row_id: RowId, content: int, ok: bool) -> None:
        self.ids.append(hash_id(row_id))
        self.contents.append(content)
        self.ok.append(ok)

    def frozen(self) -> StoredRecords:
        return StoredRecords(
            np.frombuffer(self.ids, dtype=np.uint64).copy(),
            np.frombuffer(self.contents, dtype=np.uint64).copy(),
            np.frombuffer(bytes(self.ok), dtype=np.uint8).astype(bool),
        )


class LineSink(Protocol):
    """What follows a store's writing (:meth:`ResultStore.follow`)."""

    def add(self, line: bytes) -> None:
        """One record as the store writes it into its shard: its JSON, before the
        newline."""


class DirectoryLock:
    """An exclusive ``flock`` on ``<directory>/.lock``, which holds the owner's pid."""

    __slots__ = ("_file",)

    def __init__(self, file: IO[bytes]) -> None:
        self._file: IO[bytes] | None = file

    @classmethod
    def acquire(cls, directory: Path, action: str) -> DirectoryLock:
        """Take the lock without waiting.

        Raises:
            JobError: If another process (or another store in this one) holds it.
        """
        path = directory / LOCK_FILE
        try:
            file = os.fdopen(open_file(path, os.O_RDWR | os.O_CREAT, single=True), "r+b", 0)
        except OSError as error:
            raise output_write_error(error, path, directory) from None
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = file.read().decode(errors="replace").strip() or "unknown"
            file.close()
            hint = (
                "a ResultStore of this process is still open; close it first"
                if owner == str(os.getpid())
                else "wait for it to finish or stop it, or choose another output directory"
            )
            raise JobError(
                f"cannot {action} {directory}: another run (pid {owner}) is using it; {hint}"
            ) from None
        except OSError as error:
            file.close()
            raise JobError(
                f"cannot lock {path}: {error}; the output directory must be on a file "
                "system that supports flock"
            ) from error
        try:
            file.truncate(0)
            file.write(f"{os.getpid()}\n".encode())
        except OSError as error:
            file.close()  # closing the file lets go of the lock
            raise output_write_error(error, path, directory) from None
        return cls(file)

    def release(self) -> None:
        """Let go of the lock; idempotent."""
        if self._file is not None:
            file, self._file = self._file, None
            fcntl.flock(file, fcntl.LOCK_UN)
            file.close()


class ResultStore:
    """Where an annotation job's results go, each row id exactly once, across restarts.

    Open it with :meth:`open`; it holds the directory's lock until :meth:`close` (also
    a context manager). :meth:`is_done` and :meth:`append` belong to one thread (the
    job's event loop); :meth:`flush` and :meth:`sync` may run in another one at the same
    time (``await asyncio.to_thread(store.sync)``).
    """

    def __init__(
        self,
        directory: Path,
        lock: DirectoryLock | None,
        fingerprint: dict[str, Any],
        retry: bool | frozenset[str],
    ) -> None:
        """Use :meth:`open`."""
        self._directory = directory
        self._lock = lock
        self._fingerprint = fingerprint
        self._retry_errors = bool(retry)
        self._retry_types = retry if isinstance(retry, frozenset) else None
        """With retry_errors of some types only: those types."""
        self._succeeded = IdSet()
        self._errors = IdSet()
        self._retried = IdSet()  # error ids written since open, with retry_errors
        self._kept: set[RowId] = set()
        """Error ids found at open whose type is not retried (retry_errors of some types):
        done, though errors. Few, so a plain set."""
        self._recovered = 0  # ids in _errors that later got a success
        self._written = 0
        self._broken = False
        self._done_at_open = 0
        self._buffer = bytearray()
        self._buffer_lock = threading.Lock()  # append and flush may be on two threads
        self._file: IO[bytes] | None = None
        self._shard_path = directory / SHARDS_DIR / "unopened"
        self._mixed_inputs = False
        self._records = _Records()
        """Each record found at open: its id's hash, its row's content hash, success."""
        self._redo: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self._demoted: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self._redone = IdSet()
        self._previous_record: dict[str, Any] | None = None
        self._input_changed = False
        self._fresh = False
        self._sink: LineSink | None = None

    @classmethod
    def open(
        cls,
        output_dir: str | os.PathLike[str],
        fingerprint: Mapping[str, Any],
        *,
        force: bool = False,
        retry_errors: bool | frozenset[str] = False,
        input_identity: Mapping[str, Any] | None = None,
        exclusive: bool = True,
    ) -> ResultStore:
        """Open (or create) a run directory, read what is done, and start a new shard.

        Args:
            output_dir: The run directory; created if missing.
            fingerprint: What defines the results (see
                :func:`~llm_annotator.jobs.rundir.fingerprint.make_fingerprint`).
            force: Resume even if the directory was made with another fingerprint;
                the new one is recorded and the old one kept in the history.
            retry_errors: Count ids whose best record is an error as not done, so
                the job sends them again; a set of error types: only the ids whose
                latest error is of one of those types.
            input_identity: What identifies the job's input
                (:meth:`~llm_annotator.jobs.rows.inputs.InputIdentity.to_json`), recorded in
                ``job.json``: a directory made over another input is refused like other
                settings. None leaves the record's input as it is.
            exclusive: Hold the directory's lock while open. False where another
                protocol decides who writes (a corpus unit claimed with a lease, which a
                process that stopped without dying must not keep from another): each
                store still writes only its own new shard.

        Raises:
            FingerprintMismatchError: If the directory holds results made with other
                settings or another input and ``force`` is False.
            JobError: If another run is using the directory, or it cannot be written.
        """
        directory = Path(output_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True)  # the user's path: links followed
            make_directory(directory / SHARDS_DIR)  # the job's own: never a link
        except OSError as error:
            raise output_write_error(error, directory / SHARDS_DIR, directory) from None
        lock = DirectoryLock.acquire(directory, "open") if exclusive else None
        try:
            job_path = directory / JOB_FILE
            previous = read_job_record(job_path, force=force)
            job = job_record(
                previous,
                fingerprint,
                where=str(directory),
                now=datetime.now(UTC).isoformat(timespec="seconds"),
                force=force,
                identity=input_identity,
            )
            try:
                with atomic_write(job_path) as file:
                    file.write(orjson.dumps(job, option=orjson.OPT_INDENT_2) + b"\n")
            except OSError as error:
                raise output_write_error(error, job_path, directory) from None
            store = cls(directory, lock, job["fingerprint"], retry_errors)
            store._mixed_inputs = bool(job.get("mixed_inputs"))
            store._previous_record = previous
            old_input = (previous or {}).get("input")
            store._input_changed = (
                input_identity is not None
                and isinstance(old_input, Mapping)
                and old_input.get("digest") != input_identity.get("digest")
            )
            try:
                shards = store._scan(repair=exclusive)  # a write too: only with the lock
            except OSError as error:
                raise output_write_error(error, error.filename or directory, directory) from None
            store._done_at_open = store.num_done
            store._fresh = not shards
            try:
                store._start_shard(shards)
            except OSError as error:
                raise output_write_error(error, store._shard_path, directory) from None
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        log.info(
            "store_resumed" if shards else "store_opened",
            output_dir=str(directory),
            shards=len(shards),
            done=store.num_done,
            errors=store.num_errors,
            retry_errors=sorted(retry_errors)
            if isinstance(retry_errors, frozenset)
            else retry_errors,
        )
        return store

    def __enter__(self) -> ResultStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._file is None else "open"
        return (
            f"<ResultStore {state} dir={str(self._directory)!r} done={self.num_done} "
            f"errors={self.num_errors} written={self._written}>"
        )

    @property
    def output_dir(self) -> Path:
        """The run directory."""
        return self._directory

    @property
    def shard_path(self) -> Path:
        """The shard this store writes to (removed on close if nothing was written)."""
        return self._shard_path

    @property
    def mixed_inputs(self) -> bool:
        """Whether the directory may hold results of rows that are not in the current
        input (its input was changed with ``force``, or it was made before inputs were
        recorded): consolidate only the input's ids then."""
        return self._mixed_inputs

    @property
    def is_fresh(self) -> bool:
        """Whether the directory held no shard when the store opened: its records are
        all those this store writes."""
        return self._fresh

    def follow(self, sink: LineSink) -> None:
        """Hand ``sink`` each record this store writes from now on, as it writes it.

        Raises:
            JobError: If the store is not fresh (:attr:`is_fresh`) or has written
                already: the sink would not see every record of the directory.
        """
        if not self._fresh or self._written:
            raise JobError(
                f"the result store of {self._directory} found or wrote records before: "
                "a sink would miss them"
            )
        self._sink = sink

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The canonical fingerprint recorded for this run."""
        return dict(self._fingerprint)

    @property
    def num_done(self) -> int:
        """Ids with a result that counts as done (errors not, with ``retry_errors``)."""
        if self._retry_errors:
            return len(self._succeeded) + len(self._retried) + len(self._kept)
        return len(self._succeeded) + self.num_errors

    @property
    def num_errors(self) -> int:
        """Ids whose best record is an error row."""
        return len(self._errors) - self._recovered

    @property
    def num_written(self) -> int:
        """Records appended since this store was opened."""
        return self._written

    def is_done(self, row_id: RowId) -> bool:
        """Whether ``row_id`` has a result and must not be sent again."""
        if self._redo is not None and self._to_redo(row_id):
            return False
        if (
            self._demoted is not None
            and row_id not in self._redone
            and _holds(self._demoted, row_id)
        ):
            return not self._retry_errors  # its answers are stale: its errors decide
        if row_id in self._succeeded:
            return True
        if not self._errors or row_id not in self._errors:
            return False
        return not self._retry_errors or row_id in self._retried or row_id in self._kept

    @property
    def num_records(self) -> int:
        """Records found at open (until :meth:`records` hands them over)."""
        return len(self._records.ids)

    def records(self) -> StoredRecords:
        """What the records found at open say of their rows, for a job that compares
        them with its input (see :func:`~llm_annotator.jobs.rundir.changes.compare`);
        once: the store keeps them no longer."""
        records, self._records = self._records.frozen(), _Records()
        return records

    @property
    def input_changed(self) -> bool:
        """Whether the input's identity differs from the one ``job.json`` recorded."""
        return self._input_changed

    def undo_record(self) -> None:
        """Put back the ``job.json`` this store's opening replaced (a run refused before
        it sent anything must leave the directory as it found it)."""
        job_path = self._directory / JOB_FILE
        with contextlib.suppress(OSError):
            if self._previous_record is None:
                job_path.unlink(missing_ok=True)
            else:
                with atomic_write(job_path) as file:
                    file.write(orjson.dumps(self._previous_record, option=orjson.OPT_INDENT_2))
                    file.write(b"\n")

    def redo(
        self,
        id_hashes: np.ndarray[Any, np.dtype[np.uint64]],
        demoted: np.ndarray[Any, np.dtype[np.uint64]] | None = None,
    ) -> None:
        """Count the rows of these id hashes (sorted) as not done until each has a new
        record: their input changed since their results were made. ``demoted`` (sorted):
        rows whose only answers were made from content they no longer hold, so that
        their latest error decides, as for a row that never had an answer."""
        self._redo = id_hashes if len(id_hashes) else None
        self._demoted = demoted if demoted is not None and len(demoted) else None

    def _to_redo(self, row_id: RowId) -> bool:
        redo = self._redo
        return redo is not None and _holds(redo, row_id) and row_id not in self._redone

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one result record (buffered until :meth:`flush`) and mark its id done.

        Args:
            record: A JSON-able mapping with an ``"id"``; an error row has a truthy
                ``"error"``.

        Raises:
            JobError: If the store is closed, the id is missing or invalid, the id
                already has a result, or the record is not JSON-able.
        """
        if self._file is None:
            raise JobError(f"the result store of {self._directory} is closed")
        row_id = record.get("id")
        if not is_valid_id(row_id):
            raise JobError(f"a result record needs a valid 'id': {row_id!r} {id_problem(row_id)}")
        if self.is_done(row_id):
            raise JobError(
                f"row id {row_id!r} already has a result in {self._directory}; "
                "each id is written once"
            )
        try:
            line = orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError as error:
            raise JobError(f"the result of row {row_id!r} is not JSON-able: {error}") from error
        with self._buffer_lock:
            self._buffer += line
            self._buffer += b"\n"
        if self._sink is not None:
            self._sink.add(line)
        failed = is_error_record(record)
        if self._redo is not None or self._demoted is not None:
            self._redone.add(row_id)
        self._note(row_id, error=failed)
        if failed and self._retry_errors:
            self._retried.add(row_id)
        elif not failed:
            self._kept.discard(row_id)
        self._written += 1
        if len(self._buffer) >= _WRITE_BUFFER:
            self.flush()

    def flush(self) -> None:
        """Hand the buffered records to the operating system (whole lines only)."""
        with self._buffer_lock:
            if self._file is None or not self._buffer:
                return
            view = memoryview(self._buffer)
            done = 0
            try:
                while done < len(view):
                    done += self._file.write(view[done:]) or 0
            except OSError as error:
                self._broken = True
                pending = view[done:].tobytes().count(b"\n")
                raise self._write_error(error, pending) from None
            finally:
                view.release()
                del self._buffer[:done]

    def sync(self) -> None:
        """Flush, then make the records durable on disk (``fsync``)."""
        self.flush()
        if self._file is not None:
            try:
                os.fsync(self._file.fileno())
            except OSError as error:
                self._broken = True
                raise self._write_error(error, 0) from None

    def _write_error(self, error: OSError, pending: int) -> OutputWriteError:
        # Rows on disk: those appended, less the lines not yet written (a cut-off last
        # line counts as not written; resuming repairs it).
        on_disk = self._done_at_open + max(self._written - pending, 0)
        return output_write_error(error, self._shard_path, self._directory, done=on_disk)

    def close(self) -> None:
        """Flush, fsync and release the lock; idempotent.

        After a failed write (a full disk) it only closes and unlocks: the failure was
        reported once already, and what is on disk stays as it is.
        """
        if self._file is None:
            return
        try:
            if not self._broken:
                self.sync()
        finally:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
            if self._written == 0:
                with contextlib.suppress(OSError):
                    self._shard_path.unlink()
            if self._lock is not None:
                self._lock.release()
            log.info(
                "store_closed",
                output_dir=str(self._directory),
                written=self._written,
                done=self.num_done,
                errors=self.num_errors,
                write_failed=self._broken,
            )

    def discard(self) -> None:
        """Close without writing what is still buffered (the unit's claim was lost to
        another worker, which does those rows): what is on disk stays as it is."""
        with self._buffer_lock:
            self._buffer.clear()
        self._broken = True  # no sync: nothing more of this store is written
        self.close()

    def _note(self, row_id: RowId, *, error: bool) -> None:
        """Count one record; a success outranks any error for the same id."""
        if error:
            if row_id not in self._succeeded:
                self._errors.add(row_id)
        elif self._succeeded.add(row_id) and self._errors and row_id in self._errors:
            self._recovered += 1

    def _scan(self, *, repair: bool = True) -> list[Path]:
        """Read what the shards hold; ``repair`` cuts a cut-off last line (only with the
        lock: without it, another writer may still be appending to that shard)."""
        shards = shard_paths(self._directory)
        types = self._retry_types
        for path in shards:
            for _, _, record in read_shard(path, repair=repair):
                row_id = record["id"]
                failed = is_error_record(record)
                self._note(row_id, error=failed)
                self._records.add(row_id, content_of(record), not failed)
                if types is None:
                    continue
                if not failed:
                    self._kept.discard(row_id)
                elif row_id not in self._succeeded:
                    # The latest error of an id decides whether it is sent again.
                    if record.get("error_type") in types:
                        self._kept.discard(row_id)
                    else:
                        self._kept.add(row_id)
        return shards

    def _start_shard(self, existing: list[Path]) -> None:
        match = _SHARD_NAME.match(existing[-1].name) if existing else None
        number = int(match.group(1)) + 1 if match else 1
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
        self._shard_path = (
            self._directory / SHARDS_DIR / f"part-{stamp}-{os.getpid()}-{number:06d}.jsonl"
        )
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        self._file = os.fdopen(open_file(self._shard_path, flags), "wb", buffering=0)
        fsync_directory(self._shard_path.parent)
