"""How a run directory stands, for ``llm-annotator status``: read from its files, from
another process, while the job runs or after it ended.

The shards say what is done (each id's best record, as the consolidation picks it);
``status.json``, which a running job rewrites every few seconds, says how many rows the
job takes, how fast it goes and whether it ended; the directory's lock says whether a
process holds it now.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from llm_annotator.errors import JobError, RunInterruptedError
from llm_annotator.jobs.store import (
    JOB_FILE,
    LOCK_FILE,
    atomic_write,
    is_error_record,
    read_shard,
    shard_paths,
)

STATUS_FILE = "status.json"
"""The job's own account of itself, rewritten every few seconds while it runs."""
STATUS_INTERVAL = 5.0
"""Seconds between two writes of ``status.json`` at most."""


class StatusFile:
    """Writes ``status.json`` for a running job: at most every ``interval`` seconds, and
    once more when the job ends (its final state).

    Args:
        directory: The run directory.
        total: Rows the job takes (a sample's size with ``limit``).
        clock: Seconds, for the interval (tests give their own).
    """

    def __init__(
        self, directory: Path, total: int, *, interval: float = STATUS_INTERVAL, clock: Any = None
    ) -> None:
        self.path = directory / STATUS_FILE
        self.total = total
        self.interval = interval
        self.clock = clock or time.monotonic
        self._written: float | None = None
        self.started = _now()

    def due(self) -> bool:
        """Whether a write is due."""
        return self._written is None or self.clock() - self._written >= self.interval

    def write(
        self, figures: dict[str, Any], state: str = "running", error: str | None = None
    ) -> None:
        """Replace ``status.json`` whole; a failed write is left for the next one (the
        job's own writes report a full disk)."""
        self._written = self.clock()
        body = {
            "state": state,
            "pid": os.getpid(),
            "started": self.started,
            "updated": _now(),
            "total": self.total,
            **figures,
        }
        if error is not None:
            body["error"] = error
        try:
            with atomic_write(self.path) as file:
                file.write(orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
        except OSError:
            pass

    def show(self, progress: Any) -> None:
        """``Progress``'s ``on_show``: write the figures if a write is due."""
        if self.due():
            self.write(progress.figures())

    @contextlib.contextmanager
    def final_state(self, progress: Any) -> Iterator[None]:
        """Write how the job in the block ended: ``finished``, ``interrupted`` (a
        signal) or ``failed`` (with the error)."""
        try:
            yield
        except RunInterruptedError:
            self.write(progress.figures(), "interrupted")
            raise
        except BaseException as error:
            self.write(progress.figures(), "failed", str(error) or type(error).__name__)
            raise
        self.write(progress.figures(), "finished")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass(frozen=True, slots=True)
class RunStatus:
    """What a run directory holds now.

    Attributes:
        output_dir: The run directory.
        state: ``running`` (a process holds the directory), ``finished``,
            ``interrupted``, ``failed``, or ``stopped`` (no process holds it and it did
            not say how it ended: killed, or an older run).
        pid: The process that holds (or last held) the directory, if known.
        total: Rows the job takes, if a job has said so.
        done: Ids with a result (answered or error rows).
        succeeded: Ids with an answer.
        failed: Ids whose best record is an error row.
        by_error_type: Those error rows by type.
        per_server: Ids by the server that answered them (error rows included).
        rows_per_second: The running job's last rate, if known.
        eta_seconds: Its estimate of the time left, if known.
        updated: When the job last wrote its status (ISO 8601), if it did.
        model: The model in the job's fingerprint.
        sample: The sample of a trial run (``limit``, ``shuffle_seed``), or None.
        error: Why the job failed, if it said.
    """

    output_dir: str
    state: str
    pid: int | None
    total: int | None
    done: int
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

    def to_json(self) -> dict[str, Any]:
        """The status as a JSON-able dict (what ``status --json`` prints)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def run_status(output_dir: str | os.PathLike[str]) -> RunStatus:
    """Read how a run directory stands; safe while a job writes it.

    Raises:
        JobError: The directory does not exist or holds no job (no ``job.json``).
    """
    directory = Path(output_dir)
    job_path = directory / JOB_FILE
    if not directory.is_dir():
        raise JobError(f"{directory}: no such directory")
    try:
        job = orjson.loads(job_path.read_bytes())
    except FileNotFoundError:
        raise JobError(f"{directory} holds no annotation job (no {JOB_FILE})") from None
    except (OSError, orjson.JSONDecodeError) as error:
        raise JobError(f"cannot read {job_path}: {error}") from None
    fingerprint = job.get("fingerprint") if isinstance(job, dict) else None
    fingerprint = fingerprint if isinstance(fingerprint, dict) else {}
    best = _best_records(directory)
    errors = Counter(kind for ok, kind, _ in best.values() if not ok)
    servers = Counter(server or "(none)" for _, _, server in best.values())
    failed = sum(errors.values())
    status = _read_status(directory)
    holder = _lock_holder(directory)
    pid: int | None
    if holder is not None:
        state, pid = "running", holder
    else:
        said = status.get("state")
        state = said if said in ("finished", "interrupted", "failed") else "stopped"
        pid = status.get("pid") if isinstance(status.get("pid"), int) else None
    return RunStatus(
        output_dir=str(directory),
        state=state,
        pid=pid,
        total=status.get("total") if isinstance(status.get("total"), int) else None,
        done=len(best),
        succeeded=len(best) - failed,
        failed=failed,
        by_error_type=dict(errors.most_common()),
        per_server=dict(servers.most_common()),
        rows_per_second=status.get("rows_per_second") if state == "running" else None,
        eta_seconds=status.get("eta_seconds") if state == "running" else None,
        updated=status.get("updated"),
        model=fingerprint.get("model"),
        sample=fingerprint.get("sample"),
        error=status.get("error"),
    )


def _best_records(directory: Path) -> dict[Any, tuple[bool, str, str | None]]:
    """Each id's best record so far (a success beats an error; the last one wins
    otherwise) as (answered, error type, server)."""
    best: dict[Any, tuple[bool, str, str | None]] = {}
    for path in shard_paths(directory):
        try:
            for _, _, record in read_shard(path):
                ok = not is_error_record(record)
                row_id = record["id"]
                if ok or not best.get(row_id, (False, "", None))[0]:
                    kind = str(record.get("error_type") or "error")
                    best[row_id] = (ok, kind, record.get("server"))
        except OSError:
            continue  # a shard removed meanwhile (an empty one, when its run closed)
    return best


def _read_status(directory: Path) -> dict[str, Any]:
    try:
        status = orjson.loads((directory / STATUS_FILE).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return {}
    return status if isinstance(status, dict) else {}


def _lock_holder(directory: Path) -> int | None:
    """The pid of the process holding the directory's lock now, or None.

    Read from the kernel's table of locks (``/proc/locks``) by the lock file's inode,
    so that nothing here takes the lock (which would keep a job from starting).
    """
    lock = directory / LOCK_FILE
    try:
        info = lock.stat()
    except OSError:
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
        pid = int(lock.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid
