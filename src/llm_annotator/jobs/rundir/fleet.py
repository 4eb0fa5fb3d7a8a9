"""The fleet: the workers of one job that share its servers, each holding its share of
every server's budget, with no central process.

Each worker of a job run by claims (``--shard claim``: an array of workers on any hosts
that share the run directory) keeps a file ``RUN_DIR/fleet/<name>.json`` while it holds
units, renewed as claims are (its modification time, every :data:`LOOK_EVERY`
seconds). Every worker counts the files renewed within a lease, less those whose
holder is known dead (a process of this machine that is gone, as for claims: such a
file is removed, as is one expired for :data:`FORGET_AFTER` leases), and
holds ``batch_size x max_concurrent_batches_per_client / workers`` requests on each
server (:meth:`~llm_annotator.pool.queue.QueuePool.share_servers`): the servers carry
their budget once, however many workers send to them. A worker that joins takes its
share within a look; one that has no unit left to work on leaves the fleet, so that
the others take its share; one that dies gives its share back within a lease (at once
to workers of its machine).

A worker's file is named by its claim owner (``host:pid:token``) and says its slot
(:func:`worker_slot`: the same SLURM array task, or ``LLM_ANNOTATOR_WORKER_SLOT``, across
restarts). A worker restarted in its slot on another machine no longer counts the
earlier run's file, and takes its own units back at once
(:func:`~llm_annotator.jobs.rundir.claims.holder_gone`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog

from llm_annotator.errors import RunDirectoryError
from llm_annotator.jobs.files import atomic_write, make_directory, read_bytes
from llm_annotator.jobs.rundir.claims import holder_gone

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


def file_name(name: str) -> str:
    """A worker's name as a file name: anything but letters, digits, ``.``, ``_`` and
    ``-`` becomes ``_``.

    Examples:
        >>> file_name("node-3:4411:ab12"), file_name("a/2")
        ('node-3_4411_ab12.json', 'a_2.json')
    """
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".json"


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
    ) -> None:
        self.folder = run_dir / FLEET_DIR
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

    def join(self) -> None:
        """Write this worker's file."""
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
            self.join()

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
    joining = True
    try:
        await in_thread(fleet.join)  # a worker that starts means to work
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
                    await in_thread(fleet.join if not fleet.joined else fleet.renew)
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
        with contextlib.suppress(OSError, RunDirectoryError, asyncio.CancelledError):
            await asyncio.to_thread(fleet.leave)
