"""How a run directory stands, for ``llm-annotator status``: read from its files, from
another process, while the job runs or after it ended.

The shards say what is done (each id's best record, as the consolidation picks it);
``status.json``, which a running job rewrites every few seconds, says how many rows the
job takes, how fast it goes and whether it ended; the directory's lock says whether a
process holds it now.

The run directory is read as untrusted: ``job.json`` must be a job record (else one
line naming it), ``status.json`` is advisory and each of its fields is used only if it
is of the type and range the job writes (a link or a FIFO there is not followed and
counts as no status at all).
"""

from __future__ import annotations

import asyncio
import math
import os
import socket
import stat
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import structlog

from llm_annotator.errors import JobError, RunDirectoryError
from llm_annotator.jobs.files import atomic_write, check_entry, read_bytes
from llm_annotator.jobs.ids import IdSet
from llm_annotator.jobs.rundir.fingerprint import read_job_record
from llm_annotator.jobs.rundir.fleet import fleet_now
from llm_annotator.jobs.rundir.partitions import UnitCounts, read_corpus_record, read_unit_records
from llm_annotator.jobs.rundir.store import (
    JOB_FILE,
    LOCK_FILE,
    is_error_record,
    read_shard,
    shard_paths,
)
from llm_annotator.jobs.watch.outcome import ENDINGS
from llm_annotator.jobs.watch.timeline import last_servers

log = structlog.get_logger(__name__)

STATUS_FILE = "status.json"
"""The job's own account of itself, rewritten every few seconds while it runs."""
STATUS_INTERVAL = 5.0
"""Seconds between two writes of ``status.json``."""
_STALE = 3 * STATUS_INTERVAL
"""Seconds after which a ``status.json`` that says running, from another host, is not
believed any more (its job stopped writing it: killed, or its host is gone)."""
STATES = ("running", "consolidating", "finished", "interrupted", "failed")
"""The states a job writes in ``status.json``."""


class StatusFile:
    """Writes ``status.json`` for a running job: every :data:`STATUS_INTERVAL` seconds
    as the job's :class:`~llm_annotator.jobs.watch.observer.Observer` says (in a
    thread, so a slow file system never holds up the job), and once more when the job
    ends, with its final state.

    Args:
        directory: The run directory.
        total: Rows the job takes (a sample's size with ``limit``).
    """

    def __init__(self, directory: Path, total: int) -> None:
        self.path = directory / STATUS_FILE
        self.total = total
        self.state = "running"
        """What the periodic writes say: ``running``, then ``consolidating``."""
        self.started = _now()
        self._pid = os.getpid()
        self._refused = False

    def write(
        self, figures: dict[str, Any], state: str | None = None, error: str | None = None
    ) -> None:
        """Replace ``status.json`` whole (no fsync: it is advisory, rewritten soon), from
        a temporary file of a fresh name. A failed write is left for the next one; the
        job's own writes report a full disk. An entry planted under the name (a link, a
        FIFO) is left alone, logged once.
        """
        body = {
            "state": state or self.state,
            "pid": self._pid,
            "host": socket.gethostname(),
            "started": self.started,
            "updated": _now(),
            "total": self.total,
            **figures,
        }
        if error is not None:
            body["error"] = error
        try:
            with atomic_write(self.path, durable=False) as file:
                file.write(orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
        except OSError:
            pass
        except RunDirectoryError as error:
            if not self._refused:
                self._refused = True
                log.warning("status_not_written", path=str(self.path), error=str(error))

    async def begin(self) -> None:
        """Check that ``status.json`` may be written, before the job starts.

        Raises:
            RunDirectoryError: It is a link or not a regular file.
        """
        await asyncio.to_thread(check_entry, self.path)

    async def observe(self, figures: dict[str, Any]) -> None:
        """Rewrite it with the job's ``figures`` now (in a thread)."""
        await asyncio.to_thread(self.write, figures)

    async def end(self, figures: dict[str, Any], state: str, error: str | None) -> None:
        """Write how the job ended (one of ``ENDINGS``), unless a job started in the
        directory since this one let go of it."""
        if await asyncio.to_thread(self._still_ours):
            await asyncio.to_thread(self.write, figures, state, error)

    def _still_ours(self) -> bool:
        """Whether ``status.json`` is this job's (a job started in the directory since
        this one let go of it writes its own)."""
        said = _read_status(self.path.parent)
        return said.get("pid") in (None, self._pid) or said.get("host") != socket.gethostname()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True, slots=True)
class RunStatus:
    """What a run directory holds now.

    Attributes:
        output_dir: The run directory.
        state: ``running`` (a process holds the directory, or on another host its
            ``status.json`` is fresh), ``consolidating`` (writing the output),
            ``finished``, ``interrupted``, ``failed``, or ``stopped`` (nothing runs it
            and it did not say how it ended: killed, or an older run).
        pid: The process that holds (or last held) the directory, if known.
        host: The host of that process, if known.
        total: Rows the job takes, if a job has said so.
        done: Ids with a result (answered or error rows). In a directory of
            ``mixed_inputs``, the ids of the current input only, as its job last
            counted them (None if it has not said).
        succeeded: Ids with an answer (of every input, in a directory of mixed inputs;
            so are the counts by error type and by server).
        failed: Ids whose best record is an error row (likewise).
        by_error_type: Those error rows by type.
        per_server: Ids by the server that answered them (error rows included).
        rows_per_second: The running job's last rate, if known.
        eta_seconds: Its estimate of the time left, if known.
        updated: When the job last wrote its status (ISO 8601), if it did.
        model: The model in the job's fingerprint.
        sample: The sample of a trial run (``limit``, ``shuffle_seed``), or None.
        error: Why the job failed, if it said.
        servers: Each server's state and evictions at the last snapshot of the run's
            timeline (``{"state": ..., "evictions": ...}`` by URL), if it has one.
        mixed_inputs: The directory holds results of rows of other inputs too (a job
            over another input was started in it with ``--force``); the output keeps
            only the current input's rows.
        stored: Ids with a result in the directory, of every input.
    """

    output_dir: str
    state: str
    pid: int | None
    host: str | None
    total: int | None
    done: int | None
    succeeded: int
    failed: int
    by_error_type: dict[str, int] = field(default_factory=dict)
    per_server: dict[str, int] = field(default_factory=dict)
    rows_per_second: float | None = None
    eta_seconds: float | None = None
    updated: str | None = None
    model: str | None = None
    sample: dict[str, Any] | None = None
    error: str | None = None
    servers: dict[str, dict[str, Any]] = field(default_factory=dict)
    mixed_inputs: bool = False
    stored: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The status as a JSON-able dict (what ``status --json`` prints)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def run_status(output_dir: str | os.PathLike[str]) -> RunStatus:
    """Read how a run directory stands; safe while a job writes it.

    Raises:
        JobError: The directory does not exist or holds no job (no ``job.json``).
        RunDirectoryError: ``job.json`` (or a shard file) is a link, not a regular file,
            or not a job record.
    """
    directory = Path(output_dir)
    job_path = directory / JOB_FILE
    if not directory.is_dir():
        raise JobError(f"{directory}: no such directory")
    try:
        job = read_job_record(job_path)
    except OSError as error:
        raise RunDirectoryError(
            f"cannot read {job_path}: {error.strerror or error}", path=str(job_path)
        ) from None
    if job is None:
        raise JobError(f"{directory} holds no annotation job (no {JOB_FILE})")
    fingerprint: dict[str, Any] = job["fingerprint"]
    model = fingerprint.get("model")
    tally = _Tally.of(directory)
    status = _read_status(directory)
    state, pid, host = _state(directory, status)
    live = state in ("running", "consolidating")
    stored = tally.succeeded + tally.failed
    mixed = job.get("mixed_inputs") is True
    done: int | None = stored
    if mixed:  # the store also holds rows of other inputs: only the job knows its own
        done = min(status["done"], stored) if "done" in status else None
    return RunStatus(
        output_dir=str(directory),
        state=state,
        pid=pid,
        host=host,
        total=status.get("total"),
        done=done,
        succeeded=tally.succeeded,
        failed=tally.failed,
        by_error_type=dict(tally.by_error_type.most_common()),
        per_server=dict(tally.per_server.most_common()),
        rows_per_second=status.get("rows_per_second") if live else None,
        eta_seconds=status.get("eta_seconds") if live else None,
        updated=status.get("updated"),
        model=model if isinstance(model, str) else None,
        sample=_sample(fingerprint.get("sample")),
        error=status.get("error"),
        servers=_servers_now(directory),
        mixed_inputs=mixed,
        stored=stored,
    )


def corpus_status(output_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """How a corpus job's run directory stands, from its records (``corpus.json``, a
    record per finished unit) and each process's ``status.json``; never from the
    results themselves. None if the directory holds no corpus job.

    Raises:
        RunDirectoryError: ``corpus.json`` or a unit's record is not the job's own.
    """
    directory = Path(output_dir)
    record = read_corpus_record(directory)
    if record is None:
        return None
    listing = record["corpus"]
    outputs = set(listing.get("units") or ())
    counts = UnitCounts()
    for unit in read_unit_records(directory).values():
        if unit.get("output") in outputs:
            counts.add(unit)
    places = [directory]
    with os.scandir(directory) as entries:
        places += sorted(
            directory / e.name
            for e in entries
            if e.name.startswith(("shard-", "worker-")) and e.is_dir(follow_symlinks=False)
        )
    processes = []
    for place in places:
        said = _read_status(place)
        if not said and lock_holder(place) is None:
            continue
        state, pid, host = _state(place, said)
        live = state in ("running", "consolidating")
        processes.append(
            {
                "where": place.name if place != directory else ".",
                "state": state,
                "pid": pid,
                "host": host,
                "total": said.get("total"),
                "done": said.get("done"),
                "rows_per_second": said.get("rows_per_second") if live else None,
                "eta_seconds": said.get("eta_seconds") if live else None,
            }
        )
    model = record["fingerprint"].get("model")
    return {
        "output_dir": str(directory),
        "kind": "corpus",
        "files": len(listing.get("files") or ()),
        "skipped_files": len(listing.get("skipped") or ()),
        "units": len(outputs),
        "units_done": counts.units,
        **counts.counts,
        "by_error_type": counts.by_error_type,
        "complete": counts.units == len(outputs),
        "model": model if isinstance(model, str) else None,
        "processes": processes,
        "fleet": fleet_now(directory),
    }


def run_state(output_dir: str | os.PathLike[str]) -> str:
    """What :func:`run_status` says of a run's state, without counting its rows."""
    directory = Path(output_dir)
    return _state(directory, _read_status(directory))[0]


def _sample(value: Any) -> dict[str, Any] | None:
    """A fingerprint's sample (``limit``, ``shuffle_seed``), if it is of the shape a job
    records.

    Examples:
        >>> _sample({"limit": 5, "shuffle_seed": None}), _sample({"limit": "5"})
        ({'limit': 5, 'shuffle_seed': None}, None)
    """
    if not isinstance(value, dict) or not _count(value.get("limit")):
        return None
    seed = value.get("shuffle_seed")
    if seed is not None and not _count(seed):
        return None
    return {"limit": value["limit"], "shuffle_seed": seed}


def _count(value: Any) -> bool:
    """Whether a value is an int of at least 0, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _servers_now(directory: Path) -> dict[str, dict[str, Any]]:
    """The servers of the timeline's last snapshot, with the pool's evictions of each."""
    last = last_servers(directory)
    return {
        url: {"state": values.get("state"), "evictions": values.get("evictions", 0)}
        for url, values in last.items()
    }


def _state(directory: Path, status: dict[str, Any]) -> tuple[str, int | None, str | None]:
    """The run's state, the pid of its process and that process's host.

    A process of this host that holds the lock runs it. A job on another host (a
    cluster's compute node, the directory on a shared file system) cannot be seen in
    this host's lock table; its ``status.json``, rewritten every few seconds, is then
    believed while it is fresh.
    """
    said = status.get("state")
    pid: int | None = status.get("pid")
    host: str | None = status.get("host")
    holder = lock_holder(directory)
    if holder is not None:
        live = said == "consolidating" and pid == holder
        return ("consolidating" if live else "running"), holder, socket.gethostname()
    if said in ("running", "consolidating"):
        if host is not None and host != socket.gethostname() and _fresh(status):
            return said, pid, host
        return "stopped", pid, host
    if said in ENDINGS:
        return said, pid, host
    return "stopped", pid, host


def _fresh(status: dict[str, Any]) -> bool:
    """Whether ``status.json`` was written within the last :data:`_STALE` seconds (by
    its ``updated``, a time with its zone; any other value is not fresh)."""
    try:
        updated = datetime.fromisoformat(str(status.get("updated")))
    except ValueError:
        return False
    if updated.tzinfo is None:
        return False
    return (datetime.now(UTC) - updated).total_seconds() <= _STALE


@dataclass
class _Tally:
    """Counts over the shards, each id once by its best record (a success beats an
    error; among errors the last one counts). Each id succeeds at most once (the store
    writes a done id never again), so successes need no memory per id beyond an
    :class:`IdSet`; errors, usually few, are kept by id until the end."""

    succeeded: int = 0
    failed: int = 0
    by_error_type: Counter[str] = field(default_factory=Counter)
    per_server: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, directory: Path) -> _Tally:
        tally = cls()
        answered = IdSet()
        errors: dict[Any, tuple[str, str]] = {}
        for path in shard_paths(directory):
            try:
                for _, _, record in read_shard(path):
                    row_id = record["id"]
                    server = str(record.get("server") or "(none)")
                    if not is_error_record(record):
                        if answered.add(row_id):
                            tally.succeeded += 1
                            tally.per_server[server] += 1
                    else:
                        errors[row_id] = (str(record.get("error_type") or "error"), server)
            except OSError:
                continue  # a shard removed meanwhile (an empty one, when its run closed)
        for row_id, (kind, server) in errors.items():
            if row_id not in answered:
                tally.failed += 1
                tally.by_error_type[kind] += 1
                tally.per_server[server] += 1
        return tally


def _read_status(directory: Path) -> dict[str, Any]:
    """What ``status.json`` says, field by field: each field :data:`_STATUS_FIELDS`
    checks is kept only if it is of the type and range a job writes; others are
    dropped. {} if there is none, or it is a link, not a regular file, or not JSON.

    Examples:
        >>> sorted(_checked_status({"state": "finished", "pid": True, "total": 3,
        ...     "rows_per_second": "fast", "eta_seconds": 1.5, "host": 5}).items())
        [('eta_seconds', 1.5), ('state', 'finished'), ('total', 3)]
    """
    try:
        data = read_bytes(directory / STATUS_FILE)
        status = orjson.loads(data) if data is not None else {}
    except (OSError, RunDirectoryError, orjson.JSONDecodeError):
        return {}
    return _checked_status(status) if isinstance(status, dict) else {}


def _checked_status(status: dict[str, Any]) -> dict[str, Any]:
    return {
        name: status[name]
        for name, check in _STATUS_FIELDS.items()
        if name in status and check(status[name])
    }


def _rate(value: Any) -> bool:
    """Whether a value is a finite number of at least 0, not a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return (isinstance(value, int) or math.isfinite(value)) and value >= 0


def _text(value: Any) -> bool:
    return isinstance(value, str)


_STATUS_FIELDS: dict[str, Any] = {
    "state": lambda value: value in STATES,
    "pid": lambda value: _count(value) and value > 0,
    "host": _text,
    "started": _text,
    "updated": _text,
    "total": _count,
    "done": _count,
    "rows_per_second": _rate,
    "eta_seconds": _rate,
    "error": _text,
}
"""The fields of ``status.json`` that are read, and the check of each."""


def lock_holder(directory: Path) -> int | None:
    """The pid of the process holding the directory's lock now, or None.

    Read from the kernel's table of locks (``/proc/locks``) by the lock file's inode,
    so that nothing here takes the lock (which would keep a job from starting).
    """
    lock = directory / LOCK_FILE
    try:
        info = os.lstat(lock)  # a link is not the job's lock: not followed
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    try:
        table = Path("/proc/locks").read_text()
    except OSError:  # not Linux: the pid the lock file names, if that process lives
        return _named_holder(lock)
    where = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for line in table.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a "->" marks a waiter)
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == where:
            try:
                return int(parts[4])
            except ValueError:
                return None
    return None


def _named_holder(lock: Path) -> int | None:
    try:
        pid = int((read_bytes(lock) or b"").strip())
        if pid <= 0:  # 0 and -1 name process groups, not a process
            return None
        os.kill(pid, 0)
    except (OSError, ValueError, RunDirectoryError):
        return None
    return pid
