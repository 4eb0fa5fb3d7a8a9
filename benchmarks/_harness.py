"""What the benchmarks share: CPU accounting, idle waits, workers, tables, the job inputs.

The benchmark scripts insert this folder into ``sys.path`` and import from here, so no
script imports another. Nothing here prints a table of its own: the scripts choose
their headers and wording, and these helpers keep the mechanics in one place.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol, TypeVar

from _nginx import raise_nofile_limit

T = TypeVar("T")

# --------------------------------------------------------------------------------------
# CPU time: this process, each core, the machine, the kernel's TCP counters
# --------------------------------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU seconds (user + system, all threads) this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def busy_seconds(cpu: int | None = None) -> float | None:
    """Seconds core ``cpu`` (all cores with None) has spent busy since boot.

    Busy is anything but idle and I/O wait, read from ``/proc/stat``; None where it
    cannot be read. Steal time of a virtual machine counts as busy: the core was not
    available to this process.
    """
    prefix = "cpu " if cpu is None else f"cpu{cpu} "
    try:
        with open("/proc/stat") as stat:
            for line in stat:
                if line.startswith(prefix):
                    ticks = [int(v) for v in line.split()[1:]]
                    busy = sum(ticks) - ticks[3] - ticks[4]
                    # guest time is already inside user time
                    busy -= sum(ticks[8:10]) if len(ticks) >= 10 else 0
                    return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    return None


def cpu_count() -> int:
    """The machine's CPUs (1 where unknown)."""
    return os.cpu_count() or 1


def machine_other_load(
    busy0: float | None, busy1: float | None, ours: float, wall: float
) -> float | None:
    """The share of the machine's CPUs other processes took over ``wall`` seconds.

    ``busy0`` and ``busy1`` are :func:`busy_seconds` of the machine before and after,
    ``ours`` the CPU seconds the benchmark's own processes used; None where unknown.
    """
    if busy0 is None or busy1 is None or wall <= 0:
        return None
    return max(0.0, busy1 - busy0 - ours) / (wall * cpu_count())


TCP_COUNTERS = ("ListenOverflows", "ListenDrops", "TCPSynRetrans", "TCPTimeouts")
"""Kernel counters (``/proc/net/netstat``, TcpExt) that show dropped connection attempts."""


def tcp_counters() -> dict[str, int]:
    """The machine-wide values of :data:`TCP_COUNTERS` ({} where unreadable)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return {name: int(table[name]) for name in TCP_COUNTERS if name in table}
    return {}


def tcp_rise(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters of :func:`tcp_counters` that rose from ``before`` to ``after``, by how much."""
    return {
        name: after[name] - before.get(name, 0)
        for name in after
        if after[name] > before.get(name, 0)
    }


class Clock:
    """Wall and CPU time of a timed part, and the share of its core other work took."""

    def __init__(self, cpu: int) -> None:
        self.cpu = cpu
        self.wall = self.cpu_time = 0.0
        self.other_load: float | None = None
        self._wall0 = self._cpu0 = 0.0
        self._core0: float | None = None

    def start(self) -> float:
        """Start the clocks; return the monotonic start time."""
        self._core0 = busy_seconds(self.cpu)
        self._cpu0 = cpu_seconds()
        self._wall0 = time.perf_counter()
        return time.monotonic()

    def stop(self) -> None:
        """Stop the clocks: set ``wall``, ``cpu_time`` and, where known, ``other_load``."""
        self.wall = time.perf_counter() - self._wall0
        self.cpu_time = cpu_seconds() - self._cpu0
        core1 = busy_seconds(self.cpu)
        if self._core0 is not None and core1 is not None and self.wall > 0:
            others = core1 - self._core0 - self.cpu_time
            self.other_load = max(0.0, others / self.wall)


# --------------------------------------------------------------------------------------
# Cores for the client and the server, a quiet machine, the quietest of a few attempts
# --------------------------------------------------------------------------------------


def pick_cpus() -> tuple[int, int]:
    """(client CPU, server CPU): two different cores when this process may use two."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) == 1:
        return cpus[0], cpus[0]
    return cpus[0], cpus[1]


def background_load(cpus: Sequence[int], seconds: float = 1.0) -> dict[int, float]:
    """The busy share of each core over ``seconds`` while the benchmark itself is idle."""
    unique = sorted(set(cpus))
    before = [busy_seconds(cpu) for cpu in unique]
    time.sleep(seconds)
    after = [busy_seconds(cpu) for cpu in unique]
    return {
        cpu: min(1.0, (b1 - b0) / seconds)
        for cpu, b0, b1 in zip(unique, before, after, strict=True)
        if b0 is not None and b1 is not None
    }


def _busiest(cpus: Sequence[int] | None) -> float | None:
    """The busy share over one second of the busiest core of ``cpus`` (None: the machine)."""
    if cpus is not None:
        load = background_load(cpus)
        return max(load.values()) if load else None
    before = busy_seconds()
    time.sleep(1.0)
    after = busy_seconds()
    if before is None or after is None:
        return None
    return (after - before) / cpu_count()


def wait_for_idle(budget: float, cpus: Sequence[int] | None, threshold: float = 0.1) -> None:
    """Wait up to ``budget`` seconds until no core in ``cpus`` is busier than ``threshold``.

    With ``cpus`` None it is the machine's share of all its CPUs that must fall below
    ``threshold``. Between cases the benchmark itself is idle, so whatever keeps the
    CPUs busy is other work that would land in the middle of the next case. Gives up
    (and says so) when the budget runs out.
    """
    deadline = time.monotonic() + budget
    announced = False
    while True:
        share = _busiest(cpus)
        if share is None or share <= threshold:
            return
        if time.monotonic() >= deadline:
            print(f"  still busy after {budget:.0f} s; measuring anyway", flush=True)
            return
        if not announced:
            print("  waiting for the CPUs to go idle ...", flush=True)
            announced = True


def print_background(cpus: Sequence[int], first: str) -> dict[int, float]:
    """Print how busy ``cpus`` are before the ``first`` case runs (nginx idle); return it."""
    busy = background_load(cpus)
    if busy:
        shown = ", ".join(f"CPU {cpu} {share:.0%}" for cpu, share in busy.items())
        print(f"CPU busy before the first {first} (nginx idle): {shown}")
    return busy


@dataclass(frozen=True)
class Retry:
    """How a case is measured again while other work disturbs it.

    Attributes:
        attempts: Measurements at most (``--attempts``).
        wait_idle: Seconds to wait at most for the CPUs to go idle before each one
            (``--wait-idle``; 0: do not wait).
        noisy: Above this noise a case is measured again.
        again: The line printed before another attempt, formatted with ``noise``,
            ``attempt`` (the next one) and ``attempts``.
    """

    attempts: int
    wait_idle: float
    noisy: float
    again: str


def quietest(
    measure: Callable[[], T], noise: Callable[[T], float], retry: Retry, cpus: Sequence[int] | None
) -> T:
    """Measure until other work stays under ``retry.noisy`` (or attempts run out); the quietest.

    Before each attempt it waits for ``cpus`` to go idle, as :func:`wait_for_idle`.
    """
    best: T | None = None
    for attempt in range(1, retry.attempts + 1):
        if retry.wait_idle > 0:
            wait_for_idle(retry.wait_idle, cpus)
        result = measure()
        if best is None or noise(result) < noise(best):
            best = result
        if noise(result) <= retry.noisy or attempt == retry.attempts:
            break
        line = retry.again.format(noise=noise(result), attempt=attempt + 1, attempts=retry.attempts)
        print(line, flush=True)
    assert best is not None
    return best


class Loads(Protocol):
    """A case's result that knows how much of its cores other work took."""

    other_load: float | None
    server_other_load: float | None


def noise(result: Loads) -> float:
    """The largest share of either core other work took during the case (0 if unknown)."""
    return max(result.other_load or 0.0, result.server_other_load or 0.0)


L = TypeVar("L", bound=Loads)
S = TypeVar("S")


def run_cases(
    specs: Sequence[S],
    run: Callable[[S], L],
    title: Callable[[S], str],
    retry: Retry,
    cpus: Sequence[int],
) -> list[L]:
    """Run each case (``running <title> ...``), keeping the quietest of its attempts."""
    results: list[L] = []
    for spec in specs:
        print(f"running {title(spec)} ...", flush=True)
        results.append(quietest(partial(run, spec), noise, retry, cpus))
    return results


# --------------------------------------------------------------------------------------
# Clients: conversations to send, errors by kind, the event loop
# --------------------------------------------------------------------------------------


def error_kind(exc: BaseException) -> str:
    """The exception's type, and the type of the exception it wraps, if any."""
    kind = type(exc).__name__
    cause = exc.__cause__ or exc.__context__
    if cause is not None and type(cause).__name__ != kind:
        kind += f" <- {type(cause).__name__}"
    return kind


def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop factory, or None when uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def sample_conversations(count: int) -> list[list[dict[str, str]]]:
    """``count`` one-message conversations, each asking to classify a review."""
    return [
        [{"role": "user", "content": f"Classify the sentiment of review {i}: great product."}]
        for i in range(count)
    ]


# --------------------------------------------------------------------------------------
# Worker subprocesses: one case each, reporting on one marked stdout line
# --------------------------------------------------------------------------------------


def report_result(marker: str, result: Any) -> None:
    """Print ``result`` (a dataclass) on the one stdout line the parent reads back."""
    sys.stdout.write(marker + json.dumps(asdict(result)) + "\n")
    sys.stdout.flush()


def read_spec(spec_class: Callable[..., T], text: str) -> T:
    """The spec a parent handed its worker as JSON (lists, such as URLs, become tuples)."""
    data: dict[str, Any] = json.loads(text)
    return spec_class(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def peak_rss_kb() -> int:
    """This process's peak resident set size so far, in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


class Watchdog:
    """Lets the first of a worker and its time limit report the result, never both.

    At the limit the timer calls ``expire`` (which reports a partial result and ends
    the worker), so a hung client cannot hang the benchmark.
    """

    def __init__(self, timeout: float, expire: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._claimed = False
        self._timer = threading.Timer(timeout, expire)
        self._timer.daemon = True

    def start(self) -> None:
        """Start the time limit."""
        self._timer.start()

    def claim(self) -> bool:
        """Whether the caller reports first (the limit then no longer runs)."""
        with self._lock:
            if self._claimed:
                return False
            self._claimed = True
            self._timer.cancel()
            return True


def pin_worker(cpu: int) -> None:
    """Pin this worker process to ``cpu`` and give it as many open files as it may have."""
    os.sched_setaffinity(0, {cpu})
    raise_nofile_limit()


@dataclass
class WorkerOutput:
    """What a worker subprocess left behind.

    Attributes:
        data: The fields of its result line, or None when it printed none.
        stderr: Its standard error.
        returncode: Its exit code, or None when it ran past its time limit and was killed.
        timeout: That time limit, in seconds.
    """

    data: dict[str, Any] | None
    stderr: str
    returncode: int | None
    timeout: float

    def tail(self, lines: int) -> str:
        """The last ``lines`` lines of the worker's stderr."""
        return tail(self.stderr, lines)

    def note_with_stderr(self, note: str, lines: int) -> str:
        """``note`` with the tail of the worker's stderr below it."""
        return (note + "\n" + self.tail(lines)).strip()

    def failure(self, lines: int) -> tuple[str, str]:
        """(status, note) of a worker without a result: ``"timeout"`` or ``"crashed"``."""
        if self.returncode is None:
            return (
                "timeout",
                f"the worker did not report within {self.timeout:.0f} s and was killed",
            )
        return "crashed", f"the worker exited with code {self.returncode}:\n{self.tail(lines)}"


def run_worker(script: str, spec: Any, marker: str, timeout: float) -> WorkerOutput:
    """Run ``script --worker <spec as JSON>`` and read back its result line.

    A worker that runs past ``timeout`` seconds is killed.
    """
    command = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(asdict(spec))]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return WorkerOutput(None, "", None, timeout)
    for line in done.stdout.splitlines():
        if line.startswith(marker):
            data = json.loads(line[len(marker) :])
            return WorkerOutput(data, done.stderr, done.returncode, timeout)
    return WorkerOutput(None, done.stderr, done.returncode, timeout)


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------


def percent(share: float | None) -> str:
    """A share as a whole percentage, "-" where unknown."""
    return "-" if share is None else f"{100 * share:.0f}"


def tail(text: str, lines: int = 15) -> str:
    """The last ``lines`` lines of ``text``."""
    return "\n".join(text.strip().splitlines()[-lines:])


def version(dist: str) -> str:
    """The installed version of a distribution, or "not installed"."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions(*dists: str) -> str:
    """``name version`` of each distribution, comma-separated (see :func:`version`)."""
    return ", ".join(f"{dist} {version(dist)}" for dist in dists)


def print_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, first_left: bool = True
) -> None:
    """Print a table: the first column left-aligned (or right with ``first_left=False``)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [cell.rjust(width) for cell, width in zip(cells, widths, strict=True)]
        if first_left:
            padded[0] = cells[0].ljust(widths[0])
        return "  ".join(padded)

    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


# --------------------------------------------------------------------------------------
# Annotation jobs: the JSONL input, the prompt, the job's log events and phases
# --------------------------------------------------------------------------------------

TEMPLATE = "Classify the sentiment of this review as positive or negative.\n\nReview: {text}"
"""The prompt template of the annotation jobs against nginx."""

STORE_CLOSED = ("store_closed", "results store closed")
CONSOLIDATED = ("results_consolidated", "results consolidated")
"""Names of the log events that end the streaming and consolidation phases (old, new)."""

PHASES = ("setup", "streaming", "consolidation", "finish")
"""The phases of a job, in order (see :func:`phase_times`)."""


def write_input(path: Path, rows: int) -> Path:
    """Write ``rows`` JSONL rows (``id``, ``text``) to ``path``; return it."""
    with path.open("w", buffering=1 << 20) as file:
        for i in range(rows):
            stars = "great" if i % 3 else "poor"
            file.write(
                f'{{"id": {i}, "text": "Review {i}: a {stars} product, it arrived '
                f'on time and works as described.", "stars": {1 + i % 5}}}\n'
            )
    return path


class EventLog:
    """Keeps structlog events (with the time they came) instead of printing them.

    Warnings and errors are still printed to standard error (unless ``echo`` is off):
    they mean a figure is suspect.
    """

    def __init__(self, on_event: Callable[[str], None] | None = None, *, echo: bool = True) -> None:
        self.events: list[tuple[float, str, dict[str, Any]]] = []
        self.on_event = on_event
        self.echo = echo

    def __call__(self, _logger: Any, method: str, event: MutableMapping[str, Any]) -> Any:
        import structlog

        name = str(event.get("event"))
        self.events.append((time.monotonic(), name, dict(event)))
        if self.on_event is not None:
            self.on_event(name)
        if self.echo and method in ("warning", "error", "critical", "exception"):
            fields = " ".join(f"{k}={v}" for k, v in event.items() if k != "event")
            print(f"[{method}] {name} {fields}", file=sys.stderr, flush=True)
        raise structlog.DropEvent

    def install(self) -> None:
        """Route every structlog event of this process here."""
        import structlog

        structlog.configure(processors=[self], cache_logger_on_first_use=False)

    def first(self, names: Sequence[str], since: float) -> float | None:
        """The time of the first event named one of ``names`` at or after ``since``."""
        return next((t for t, e, _ in self.events if e in names and t >= since), None)


def phase_times(log: EventLog, start: float, end: float) -> dict[str, float]:
    """Seconds of each phase of one job, from its log events.

    ``setup`` runs from the call to ``job_started`` (the input scan, the model, the store
    opened), ``streaming`` to the store's closing, ``consolidation`` to the results
    being consolidated, and ``finish`` (the report) to the call's return. A phase whose
    events are missing is left out.
    """
    started = log.first(("job_started",), start)
    closed = log.first(STORE_CLOSED, start)
    consolidated = log.first(CONSOLIDATED, start)
    phases: dict[str, float] = {}
    if started is not None:
        phases["setup"] = started - start
        if closed is not None:
            phases["streaming"] = closed - started
    if closed is not None and consolidated is not None:
        phases["consolidation"] = consolidated - closed
    if consolidated is not None:
        phases["finish"] = end - consolidated
    return phases
