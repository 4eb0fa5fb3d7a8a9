"""The run timeline: what a job did over time, kept in the run directory to be drawn later.

A running job takes a :class:`Snapshot` of itself every second (:class:`RunWatch`, fed
by the job's one observer loop, never on the path of a request): rows done, errors by type, tokens,
and per server its state, rows, requests in flight, evictions, re-admissions,
requeues and hedges. The live metrics (``--metrics-port``) serve the latest snapshot;
``timeline.jsonl`` keeps some of them, and every change of a server's state as it
happens.

The file is one JSON object a line, appended (a resumed job appends its own run):

- ``{"e": "start", ...}`` opens a run: its wall time, pid, rows to do and done before;
- ``{"e": "tick", ...}`` a snapshot; the list of servers (``urls``) is written when it
  changes, and each tick's ``servers`` holds one compact list per server in that order
  (:data:`SERVER_FIELDS`);
- ``{"e": "member", ...}`` a server's change of state, with the reason of an eviction;
- ``{"e": "end", ...}`` how the run ended (missing after a crash).

**Its size is bounded for a run of any length.** A tick is written every
:func:`tick_interval` seconds: every second for the first 2,048 seconds, then every
``elapsed / 2048`` seconds, so a run of ``T`` seconds writes about
``2048 * (1 + ln(T / 2048))`` ticks (:func:`ticks_within`): 2,048 in the first 34
minutes, 9,712 in a day, 13,698 in a week. A tick is about 170 bytes plus 40 a server:
a week over 100 servers is about 57 MB, over 8 servers 7 MB. Server changes are written
as they happen, at most :data:`MAX_CHANGES` a run (a server that flaps for a week is
counted beyond that, not written).

**Appended crash-safely:** each line is written whole with one ``write`` on a file
opened for appending, and fsynced every minute; a reader skips a torn last line (a
crash in mid-write) and everything that is not a line of this format.

**Read as untrusted:** the file is opened without following a link or blocking on a
FIFO (:mod:`llm_annotator.jobs.files`; appended to only if no other name links to it),
and every field a reader uses is checked for its type and range: a line that is not
of this format is skipped (one warning per read, with the count), never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog

from llm_annotator.clients.base import Client
from llm_annotator.errors import RunDirectoryError
from llm_annotator.jobs.files import open_binary, open_file, read_run_file
from llm_annotator.jobs.protocols import MemberWatchable, Streamer
from llm_annotator.jobs.watch.outcome import ENDINGS
from llm_annotator.jobs.watch.progress import Progress
from llm_annotator.pool.member import COUNTERS, MemberChange, MemberStatistics

log = structlog.get_logger(__name__)

TIMELINE_FILE = "timeline.jsonl"
SAMPLE_INTERVAL = 1.0
"""Seconds between two snapshots of a running job."""
TICK_BASE = 1.0
"""Seconds between two ticks written, early in a run."""
TICK_SCALE = 2048
"""Ticks written before the interval starts growing with the run's length."""
MAX_CHANGES = 10_000
"""Server changes written per run at most."""
SYNC_EVERY = 60.0
"""Seconds between two fsyncs of the timeline."""
URLS_EVERY = 256
"""A tick names its servers when they change, and at least every this many ticks (so
that the end of the file alone tells the servers: ``llm-annotator status`` reads only
that)."""
SERVER_FIELDS = ("state", "rows", "in_flight", *COUNTERS)
"""The order of each server's list in a tick: a member's state, this run's rows it
answered, what it holds, and its counters (:data:`~llm_annotator.pool.member.COUNTERS`;
a new counter goes at the end, so that older timelines still read)."""


def tick_interval(elapsed: float, base: float = TICK_BASE, scale: int = TICK_SCALE) -> float:
    """Seconds from a tick written ``elapsed`` seconds into a run to the next one.

    Examples:
        >>> tick_interval(10.0), tick_interval(4096.0), tick_interval(7 * 86400.0)
        (1.0, 2.0, 295.3125)
    """
    return max(base, elapsed / scale)


def ticks_within(seconds: float, base: float = TICK_BASE, scale: int = TICK_SCALE) -> int:
    """About how many ticks a run of ``seconds`` writes (the bound on its size).

    Examples:
        >>> ticks_within(600), ticks_within(86400), ticks_within(7 * 86400)
        (600, 9712, 13698)
    """
    knee = base * scale
    if seconds <= knee:
        return math.ceil(seconds / base)
    return math.ceil(scale * (1 + math.log(seconds / knee)))


@dataclass(frozen=True, slots=True)
class ServerPoint:
    """One server in a :class:`Snapshot`: the pool's statistics of it, and this run's
    rows it answered."""

    stats: MemberStatistics
    rows: int

    @property
    def url(self) -> str:
        return self.stats.server

    def value(self, name: str) -> Any:
        """One of :data:`SERVER_FIELDS`."""
        return self.rows if name == "rows" else getattr(self.stats, name)

    def values(self) -> list[Any]:
        return [self.value(name) for name in SERVER_FIELDS]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A running job at one moment.

    Attributes:
        t: Seconds since this run started.
        wall: The wall time (Unix seconds).
        total: Rows the job takes.
        done: Rows done, resumed ones included.
        rows: Rows done by this run (answered and error rows).
        failed: Error rows written by this run.
        output_tokens: Output tokens this run generated (regenerations included).
        by_error_type: This run's error rows by type.
        queued: Samples waiting in the pool's queue.
        in_flight: Requests in flight.
        servers: The servers (none for a client that is not a pool).
        rows_per_second: Rows a second over the last half minute.
        changes_dropped: Server changes not written (beyond :data:`MAX_CHANGES`).
    """

    t: float
    wall: float
    total: int
    done: int
    rows: int
    failed: int
    output_tokens: int
    by_error_type: dict[str, int]
    queued: int
    in_flight: int
    servers: tuple[ServerPoint, ...]
    rows_per_second: float = 0.0
    changes_dropped: int = 0

    @property
    def eta_seconds(self) -> float | None:
        left = self.total - self.done
        if left <= 0 or self.rows_per_second <= 0:
            return None
        return left / self.rows_per_second


def take_snapshot(
    progress: Progress,
    client: Client[Any],
    t: float,
    wall: float,
    rows_per_second: float = 0.0,
    changes_dropped: int = 0,
) -> Snapshot:
    """A :class:`Snapshot` of the job now (cheap: the counters, no I/O)."""
    servers: tuple[ServerPoint, ...] = ()
    queued = in_flight = 0
    if isinstance(client, Streamer):
        stats = client.statistics()
        queued, in_flight = stats.queued, stats.in_flight
        servers = tuple(ServerPoint(m, progress.by_server.get(m.server, 0)) for m in stats.members)
    return Snapshot(
        t=t,
        wall=wall,
        total=progress.total,
        done=progress.done,
        rows=progress.rows,
        failed=progress.failed,
        output_tokens=progress.output_tokens,
        by_error_type=dict(progress.by_error_type),
        queued=queued,
        in_flight=in_flight,
        servers=servers,
        rows_per_second=rows_per_second,
        changes_dropped=changes_dropped,
    )


class TimelineFile:
    """Appends a run's lines to ``timeline.jsonl`` (see the module's docstring).

    A failed write (a full disk) is logged once and the timeline goes on without it: it
    is advisory, and the job's own writes report the disk.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / TIMELINE_FILE
        self._fd: int | None = None
        self._urls: tuple[str, ...] | None = None
        self._ticks = 0
        self._synced = time.monotonic()
        self._failed = False

    def open(self) -> None:
        """Open for appending; a line cut by a crash is ended first, so that this run's
        lines stay whole (the reader skips the cut one).

        Raises:
            RunDirectoryError: The timeline is a link, not a regular file, or has other
                hard links (it is never appended through them).
        """
        try:
            self._fd = open_file(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, single=True)
            size = os.fstat(self._fd).st_size
            if size and os.pread(self._fd, 1, size - 1) != b"\n":
                self._append(b"\n")
        except OSError as error:
            self._fail(error)

    def start(self, snapshot: Snapshot, done_before: int) -> None:
        self._urls = None
        self.write(
            {
                "e": "start",
                "wall": round(snapshot.wall, 3),
                "pid": os.getpid(),
                "total": snapshot.total,
                "done_before": done_before,
            }
        )

    def tick(self, snapshot: Snapshot) -> None:
        line: dict[str, Any] = {
            "e": "tick",
            "t": round(snapshot.t, 3),
            "wall": round(snapshot.wall, 3),
            "done": snapshot.done,
            "rows": snapshot.rows,
            "failed": snapshot.failed,
            "out_tokens": snapshot.output_tokens,
            "errors": snapshot.by_error_type,
            "queued": snapshot.queued,
            "in_flight": snapshot.in_flight,
        }
        urls = tuple(s.url for s in snapshot.servers)
        self._ticks += 1
        if urls != self._urls or self._ticks % URLS_EVERY == 0:
            line["urls"] = list(urls)
            self._urls = urls
        line["servers"] = [s.values() for s in snapshot.servers]
        if snapshot.changes_dropped:
            line["changes_dropped"] = snapshot.changes_dropped
        self.write(line)

    def change(self, t: float, wall: float, change: MemberChange) -> None:
        self.write(
            {
                "e": "member",
                "t": round(t, 3),
                "wall": round(wall, 3),
                "server": change.server,
                "from": change.before,
                "to": change.after,
                "reason": change.reason[:300] if change.reason else None,
            }
        )

    def end(self, t: float, wall: float, state: str) -> None:
        self.write({"e": "end", "t": round(t, 3), "wall": round(wall, 3), "state": state})

    def write(self, line: dict[str, Any]) -> None:
        """Append one line, whole (no fsync here: see :meth:`sync`)."""
        if self._fd is None:
            return
        try:
            self._append(orjson.dumps(line) + b"\n")
        except OSError as error:
            self._fail(error)

    def _append(self, data: bytes) -> None:
        assert self._fd is not None
        written = os.write(self._fd, data)
        if written != len(data):  # a full disk: the line is cut, and so is the timeline
            raise OSError(f"wrote {written} of {len(data)} bytes")

    def sync_due(self) -> bool:
        """Whether it is time for :meth:`sync` (every :data:`SYNC_EVERY` seconds)."""
        return self._fd is not None and time.monotonic() - self._synced >= SYNC_EVERY

    def sync(self) -> None:
        """Make what is written durable (in a thread: never on the job's loop)."""
        fd = self._fd
        self._synced = time.monotonic()
        if fd is None:
            return
        try:
            os.fsync(fd)
        except OSError as error:
            self._fail(error)

    def close(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.fsync(fd)
        os.close(fd)

    def _fail(self, error: OSError) -> None:
        if not self._failed:
            self._failed = True
            log.warning("timeline_not_written", path=str(self.path), error=str(error))
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class RunWatch:
    """What a running job shows of itself over time: snapshots for the live metrics,
    ticks and server changes into the timeline. The job's
    :class:`~llm_annotator.jobs.watch.observer.Observer` calls :meth:`observe` every
    :data:`SAMPLE_INTERVAL` seconds.

    Args:
        directory: The run directory.
        progress: The job's counters.
        client: The job's client (a pool's statistics and changes are watched).
        done_before: Rows done when the run started.
        timeline: Whether to write ``timeline.jsonl``.
        publish: Called with each snapshot (the live metrics), in the job's loop.
        clock: Monotonic seconds (tests give their own).
        wall: Wall-clock seconds.
    """

    def __init__(
        self,
        directory: Path,
        progress: Progress,
        client: Client[Any],
        done_before: int,
        *,
        timeline: bool = True,
        publish: Callable[[Snapshot], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.progress = progress
        self.client = client
        self.done_before = done_before
        self.file = TimelineFile(directory) if timeline else None
        self.publish = publish
        self.clock = clock
        self.wall = wall
        self.started = clock()
        self.changes = 0
        self._recent: list[tuple[float, int]] = []
        self._next_tick = 0.0
        self._stop_watching: Callable[[], None] | None = None

    def snapshot(self) -> Snapshot:
        """The job now, with its rate over the last half minute."""
        now = self.clock()
        t = now - self.started
        rows = self.progress.rows
        recent = self._recent
        recent.append((t, rows))
        while len(recent) > 2 and t - recent[1][0] >= 30.0:
            recent.pop(0)
        first_t, first_rows = recent[0]
        rate = (rows - first_rows) / (t - first_t) if t > first_t else 0.0
        dropped = max(0, self.changes - MAX_CHANGES)
        return take_snapshot(self.progress, self.client, t, self.wall(), rate, dropped)

    def on_change(self, change: MemberChange) -> None:
        """A server changed state: written at once (a few hundred bytes, rare)."""
        self.changes += 1
        if self.file is not None and self.changes <= MAX_CHANGES:
            self.file.change(self.clock() - self.started, self.wall(), change)
            self._next_tick = 0.0  # and the next snapshot is a tick: the pool after it

    async def begin(self) -> None:
        """Open the timeline, write the run's start, and hear every server change."""
        if self.file is not None:
            await asyncio.to_thread(self.file.open)
            self.file.start(self.snapshot(), self.done_before)
        if isinstance(self.client, MemberWatchable):
            self._stop_watching = self.client.watch_members(self.on_change)

    async def observe(self) -> None:
        """One look at the run: the metrics get the snapshot, the timeline a tick
        when one is due (and its fsync every minute). Never raises: watching must never
        stop the job."""
        try:
            snapshot = self.snapshot()
            if self.publish is not None:
                self.publish(snapshot)
            if self.file is not None and snapshot.t >= self._next_tick:
                self.file.tick(snapshot)
                self._next_tick = snapshot.t + tick_interval(snapshot.t)
            if self.file is not None and self.file.sync_due():
                await asyncio.to_thread(self.file.sync)
        except Exception as error:
            log.warning("run_watch_failed", error=repr(error))

    async def end(self, state: str) -> None:
        """A last tick, and how the run ended (``state``, one of ``ENDINGS``)."""
        if self._stop_watching is not None:
            self._stop_watching()
            self._stop_watching = None
        try:
            last = self.snapshot()
            if self.publish is not None:
                self.publish(last)
            if self.file is not None:
                self.file.tick(last)
                self.file.end(last.t, last.wall, state)
        except Exception as error:  # never over the job's own result or error
            log.warning("run_watch_failed", error=repr(error))
        if self.file is not None:
            await asyncio.to_thread(self.file.close)


# -- reading ---------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """One run of a job, as its timeline holds it (a resumed job has several).

    Attributes:
        wall: When it started (Unix seconds).
        total: Rows the job takes.
        done_before: Rows done when it started.
        ticks: Its snapshots, each a dict with ``t``, ``wall``, ``done``, ``rows``,
            ``failed``, ``out_tokens``, ``errors``, ``queued``, ``in_flight`` and
            ``servers`` (server URL -> dict of :data:`SERVER_FIELDS`).
        changes: Its server changes (``t``, ``wall``, ``server``, ``from``, ``to``,
            ``reason``).
        ended: How it ended (``finished``, ``interrupted``, ``failed``), or None if its
            process died or it still runs.
    """

    wall: float
    total: int
    done_before: int
    pid: int | None = None
    ticks: list[dict[str, Any]] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)
    ended: str | None = None


def read_timeline(directory: Path) -> list[RunRecord]:
    """The runs in a run directory's ``timeline.jsonl``, oldest first ([] if none).

    Safe while a job appends to it: a torn last line and lines of another format are
    skipped (see the module's docstring).

    Raises:
        RunDirectoryError: The timeline is a link or not a regular file.
    """
    path = directory / TIMELINE_FILE
    data = read_run_file(path)
    if data is None:
        return []
    return _runs(_lines(data), path)


_ENDED = ENDINGS
"""How a run ends, as its ``end`` line says."""
_LONGEST = 1e11
"""The largest time a line may hold, in seconds (wall times are Unix seconds; about the
year 5100): larger ones are not of this format."""
_TICK_COUNTS = ("failed", "out_tokens", "queued", "in_flight", "changes_dropped")
"""A tick's optional counts, kept if they are counts."""


def _runs(lines: Iterator[tuple[int, Any]], path: Path) -> list[RunRecord]:
    """The runs of ``(line number, JSON value)`` pairs, each line checked (a bad one is
    skipped and counted; one warning names the count and the first)."""
    runs: list[RunRecord] = []
    urls: list[str] = []
    skipped: list[int] = []
    for number, line in lines:
        kind = line.get("e") if isinstance(line, dict) else None
        if kind == "start":
            run = _start(line)
            if run is not None:
                runs.append(run)
                urls = []
                continue
        elif kind in ("tick", "member", "end") and runs:
            run = runs[-1]
            if kind == "tick":
                if "urls" in line and _urls(line["urls"]):
                    urls = list(line["urls"])
                tick = _tick(line, urls)
                if tick is not None:
                    run.ticks.append(tick)
                    continue
            elif kind == "member":
                change = _change(line)
                if change is not None:
                    run.changes.append(change)
                    continue
            elif line.get("state") in _ENDED:
                run.ended = line["state"]
                continue
        skipped.append(number)
    if skipped:
        log.warning(
            "timeline_lines_skipped", path=str(path), lines=len(skipped), first_line=skipped[0]
        )
    return runs


def _start(line: dict[str, Any]) -> RunRecord | None:
    if not (_time(line.get("wall")) and _count(line.get("total"))):
        return None
    if not _count(line.get("done_before")):
        return None
    pid: Any = line.get("pid")
    return RunRecord(
        wall=float(line["wall"]),
        total=line["total"],
        done_before=line["done_before"],
        pid=pid if _count(pid) and pid > 0 else None,
    )


def _tick(line: dict[str, Any], urls: list[str]) -> dict[str, Any] | None:
    """A tick's checked fields (:class:`RunRecord`), or None if it is not a tick."""
    if "urls" in line and not _urls(line["urls"]):
        return None
    if not (_time(line.get("t")) and _time(line.get("wall"))):
        return None
    if not (_count(line.get("done")) and _count(line.get("rows"))):
        return None
    servers = _servers(line.get("servers"), urls)
    if servers is None:
        return None
    errors = line.get("errors")
    tick: dict[str, Any] = {
        "t": line["t"],
        "wall": line["wall"],
        "done": line["done"],
        "rows": line["rows"],
        "errors": {
            kind: count
            for kind, count in (errors.items() if isinstance(errors, dict) else ())
            if _count(count)
        },
        "servers": servers,
    }
    tick.update((name, line[name]) for name in _TICK_COUNTS if _count(line.get(name)))
    return tick


def _change(line: dict[str, Any]) -> dict[str, Any] | None:
    """A server change's checked fields, or None if it is not one."""
    if not (_time(line.get("t")) and _time(line.get("wall"))):
        return None
    server, before, after = line.get("server"), line.get("from"), line.get("to")
    if not (isinstance(server, str) and isinstance(before, str) and isinstance(after, str)):
        return None
    reason = line.get("reason")
    return {
        "t": line["t"],
        "wall": line["wall"],
        "server": server,
        "from": before,
        "to": after,
        "reason": reason[:300] if isinstance(reason, str) else None,
    }


def _urls(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(url, str) for url in value)


def _time(value: Any) -> bool:
    """Whether a value is a time in seconds as a line holds one (a finite number from 0
    to :data:`_LONGEST`, not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return bool(0 <= value <= _LONGEST)


def _count(value: Any) -> bool:
    """Whether a value is a count (an int of at least 0, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _servers(values: Any, urls: list[str]) -> dict[str, dict[str, Any]] | None:
    """A tick's servers by URL, each a dict of :data:`SERVER_FIELDS` (a state, then
    counts), or None if they are not such lists, one per URL."""
    if not isinstance(values, list) or len(values) != len(urls):
        return None
    servers = {}
    for url, entry in zip(urls, values, strict=True):
        if not isinstance(entry, list) or not entry or not isinstance(entry[0], str):
            return None
        fields = dict(zip(SERVER_FIELDS, entry, strict=False))
        if not all(_count(fields[n]) for n in SERVER_FIELDS[1:] if n in fields):
            return None
        servers[url] = fields
    return servers


def last_servers(directory: Path, tail: int = 1 << 20) -> dict[str, dict[str, Any]]:
    """The servers of the timeline's last tick, read from the end of the file only
    (a week-long run's timeline is tens of MB); {} if it has none there, or if the
    timeline is a link or not a regular file (it is advisory: not followed, not waited
    on)."""
    path = directory / TIMELINE_FILE
    try:
        with open_binary(path) as file:
            size = os.fstat(file.fileno()).st_size
            file.seek(max(0, size - tail))
            data = file.read(tail)
    except (OSError, RunDirectoryError):
        return {}
    lines = list(_lines(data, cut=size > tail))
    # The urls of the last tick: the last tick that names them, at or before it.
    start = {"e": "start", "wall": 0, "total": 0, "done_before": 0}
    first_named = next(
        (i for i, (_, line) in enumerate(lines) if isinstance(line, dict) and "urls" in line),
        None,
    )
    if first_named is None:
        return {}
    runs = _runs(iter([(0, start), *lines[first_named:]]), path)
    ticks = [tick for run in runs for tick in run.ticks]
    servers: dict[str, dict[str, Any]] = ticks[-1]["servers"] if ticks else {}
    return servers


def _lines(data: bytes, *, cut: bool = False) -> Iterator[tuple[int, Any]]:
    """``(line number, JSON value or None)`` of each whole line that is not blank. The
    bytes after the last newline (a line being written, or torn by a crash) are left
    out, and with ``cut`` the first line too (the start of a read from mid-file)."""
    raws = data.split(b"\n")
    raws.pop()  # after the last newline
    for number, raw in enumerate(raws, 1):
        if (cut and number == 1) or not raw.strip():
            continue
        try:
            yield number, orjson.loads(raw)
        except orjson.JSONDecodeError:
            yield number, None
