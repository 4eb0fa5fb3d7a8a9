"""What the benchmarks share: CPU accounting, idle waits, workers, nginx, tables, inputs.

The benchmark scripts insert this folder into ``sys.path`` and import from here, so no
script imports another. The scripts keep their own tables, headers and wording; these
helpers keep the mechanics in one place: where time goes on which core, the worker
subprocess that measures one case and reports it on one stdout line, the run of the
cases against nginx, and the options several scripts take.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any, Protocol, TypeVar

from _nginx import CannedServer, NginxError, raise_nofile_limit

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


def traced_bytes(trace: Path, wanted: Callable[[str], bool]) -> int:
    """The bytes read, by an ``strace -f -y`` log of ``read``-like calls, from the files
    whose path ``wanted`` accepts; a call another thread cut in two is joined up."""
    whole = re.compile(r"^(\d+)\s+\w+\(\d+<([^>]*)>.*\)\s+= (\d+)$")
    begun = re.compile(r"^(\d+)\s+\w+\(\d+<([^>]*)>.*<unfinished \.\.\.>$")
    resumed = re.compile(r"^(\d+)\s+<\.\.\. \w+ resumed>.*\)\s+= (\d+)$")
    total = 0
    pending: dict[str, str] = {}  # a thread's call cut in two by another's: its file
    with trace.open() as file:
        for line in file:
            if match := whole.match(line):
                path, count = match.group(2), int(match.group(3))
            elif match := begun.match(line):
                pending[match.group(1)] = match.group(2)
                continue
            elif match := resumed.match(line):
                path, count = pending.pop(match.group(1), ""), int(match.group(2))
            else:
                continue
            if wanted(path):
                total += count
    return total


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


MACHINE_NOISY = 0.15
"""Above this share of the machine's CPUs taken by other processes, a run is called noisy.

For the benchmarks that cannot pin their servers to a core of their own.
"""


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


@dataclass(kw_only=True)
class CaseFigures:
    """What a worker measured of one case against nginx, whichever the client.

    The scripts' results add their own fields (the row's name, its size, ...).

    Attributes:
        status: ``"ok"`` when the case ran to its end, ``"timeout"`` when it hit its
            time limit, ``"unavailable"`` when the client cannot be built here,
            ``"crashed"`` when the worker died.
        ok: Successful answers in the timed part.
        errors: Failures by kind.
        samples: One error message per kind, to show what went wrong.
        wall: Seconds of wall time of the timed part.
        cpu: Seconds of CPU time (user + system, all threads) of the timed part.
        peak_rss_kb: The worker's peak resident set size, in KiB.
        other_load: Share of the client's core that went to anything else (other
            processes, interrupts, a hypervisor) during the timed part; None where
            unknown. A high figure means a noisy measurement.
        server_other_load: The same share for nginx's core, over the whole case.
        tcp: Machine-wide TCP counters that rose during the case (listen queue
            overflows, SYN retransmits, ...); other programs can add to them too.
        note: Anything else worth printing (why a client is unavailable, ...).
    """

    status: str = "ok"
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    samples: dict[str, str] = field(default_factory=dict)
    wall: float = 0.0
    cpu: float = 0.0
    peak_rss_kb: int = 0
    other_load: float | None = None
    server_other_load: float | None = None
    tcp: dict[str, int] = field(default_factory=dict)
    note: str = ""


def noise(result: CaseFigures) -> float:
    """The largest share of either core other work took during the case (0 if unknown)."""
    return max(result.other_load or 0.0, result.server_other_load or 0.0)


C = TypeVar("C", bound=CaseFigures)
S = TypeVar("S")


def run_cases(
    specs: Sequence[S],
    run: Callable[[S], C],
    title: Callable[[S], str],
    retry: Retry,
    cpus: Sequence[int],
) -> list[C]:
    """Run each case (``running <title> ...``), keeping the quietest of its attempts."""
    results: list[C] = []
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


def run_worker(
    script: str, spec: Any, marker: str, timeout: float, env: dict[str, str] | None = None
) -> WorkerOutput:
    """Run ``script --worker <spec as JSON>`` (in ``env``, this process's by default) and
    read back its result line.

    A worker that runs past ``timeout`` seconds is killed.
    """
    command = [sys.executable, str(Path(script).resolve()), "--worker", json.dumps(asdict(spec))]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return WorkerOutput(None, "", None, timeout)
    for line in done.stdout.splitlines():
        if line.startswith(marker):
            data = json.loads(line[len(marker) :])
            return WorkerOutput(data, done.stderr, done.returncode, timeout)
    return WorkerOutput(None, done.stderr, done.returncode, timeout)


# --------------------------------------------------------------------------------------
# The parent: nginx around the cases, its side of each case, the end of the run
# --------------------------------------------------------------------------------------


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into an orderly exit, so that a plain ``kill`` stops the servers too."""
    signal.signal(signal.SIGTERM, _exit_on_signal)


def main_over_nginx(
    args: argparse.Namespace,
    spec_class: Callable[..., S],
    worker: Callable[[S], None],
    body: Callable[[argparse.Namespace, CannedServer, int, int], int],
    backlog: int = 4096,
) -> int:
    """The ``main`` of a benchmark whose cases run against nginx; the exit code.

    With ``--worker``, this process is a worker: it measures the one case it was
    handed. Otherwise nginx starts on four ports, pinned to a core of its own where
    there are two, ``body(args, server, client_cpu, server_cpu)`` runs, and nginx
    stops. Returns ``body``'s exit code; 2 when nginx cannot start, 130 on Ctrl-C.
    """
    if args.worker:
        worker(read_spec(spec_class, args.worker))
        return 0
    exit_on_sigterm()
    raise_nofile_limit()
    client_cpu, server_cpu = pick_cpus()
    try:
        server = CannedServer(ports=4, cpu=server_cpu, backlog=backlog)
        server.start()
    except NginxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return body(args, server, client_cpu, server_cpu)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        server.stop()


@contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A temporary folder for inputs and outputs, deleted with all it holds at the end."""
    with tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True) as name:
        yield Path(name)


def watch_server(server: CannedServer, server_cpu: int, run: Callable[[], C]) -> C:
    """``run()``'s result, with the share of nginx's core other work took around it.

    nginx's CPU time and its core's busy time give that share
    (``server_other_load``); the kernel's TCP counters that rose (``tcp``) tell
    whether connection attempts were dropped.
    """
    core0, nginx0, tcp0 = busy_seconds(server_cpu), server.cpu_seconds(), tcp_counters()
    wall0 = time.perf_counter()
    result = run()
    wall = time.perf_counter() - wall0
    core1, nginx1, tcp1 = busy_seconds(server_cpu), server.cpu_seconds(), tcp_counters()
    if None not in (core0, core1, nginx0, nginx1) and wall > 0:
        assert core0 is not None and core1 is not None
        assert nginx0 is not None and nginx1 is not None
        result.server_other_load = max(0.0, ((core1 - core0) - (nginx1 - nginx0)) / wall)
    result.tcp = tcp_rise(tcp0, tcp1)
    return result


def measure_cases(
    server: CannedServer,
    cpus: tuple[int, int],
    specs: Sequence[S],
    run: Callable[[S, CannedServer, int], C],
    title: Callable[[S], str],
    retry: Retry,
    reports: Sequence[Callable[[list[C]], None]],
    log_lines: int,
) -> int:
    """Run every case, print each of ``reports`` and nginx's error log; the exit code.

    ``run(spec, server, server_cpu)`` measures one case (see :func:`run_cases` for
    ``title`` and ``retry``). The exit code is 1 when a case could not be measured
    (its worker crashed), else 0.
    """
    server_cpu = cpus[1]
    print()
    results = run_cases(specs, lambda spec: run(spec, server, server_cpu), title, retry, cpus)
    print()
    for report in reports:
        report(results)
    log = server.error_log().strip()
    if log:
        print("\nnginx error log (tail):\n" + tail(log, log_lines))
    if any(r.status == "crashed" for r in results):
        print("\nerror: a case could not be measured (see above)", file=sys.stderr)
        return 1
    return 0


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
    """``name version`` of each distribution (or ``python``), comma-separated."""
    return ", ".join(
        f"{dist} {platform.python_version() if dist == 'python' else version(dist)}"
        for dist in dists
    )


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


def print_noisy(results: Sequence[CaseFigures], noisy: float, legend: str = "") -> None:
    """Say how many cases lost more than ``noisy`` of a core to other work, if any did."""
    count = sum(noise(r) > noisy for r in results)
    if count:
        print(
            f"\nnoisy: {count} case(s) lost more than {noisy:.0%} of the client's or "
            f"nginx's core to other work{legend}; their figures are low. Rerun on an idle "
            "machine, or with --wait-idle and --attempts."
        )


def print_notes(results: Sequence[C], headline: Callable[[C], str]) -> None:
    """After a blank line, ``* <headline>`` for each case, then its note, errors and TCP."""
    if results:
        print()
    for r in results:
        print(f"* {headline(r)}")
        for note_line in r.note.strip().splitlines():
            print(f"    {note_line}")
        for kind, count in sorted(r.errors.items(), key=lambda item: -item[1]):
            print(f"    {count:,} x {kind}: {r.samples.get(kind, '')}")
        if r.tcp:
            counters = ", ".join(f"{name} +{value:,}" for name, value in r.tcp.items())
            print(f"    kernel TCP counters during the case: {counters}")


class Rated(Protocol):
    """A case's result with a rate: requests or rows per second, None when it failed."""

    @property
    def rps(self) -> float | None:
        """The rate, or None for a failed case."""
        ...


def rate_verdict(row: Rated | None, target: float, unit: str) -> str:
    """A target line's verdict on ``row``: its rate against ``target``, PASS or MISS."""
    if row is None:
        return "not run"
    if row.rps is None:
        return "no figure, the run failed (MISS)"
    verdict = "PASS" if row.rps >= target else "MISS"
    return f"{row.rps:,.0f} {unit} (target >= {target:,.0f}): {verdict}"


def ratio_verdict(ours: Rated | None, sdk: Rated | None, target: float) -> str:
    """A target line's verdict on our rate over the SDK's, PASS or MISS."""
    if ours is None or sdk is None:
        return "not run"
    if ours.rps is None or sdk.rps is None:
        failed = "ours" if ours.rps is None else "the SDK's"
        return f"no figure, {failed} run did not pass (MISS)"
    ratio = ours.rps / sdk.rps
    verdict = "PASS" if ratio >= target else "MISS"
    return f"{ratio:.1f} x (target >= {target:.0f}x): {verdict}"


# --------------------------------------------------------------------------------------
# Command-line options
# --------------------------------------------------------------------------------------


def add_number(parser: argparse.ArgumentParser, flag: str, default: float, help_text: str) -> None:
    """Add ``flag`` taking one number: an int or a float, as ``default`` is."""
    parser.add_argument(flag, type=type(default), default=default, help=help_text)


def add_case_timeout(parser: argparse.ArgumentParser, default: float) -> None:
    """Add ``--case-timeout``: the seconds one case may take, warm-up included."""
    help_text = f"seconds one case may take, warm-up included (default {default:.0f})"
    add_number(parser, "--case-timeout", default, help_text)


def add_wait_idle(parser: argparse.ArgumentParser, before: str, default: str) -> None:
    """Add ``--wait-idle SECONDS``: before each ``before``, wait for the CPUs to go idle."""
    parser.add_argument(
        "--wait-idle",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help=f"before each {before}, wait up to this long for the CPUs to go idle ({default})",
    )


def add_attempts(parser: argparse.ArgumentParser, noisy: float) -> None:
    """Add ``--attempts``: measure a case again while other work takes over ``noisy``."""
    parser.add_argument(
        "--attempts",
        type=int,
        default=1,
        help="measure a case up to this many times while other work takes more than "
        f"{100 * noisy:.0f}%% of either core, keeping the quietest run (default 1)",
    )


def add_worker(parser: argparse.ArgumentParser) -> None:
    """Add the hidden ``--worker SPEC`` a parent starts its worker subprocesses with."""
    parser.add_argument("--worker", help=argparse.SUPPRESS)


def chosen(
    parser: argparse.ArgumentParser, option: str, text: str, choices: Sequence[str]
) -> set[str] | None:
    """The names in a comma-separated option (None for none); a usage error for unknown ones."""
    names = set(filter(None, text.split(",")))
    unknown = names - set(choices)
    if unknown:
        parser.error(f"{option} takes {', '.join(choices)}; unknown: {', '.join(sorted(unknown))}")
    return names or None


def integers(parser: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """The integers of a comma-separated option; a usage error when one is not."""
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        parser.error(f"{option} takes comma-separated integers")


# --------------------------------------------------------------------------------------
# Requests and annotation jobs against nginx: the token limit, the JSONL input, the
# prompt, the job's log events and phases
# --------------------------------------------------------------------------------------

MAX_TOKENS = 16
"""The token limit of the requests against nginx (its canned answer is one token)."""

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
