"""Claims on a corpus's units with leases: any number of workers, on any hosts that
share the run directory, take the units one at a time, and a unit whose holder died
or stopped is taken over once its lease runs out.

A claim is a file ``RUN_DIR/claims/<unit>.<generation>`` made by an exclusive create
(``O_CREAT | O_EXCL``, atomic on local file systems, NFS v3 and later, and Lustre; no
``flock``, which NFS and Lustre do not all honour across hosts). The unit's holder is
the writer of its highest generation. It renews its lease by setting that file's
modification time to its own clock's time every third of the lease;
a claim whose file was not touched for a whole lease has expired, and another worker
takes the unit over by creating the next generation, which only one worker can. Before
each write the holder makes sure its claim is still good: when its last renewal is
older than half a lease (it was stopped, or the file system stalled) it looks for a
newer generation first, and if there is one it has lost the unit and writes nothing
more of it; the taker resumes the unit row by row from what was written.

The protocol trusts the hosts' clocks to agree within a fraction of the lease (the
default, :data:`LEASE`, is a minute), and a worker that stops between its check and a
write (a window of microseconds) may still write records the taker also writes: the
consolidation keeps one row per id, so the output is exactly once either way.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import structlog

from llm_annotator.jobs.files import make_directory, open_file
from llm_annotator.jobs.rundir.store import output_write_error

log = structlog.get_logger(__name__)

CLAIMS_DIR = "claims"
LEASE = 60.0
"""Seconds a claim lasts without being renewed."""
_GENERATIONS = 1_000
"""The most times one unit may be taken over (a bound on a loop, never met)."""


@dataclass(slots=True)
class Claim:
    """A unit this worker holds.

    Attributes:
        key: The unit's name in the claims folder.
        generation: The claim's generation (1 for the first holder).
        path: Its file.
        renewed: When it was last renewed (this worker's monotonic clock).
        lost: Whether another worker has taken the unit over.
    """

    key: str
    generation: int
    path: Path
    renewed: float
    lost: bool = False


class Claims:
    """This worker's side of the claim protocol (see the module).

    Args:
        run_dir: The run directory.
        lease: Seconds a claim lasts without being renewed.
        clock: The monotonic clock (tests give their own).
        wall: The wall clock, against the claim files' modification times.
    """

    def __init__(
        self,
        run_dir: Path,
        lease: float = LEASE,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.folder = run_dir / CLAIMS_DIR
        self.lease = lease
        self.clock = clock
        self.wall = wall
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        try:
            make_directory(self.folder)
        except OSError as error:
            raise output_write_error(error, self.folder, run_dir) from None

    def __repr__(self) -> str:
        return f"<Claims {str(self.folder)!r} owner={self.owner!r} lease={self.lease:g}>"

    def _path(self, key: str, generation: int) -> Path:
        return self.folder / f"{key}.{generation}"

    def holder(self, key: str) -> tuple[int, float | None]:
        """The unit's current generation (0: never claimed) and when its claim was last
        renewed (wall clock), or None when that file vanished meanwhile."""
        generation = 0
        while generation < _GENERATIONS and os.path.lexists(self._path(key, generation + 1)):
            generation += 1
        if generation == 0:
            return 0, None
        try:
            return generation, os.lstat(self._path(key, generation)).st_mtime
        except FileNotFoundError:
            return generation, None

    def try_claim(self, key: str) -> Claim | None:
        """Claim the unit if no worker holds it, or take it over if its holder's lease
        expired; None if another worker holds it (or won the race for it)."""
        generation, renewed = self.holder(key)
        if generation and renewed is not None and self.wall() - renewed < self.lease:
            return None
        path = self._path(key, generation + 1)
        try:
            fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return None  # another worker was first
        except OSError as error:
            raise output_write_error(error, path, self.folder.parent) from None
        with os.fdopen(fd, "wb") as file:
            file.write(orjson.dumps({"owner": self.owner, "taken_over": generation}) + b"\n")
            file.flush()  # written before the time is set: a later write would move it
            now = self.wall()
            os.utime(file.fileno(), (now, now))
        if generation:
            log.warning("unit_taken_over", unit=key, generation=generation + 1, owner=self.owner)
        else:
            log.info("unit_claimed", unit=key, owner=self.owner)
        return Claim(key, generation + 1, path, self.clock())

    def renew(self, claim: Claim) -> bool:
        """Renew the claim's lease; False (and the claim marked lost) if another worker
        has taken the unit over."""
        if claim.lost:
            return False
        if os.path.lexists(self._path(claim.key, claim.generation + 1)):
            claim.lost = True
            log.warning("unit_lost", unit=claim.key, generation=claim.generation)
            return False
        now = self.wall()
        with contextlib.suppress(FileNotFoundError):
            os.utime(claim.path, (now, now))
        claim.renewed = self.clock()
        return True

    def valid(self, claim: Claim) -> bool:
        """Whether the claim still holds: at once while it was renewed within half a
        lease, else after a look for a newer generation (and a renewal)."""
        if claim.lost:
            return False
        if self.clock() - claim.renewed < self.lease / 2:
            return True
        return self.renew(claim)
