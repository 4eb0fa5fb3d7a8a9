"""The fleet: the workers of one job that share its servers, each holding its share of
every server's budget, with no central process.

Each worker of a job run by claims (``--shard claim``: an array of workers on any hosts
that share the run directory) keeps a file ``RUN_DIR/fleet/<name>.json`` while it holds
units, renewed as claims are (its modification time, every :data:`LOOK_EVERY`
seconds). Every worker counts the files renewed within a lease (the claims', at
least :data:`LEASE_FLOOR`), less those whose holder is known dead (a process of this
machine that is gone, as for claims: such a file is removed, as is one expired for
:data:`FORGET_AFTER` leases), and
holds ``batch_size x max_concurrent_batches_per_client / workers`` requests on each
server (:meth:`~llm_annotator.pool.queue.QueuePool.share_servers`): the servers carry
their budget once, however many workers send to them. A worker that joins takes its
share within a look; one that has no unit left to work on leaves the fleet, so that
the others take its share; one that dies gives its share back within a lease (at once
to workers of its machine).

A worker that evicts a server (it hung, refused connections, answered garbage) says so
in ``RUN_DIR/fleet/servers/`` (:func:`share_evictions`); the others take it out at their
next look rather than each finding it out with its own requests and timeouts, and each
takes it back when it answers its own probe and test completion.

A worker's file is named by its claim owner (``host:pid:token``) and says its slot
(:func:`worker_slot`: the same SLURM array task, or ``LLM_ANNOTATOR_WORKER_SLOT``, across
restarts). A worker restarted in its slot on another machine no longer counts the
earlier run's file, and takes its own units back at once
(:func:`~llm_annotator.jobs.rundir.claims.holder_gone`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog

from llm_annotator.errors import ConfigurationError, RunDirectoryError
from llm_annotator.jobs.files import atomic_write, make_directory, read_bytes
from llm_annotator.jobs.rundir.claims import LEASE, holder_gone

log = structlog.get_logger(__name__)

T = TypeVar("T")

FLEET_DIR = "fleet"
LOOK_EVERY = 1.0
"""Seconds between two counts of the fleet (and renewals of this worker's file)."""
FIRST_LOOK = 0.1
"""Seconds to a worker's second count of the fleet, doubling up to :data:`LOOK_EVERY`."""
IDLE_FOR = 2.0
"""Seconds a worker holds no unit before it leaves the fleet (it waits for units that
others hold, to take them over if they die): the others take its share."""
HOLD_BACK = 1 << 30
"""The count a worker that joins others shares by for a look: one request a server."""
FORGET_AFTER = 10
"""Leases after which an expired file is removed by the worker that counts."""
LEASE_FLOOR = 10.0
"""The fewest seconds a fleet file counts unrenewed, whatever the claims' lease: a
worker starved of CPU renews late, and a lease as short as a test's (a few seconds)
would drop it from the count and back, moving every other worker's share each time."""
SERVERS_DIR = "servers"
"""``RUN_DIR/fleet/servers/``: one file a server that a worker evicted, lately."""
FOUND_DEAD = "found dead by worker"
"""How an eviction told by another worker begins its reason (never told on again)."""
SLOT_VARIABLE = "LLM_ANNOTATOR_WORKER_SLOT"
"""The environment variable that names a worker's slot, over what the scheduler says."""


def worker_slot(environ: Mapping[str, str]) -> str | None:
    """The slot a worker runs in, the same when it is restarted and never the same for
    two live workers: ``LLM_ANNOTATOR_WORKER_SLOT`` if set; else a SLURM array task
    (``<array job>_<task>``, with the step's task when it runs several), which SLURM
    ends before it runs it again; else None (the worker is known by its process only).

    Examples:
        >>> array = {"SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "80"}
        >>> worker_slot(array), worker_slot({**array, "SLURM_PROCID": "1"})
        ('slurm-77_3', 'slurm-77_3.1')
        >>> worker_slot({"SLURM_JOB_ID": "80"}), worker_slot({SLOT_VARIABLE: "pod-a"})
        (None, 'pod-a')
    """
    given = environ.get(SLOT_VARIABLE, "").strip()
    if given:
        return given
    array, index = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if not (array and index):
        return None  # a job's steps, or an allocation's several commands, share its id
    task = environ.get("SLURM_PROCID", "0")
    return f"slurm-{array}_{index}" + ("" if task in ("", "0") else f".{task}")


def fleet_lease(claim_lease: float) -> float:
    """The seconds a fleet file counts unrenewed: the claims' lease, at least
    :data:`LEASE_FLOOR` (a worker that dies on this machine is dropped at once all the
    same, its process gone).

    Examples:
        >>> fleet_lease(60.0), fleet_lease(3.0)
        (60.0, 10.0)
    """
    return max(float(claim_lease), LEASE_FLOOR)


def file_name(name: str) -> str:
    """A worker's name as a file name: anything but letters, digits, ``.``, ``_`` and
    ``-`` becomes ``_``.

    Examples:
        >>> file_name("node-3:4411:ab12"), file_name("a/2")
        ('node-3_4411_ab12.json', 'a_2.json')
    """
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".json"


def folder_name(name: str) -> str:
    """A name (a server group's) as a folder's: as :func:`file_name` without the
    ``.json``, a leading dot made ``_`` (never ``.`` nor ``..`` nor hidden).

    Examples:
        >>> folder_name("default"), folder_name("judge/large"), folder_name("..")
        ('default', 'judge_large', '_.')
    """
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"
    return "_" + safe[1:] if safe.startswith(".") else safe


def is_live(
    record: object,
    age: float,
    lease: float,
    machine: str | None,
    pid: int,
    slot: str | None = None,
) -> bool:
    """Whether a fleet file renewed ``age`` seconds ago (by this host's clock) stands for
    a live worker: renewed within a lease (a file ahead of this clock counts), not made
    by a process of this machine that is gone, nor by the earlier run of this worker's
    ``slot`` on another machine.

    Examples:
        >>> is_live({"owner": "h:1:x"}, 5.0, 60.0, None, 9), is_live({}, 61.0, 60.0, None, 9)
        (True, False)
        >>> is_live({"owner": "h:1:x", "machine": "m2", "slot": "s"}, 5.0, 60.0, "m1", 9, "s")
        False
    """
    return age < lease and not holder_gone(record, machine, pid, slot=slot)


class Fleet:
    """This worker's side of the fleet (see the module).

    Args:
        run_dir: The run directory.
        owner: This worker's claim owner (``host:pid:token``).
        slot: Its slot (:func:`worker_slot`), or None.
        machine: Its machine (:func:`~llm_annotator.jobs.rundir.claims.this_machine`).
        lease: Seconds a file counts without being renewed.
        wall: The wall clock, against the files' modification times.
        folder: Where the fleet's files go, if not ``RUN_DIR/fleet``: the workers of
            several jobs that send to the same servers (a pipeline's steps) share one.
        stays: Keep this worker's file when its job ends (its next job comes back at
            once: a pipeline's next turn); :func:`leave_fleet` removes it.
    """

    def __init__(
        self,
        run_dir: Path,
        owner: str,
        slot: str | None,
        machine: str | None,
        lease: float,
        *,
        wall: Callable[[], float] = time.time,
        folder: Path | None = None,
        stays: bool = False,
    ) -> None:
        self.folder = folder if folder is not None else run_dir / FLEET_DIR
        self.stays = stays
        self.owner, self.slot, self.machine = owner, slot, machine
        self.lease = lease
        self.wall = wall
        self.path = self.folder / file_name(owner)
        self.joined = False
        self.workers = 0
        """The live workers at the last count (0: not counted yet)."""
        self._records: dict[tuple[str, int], dict[str, object]] = {}
        """Others' files as read, by name and inode (a file is rewritten, never edited)."""

    def __repr__(self) -> str:
        return f"<Fleet {str(self.folder)!r} name={self.path.name!r} workers={self.workers}>"

    def join(self) -> bool:
        """Write this worker's file; True if it was there, renewed within a lease (the
        others count this worker already: it left it when its last job ended)."""
        with contextlib.suppress(OSError):
            age = self.wall() - os.stat(self.path).st_mtime
            if age < self.lease and self._read(self.path).get("owner") == self.owner:
                self.joined = True
                self.renew()
                return True
        self._write()
        return False

    def _write(self) -> None:
        make_directory(self.folder)
        record = {
            "owner": self.owner,
            "slot": self.slot,
            "machine": self.machine,
            "joined": self.wall(),
        }
        with atomic_write(self.path, durable=False) as file:
            file.write(orjson.dumps(record) + b"\n")
        self.joined = True

    def renew(self) -> None:
        """Renew this worker's file (written again if another removed it)."""
        if not self.joined:
            return
        now = self.wall()
        try:
            os.utime(self.path, (now, now))
        except FileNotFoundError:
            self._write()

    def leave(self) -> None:
        """Remove this worker's file, if it is still this worker's."""
        if not self.joined:
            return
        self.joined = False
        if self._read(self.path).get("owner") == self.owner:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    def count(self) -> int:
        """The live workers (this one, if it has joined, always among them)."""
        now, pid = self.wall(), os.getpid()
        live = 0
        try:
            entries = list(os.scandir(self.folder))
        except FileNotFoundError:
            entries = []
        records: dict[tuple[str, int], dict[str, object]] = {}
        for entry in entries:
            if not entry.name.endswith(".json") or entry.path == str(self.path):
                continue
            try:
                info = entry.stat()
            except FileNotFoundError:
                continue
            age = now - info.st_mtime
            if age >= self.lease:  # expired: not read; long expired: removed
                if age >= FORGET_AFTER * self.lease:
                    self._forget(entry.path)
                continue
            key = (entry.name, info.st_ino)
            record = self._records.get(key)
            if record is None:
                record = self._read(Path(entry.path))
            if is_live(record, age, self.lease, self.machine, pid, self.slot):
                records[key] = record
                live += 1
            else:
                self._forget(entry.path)  # its process is gone: it renews nothing more
        self._records = records
        return live + (1 if self.joined else 0)

    def tell_evicted(self, url: str, reason: str) -> None:
        """Tell the others that this worker evicted the server ``url``, and why."""
        folder = self.folder / SERVERS_DIR
        make_directory(self.folder)
        make_directory(folder)
        record = {"url": url, "reason": reason, "by": self.owner, "at": self.wall()}
        with atomic_write(folder / _server_file(url), durable=False) as file:
            file.write(orjson.dumps(record) + b"\n")

    def tell_rejoined(self, url: str) -> None:
        """Take back this worker's word that ``url`` is dead: it answers again."""
        path = self.folder / SERVERS_DIR / _server_file(url)
        if self._read(path).get("by") == self.owner:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def evictions(self) -> list[dict[str, Any]]:
        """The servers other workers evicted within a lease: records with ``url``,
        ``reason``, ``by`` (the worker) and ``at`` (its wall clock)."""
        now = self.wall()
        try:
            entries = list(os.scandir(self.folder / SERVERS_DIR))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            if not entry.name.endswith(".json"):
                continue
            try:
                age = now - entry.stat().st_mtime
            except FileNotFoundError:
                continue
            if age >= self.lease:
                if age >= FORGET_AFTER * self.lease:
                    self._forget(entry.path)
                continue
            record = self._read(Path(entry.path))
            if record.get("by") != self.owner and isinstance(record.get("url"), str):
                found.append(record)
        return found

    @staticmethod
    def _forget(path: str) -> None:
        """Remove a dead worker's file (a live worker that was only slow writes its
        own again at its next renewal)."""
        with contextlib.suppress(OSError):
            os.unlink(path)

    @staticmethod
    def _read(path: Path) -> dict[str, object]:
        try:
            data = orjson.loads(read_bytes(path) or b"null")
        except (OSError, RunDirectoryError, orjson.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}


async def keep_share(
    fleet: Fleet,
    busy: Callable[[], bool],
    share: Callable[[int], None],
    *,
    every: float = LOOK_EVERY,
    idle_for: float = IDLE_FOR,
) -> None:
    """Keep this worker's share of the servers while the job runs: every ``every``
    seconds (sooner at first: :data:`FIRST_LOOK`, doubling) renew its file and count the
    fleet, and tell ``share`` the count when it changes. A worker that has not been
    ``busy()`` (it holds no unit) for ``idle_for`` seconds leaves the fleet until it is
    busy again. A worker that joins (or comes back) while others work holds one request
    a server for a look, until they have counted it. Runs until cancelled, then leaves.
    A file system that fails is logged and tried again at the next look (the share
    stays as it was)."""
    pending: asyncio.Future[Any] | None = None

    async def in_thread(action: Callable[[], T]) -> T:
        """``action()`` in a thread; a cancel does not stop it, and the end waits for it."""
        nonlocal pending
        done = asyncio.ensure_future(asyncio.to_thread(action))
        pending = done
        return await asyncio.shield(done)

    looks = 0
    loop = asyncio.get_running_loop()
    idle_since: float | None = None
    try:
        # A worker that starts means to work; one whose file is there is counted already.
        joining = not await in_thread(fleet.join)
        while True:
            try:
                workers = await in_thread(fleet.count)
            except (OSError, RunDirectoryError) as error:
                log.warning("fleet_not_counted", folder=str(fleet.folder), error=str(error))
            else:
                if not fleet.joined:
                    workers += 1  # out of the fleet (idle): it still counts itself
                if joining and fleet.joined and workers > 1:
                    # The others hold the whole budget until they count this one (within
                    # a look): hold one request a server until then, not a share more.
                    joining = False
                    fleet.workers = 0  # the share after the hold-back is always told
                    log.info("fleet_joined", workers=workers, holding_back=every)
                    share(HOLD_BACK)
                    await asyncio.sleep(every + FIRST_LOOK)
                    continue
                if fleet.joined:
                    joining = False
                if workers != fleet.workers:
                    log.info("fleet_changed", workers=workers, was=fleet.workers or None)
                    fleet.workers = workers
                    share(workers)
            # The first looks come sooner: workers of an array start within moments of
            # each other, and each should hold its share before its windows grow.
            await asyncio.sleep(min(every, FIRST_LOOK * 2**looks))
            looks += 1
            if busy():
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            try:
                if idle_since is None or loop.time() - idle_since < idle_for:
                    if fleet.joined:
                        await in_thread(fleet.renew)
                    else:
                        await in_thread(fleet.join)
                elif fleet.joined:
                    await in_thread(fleet.leave)
                    log.info("fleet_left", worker=fleet.path.stem, reason="no unit to work on")
                    joining = True  # when it comes back, it holds back again
            except (OSError, RunDirectoryError) as error:
                log.warning("fleet_not_renewed", path=str(fleet.path), error=str(error))
    finally:
        if pending is not None:  # a join still writing, when cancelled: leave after it
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await pending
        if not fleet.stays:
            with contextlib.suppress(OSError, RunDirectoryError, asyncio.CancelledError):
                await asyncio.to_thread(fleet.leave)


def leave_fleet(folder: Path, owner: str) -> None:
    """Remove the file of worker ``owner`` from the fleet in ``folder``, if it is its
    own (a worker whose jobs kept it: :class:`Fleet` ``stays``)."""
    path = folder / file_name(owner)
    if Fleet._read(path).get("owner") == owner:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def fleet_now(run_dir: Path, *, wall: Callable[[], float] = time.time) -> dict[str, Any]:
    """The fleet of a run directory as it stands, for ``status``: ``workers``, those
    whose file was renewed within :data:`LEASE_FLOOR` (a working worker renews it every
    :data:`LOOK_EVERY`), and ``servers_out``, the servers a worker said within the
    claims' default lease that it evicted (``url``, ``by``, ``reason``, ``seconds_ago``),
    and has not said since that they answer again.

    Examples:
        >>> fleet_now(Path("no-such-run"))
        {'workers': 0, 'servers_out': []}
    """
    folder = run_dir / FLEET_DIR
    now = wall()
    workers = 0
    servers: list[dict[str, Any]] = []
    for where, young in ((folder, LEASE_FLOOR), (folder / SERVERS_DIR, LEASE)):
        try:
            entries = list(os.scandir(where))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if not entry.name.endswith(".json") or not entry.is_file(follow_symlinks=False):
                continue
            try:
                age = now - entry.stat().st_mtime
            except FileNotFoundError:
                continue
            if age >= young:
                continue
            if where == folder:
                workers += 1
                continue
            record = Fleet._read(Path(entry.path))
            if isinstance(record.get("url"), str):
                servers.append(
                    {
                        "url": record["url"],
                        "by": record.get("by"),
                        "reason": record.get("reason"),
                        "seconds_ago": round(max(age, 0.0), 1),
                    }
                )
    servers.sort(key=lambda server: (server["seconds_ago"], server["url"]))
    return {"workers": workers, "servers_out": servers}


def _server_file(url: str) -> str:
    """A server's file name in ``fleet/servers/``: a digest of its URL (two URLs never
    share one, whatever their characters)."""
    return hashlib.sha256(url.encode()).hexdigest()[:24] + ".json"


async def share_evictions(
    fleet: Fleet,
    changes: Callable[[], list[tuple[str, str, str | None]]],
    suspect: Callable[[str, str], bool],
    *,
    every: float = LOOK_EVERY,
) -> None:
    """Tell the fleet of the servers this worker evicts, and evict those others evicted,
    every ``every`` seconds, until cancelled: a server that one worker found dead (it
    hung, it refused connections) is taken out by the others at their next look, not
    after each has sent to it and waited out its own timeouts; each probes it and takes
    it back as soon as it answers (:meth:`~llm_annotator.pool.queue.QueuePool.suspect_server`).

    ``changes()`` hands over this worker's members' changes since the last call, as
    ``(server, state after, reason)``; ``suspect(server, reason)`` evicts a server here
    (True if it did). An eviction told by another worker is not told on again, so two
    workers never keep each other's servers out. A file system that fails is logged
    and tried again at the next look."""
    while True:
        try:
            for server, after, reason in changes():
                if after == "evicted" and not (reason or "").startswith(FOUND_DEAD):
                    await asyncio.to_thread(fleet.tell_evicted, server, reason or "evicted")
                    log.info("server_evicted_told", server=server, reason=reason)
                elif after == "healthy":
                    await asyncio.to_thread(fleet.tell_rejoined, server)
            for record in await asyncio.to_thread(fleet.evictions):
                url, by, when = record["url"], record.get("by"), record.get("at")
                told = time.strftime("%H:%M:%S", time.gmtime(when)) if _number(when) else "?"
                # One text a told eviction: the pool acts on each once, whatever job asks.
                why = f"{FOUND_DEAD} {by} at {told} UTC: {record.get('reason')}"
                try:
                    evicted = suspect(url, why)
                except ConfigurationError:
                    continue  # not a URL the pool could hold
                if evicted:
                    log.warning("server_evicted_by_fleet", server=url, by=by)
        except Exception as error:  # advisory: the job goes on, its pool finds out alone
            log.warning("evictions_not_shared", folder=str(fleet.folder), error=str(error))
        await asyncio.sleep(every)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
