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
consolidation keeps one row per id, so the output is exactly once either way. A claim
renewed more than a lease ahead of this host's clock is a clock fault (its holder's
clock is ahead): it is logged, naming the unit, the holder and how far ahead, and is
held only while its file keeps changing; once this worker has seen it unchanged for a
whole lease on its own monotonic clock, its holder stopped renewing it and the unit is
taken over (:func:`lease_state`), never held for as long as the clock is ahead.

A holder on this machine whose process is gone (killed, or a worker restarted on the
same node) is known dead at once: a claim file says the machine it was made on (the
kernel's boot id and the process-id namespace), and a worker of the same machine that
finds the holder's process missing (or a zombie) takes the unit over without waiting
for the lease (:func:`holder_gone`). So is a holder that ran in this worker's own slot
(the same SLURM array task or Kubernetes completion index, restarted on another node:
:func:`~llm_annotator.jobs.rundir.fleet.worker_slot`): the worker takes its own units
back at once. Other holders on other machines are judged by their leases only.

The taker of a unit removes what its dead holder was writing when it died
(:mod:`~llm_annotator.jobs.rundir.leftovers`). A worker that waits on units held by
others says which, by whom and until when, once a lease (:meth:`Claims.report_waiting`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import orjson
import structlog

from llm_annotator.errors import RunDirectoryError
from llm_annotator.jobs.files import make_directory, open_file, read_bytes
from llm_annotator.jobs.rundir.store import output_write_error

log = structlog.get_logger(__name__)

CLAIMS_DIR = "claims"
LEASE = 60.0
"""Seconds a claim lasts without being renewed."""
_GENERATIONS = 1_000
"""The most times one unit may be taken over (a bound on a loop, never met)."""
LISTED_UNITS = 10
"""Units named one by one when a worker says which it waits for."""

LeaseState = Literal["held", "expired", "ahead", "stale"]


def lease_state(age: float, lease: float, unchanged: float) -> LeaseState:
    """How another worker's claim stands: ``held``, ``expired`` (take it over),
    ``ahead`` (a clock fault, held for now) or ``stale`` (a clock fault whose holder
    stopped renewing it: take it over).

    Args:
        age: Seconds since the claim was last renewed, by this host's wall clock:
            negative when the holder's clock is ahead of this host's.
        lease: Seconds a claim lasts without being renewed.
        unchanged: Seconds this worker has seen the claim's file unchanged (the same
            generation and modification time), on its own monotonic clock.

    Examples:
        >>> lease_state(5, 60, 0), lease_state(-30, 60, 0), lease_state(60, 60, 0)
        ('held', 'held', 'expired')
        >>> lease_state(-86_400, 60, 59.9), lease_state(-86_400, 60, 60)
        ('ahead', 'stale')
    """
    if age >= lease:
        return "expired"
    if age >= -lease:
        return "held"
    return "stale" if unchanged >= lease else "ahead"


def report_due(last: float | None, now: float, every: float) -> bool:
    """Whether a worker that waits says so again: the first time, then once ``every``
    seconds (a lease), not at each look.

    Examples:
        >>> report_due(None, 5.0, 60.0), report_due(0.0, 59.0, 60.0), report_due(0.0, 60.0, 60.0)
        (True, False, True)
    """
    return last is None or now - last >= every


def this_machine() -> str | None:
    """Where a process id means one process: the kernel's boot id and this process's
    pid namespace (None where the system does not say, off Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        space = os.stat("/proc/self/ns/pid").st_ino
        if int(os.readlink("/proc/self")) != os.getpid():
            return None  # a /proc of another pid namespace: its pids are not ours
    except (OSError, ValueError):
        return None
    return f"{boot}:{space}"


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine has ended (a zombie has: it only waits
    for its parent to read its status). Only the kernel's own word counts: a process
    that ``/proc`` hides (``hidepid``) is alive, for safety."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # another user's process: alive
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False  # cannot tell: alive
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


def holder_gone(record: object, machine: str | None, pid: int, *, slot: str | None = None) -> bool:
    """Whether a claim's record names a holder that is known dead: made on this
    ``machine`` (not None) by another process than ``pid``, which has ended; or made in
    this worker's own ``slot`` (not None) on another machine, by the slot's earlier run
    (a restarted array task or pod: its scheduler ended the earlier one).

    Examples:
        >>> holder_gone({"owner": "h:1:ab", "machine": "m"}, None, 5)
        False
        >>> holder_gone({"owner": "h:5:ab", "machine": "m"}, "m", 5)  # this process
        False
        >>> holder_gone({"owner": "h:7:ab", "machine": "other"}, "m", 5)
        False
        >>> holder_gone({"owner": "h:7:ab", "machine": "other", "slot": "s1"}, "m", 5, slot="s1")
        True
    """
    if not isinstance(record, dict):
        return False
    here = machine is not None and record.get("machine") == machine
    if not here:
        # Another machine's process: only the slot's own restart knows it is over.
        return slot is not None and record.get("slot") == slot
    owner = record.get("owner")
    try:
        holder = int(str(owner).rsplit(":", 2)[1])
    except (IndexError, ValueError):
        return False
    return holder != pid and process_gone(holder)


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


@dataclass(slots=True)
class _Seen:
    """Another worker's claim as this worker last saw it."""

    generation: int
    renewed: float
    since: float
    """When this worker first saw it so (its monotonic clock)."""
    warned: bool = False
    """Whether its clock fault was logged."""


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a unit, for a worker that waits on it.

    Attributes:
        unit: The unit's name in the claims folder.
        owner: The holder, as its claim file says (``host:pid:token``), or None.
        until: When this worker may take the unit over if the holder stops renewing
            (this host's wall clock, ISO 8601), or None if the claim vanished.
    """

    unit: str
    owner: str | None
    until: str | None


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


def new_owner() -> str:
    """A worker's name in claims, never another's: ``host:pid:random``."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Claims:
    """This worker's side of the claim protocol (see the module).

    Args:
        run_dir: The run directory.
        lease: Seconds a claim lasts without being renewed.
        clock: The monotonic clock (tests give their own).
        wall: The wall clock, against the claim files' modification times.
        slot: The slot this worker runs in, the same when it is restarted
            (:func:`~llm_annotator.jobs.rundir.fleet.worker_slot`), or None: a claim made
            in this slot on another machine is this slot's earlier run's, taken back at
            once.
        owner: This worker's name in its claims (:func:`new_owner`), for a worker whose
            jobs come back to the run directory (a pipeline's steps); None: a new one.
    """

    def __init__(
        self,
        run_dir: Path,
        lease: float = LEASE,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        slot: str | None = None,
        owner: str | None = None,
    ) -> None:
        self.folder = run_dir / CLAIMS_DIR
        self.lease = lease
        self.clock = clock
        self.wall = wall
        self.owner = owner if owner is not None else new_owner()
        self.machine = this_machine()
        self.slot = slot
        self._seen: dict[str, _Seen] = {}
        """Other workers' claims as this worker last saw them, by unit."""
        self._reported: float | None = None
        """When this worker last said which units it waits for (monotonic)."""
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

    def owner_of(self, key: str, generation: int) -> str | None:
        """The owner a claim file names, or None if it names none (or is gone)."""
        said = self._record(key, generation)
        owner = said.get("owner") if isinstance(said, dict) else None
        return owner if isinstance(owner, str) else None

    def _record(self, key: str, generation: int) -> object:
        """What a claim file says, or None if it cannot be read (or is gone)."""
        try:
            data = read_bytes(self._path(key, generation))
            return orjson.loads(data) if data else None
        except (OSError, RunDirectoryError, orjson.JSONDecodeError):
            return None

    def _state(self, key: str, generation: int, renewed: float) -> LeaseState:
        """How another worker's claim stands (:func:`lease_state`); a clock fault is
        logged once a claim."""
        now = self.clock()
        seen = self._seen.get(key)
        if seen is None or seen.generation != generation:
            seen = self._seen[key] = _Seen(generation, renewed, now)
        elif seen.renewed != renewed:  # renewed since: its holder is alive
            seen.renewed, seen.since = renewed, now
        age = self.wall() - renewed
        state = lease_state(age, self.lease, now - seen.since)
        if state == "ahead" and not seen.warned:
            seen.warned = True
            owner = self.owner_of(key, generation)
            log.warning(
                "claim_clock_ahead",
                unit=key,
                generation=generation,
                owner=owner,
                host=owner.rsplit(":", 2)[0] if owner else None,
                ahead_seconds=round(-age, 1),
                taken_over_after=self.lease,
            )
        return state

    def try_claim(self, key: str) -> Claim | None:
        """Claim the unit if no worker holds it, or take it over if its holder's lease
        expired (or its claim, ahead of this host's clock, went unrenewed for a lease);
        None if another worker holds it (or won the race for it)."""
        generation, renewed = self.holder(key)
        state: LeaseState | None = None
        gone = False
        if generation and renewed is not None:
            state = self._state(key, generation, renewed)
            if state in ("held", "ahead"):
                record = self._record(key, generation)
                mine = isinstance(record, dict) and record.get("owner") == self.owner
                gone = not mine and holder_gone(record, self.machine, os.getpid(), slot=self.slot)
                if not gone:
                    return None
        path = self._path(key, generation + 1)
        try:
            fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return None  # another worker was first
        except OSError as error:
            raise output_write_error(error, path, self.folder.parent) from None
        with os.fdopen(fd, "wb") as file:
            said = {
                "owner": self.owner,
                "taken_over": generation,
                "machine": self.machine,
                "slot": self.slot,
            }
            file.write(orjson.dumps(said) + b"\n")
            file.flush()  # written before the time is set: a later write would move it
            now = self.wall()
            os.utime(file.fileno(), (now, now))
        self._seen.pop(key, None)
        if generation:
            log.warning(
                "unit_taken_over",
                unit=key,
                generation=generation + 1,
                owner=self.owner,
                previous=self.owner_of(key, generation),
                reason="holder_gone"
                if gone
                else "clock_ahead"
                if state == "stale"
                else "lease_expired",
            )
        else:
            log.info("unit_claimed", unit=key, owner=self.owner)
        return Claim(key, generation + 1, path, self.clock())

    def holder_of(self, key: str) -> Holder:
        """Who holds the unit and until when: its lease's end, or for a claim ahead of
        this host's clock, a lease after this worker first saw it unchanged."""
        generation, renewed = self.holder(key)
        if not generation or renewed is None:
            return Holder(key, None, None)
        state = self._state(key, generation, renewed)
        if state in ("ahead", "stale"):
            left = self.lease - (self.clock() - self._seen[key].since)
            until = self.wall() + max(left, 0.0)
        else:
            until = renewed + self.lease
        return Holder(key, self.owner_of(key, generation), _iso(until))

    def report_waiting(self, keys: Sequence[str]) -> bool:
        """Say which units this worker waits on, held by others: each one's holder and
        until when (the first :data:`LISTED_UNITS`), once a lease at most; whether it
        said it now."""
        now = self.clock()
        if not keys or not report_due(self._reported, now, self.lease):
            return False
        self._reported = now
        holders = [self.holder_of(key) for key in keys[:LISTED_UNITS]]
        log.info(
            "waiting_for_units",
            units=len(keys),
            held=[{"unit": h.unit, "owner": h.owner, "until": h.until} for h in holders],
            more=max(len(keys) - LISTED_UNITS, 0),
            owner=self.owner,
        )
        return True

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
