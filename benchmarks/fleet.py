"""Independent elastic workers sharing a fleet of simulated GPU servers: rows a second
against the fleet's capacity, what each server holds against its budget, rows sent or
written twice, rows lost; then the same with servers and workers SIGKILLed mid-run.

A SLURM array (``sbatch -a 0-N``) or an elastic Kubernetes Job starts N copies of one
command, ``llm-annotator run ... --shard claim``, that share a run directory and know
nothing of each other: each takes the corpus's units by claims and sends each server up
to its own budget, ``--batch-size`` x ``--max-concurrent-batches-per-client`` requests.
What a server should carry from the whole fleet is one such budget; N workers that each
fill theirs put N budgets on it. This script starts N such workers (the real command,
``python -m llm_annotator.cli run``, one process each: ``--processes 1``), one every
``--stagger`` seconds, over a corpus of ``--rows`` short rows in ``--files`` JSONL
files, against S simulated servers, for each N of ``--workers`` and each S of
``--servers``.

The servers (``_sim_server.py``): each runs at most ``--capacity`` requests at once, for
``--latency`` seconds each, and queues the rest in a first-come, first-served line, as
vLLM's scheduler does; it answers ``/metrics`` with vLLM's gauges
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``) and records the most
requests it held at once (running and waiting: its peak held) and the requests it got,
answered and dropped. Several servers share a process (``--per-process``, each on its
own port with its own line and counters), so that hundreds fit on a small machine. The
fleet's capacity is the sum of the servers' throughputs, ``capacity / latency`` each.
The default latency is 0.64 s x S / 16, so that every fleet answers 400 rows a second
and the workers' CPU, not the servers, stays the question (hundreds of fast servers
would need more cores than the workers have); the workers' CPU seconds and the
machine's cores are printed beside the rates.

Each case runs twice (``--no-kill``: once): as is, and with faults. Once
``--kill-at`` of the rows are answered (the servers' counters, read every half
second), 10% of the servers (at least one) stop at once: the process that serves them
(they have one of their own) is SIGKILLed, their sockets reset. At the same moment 10%
of the running workers (at least one from N = 4 on, none at N = 1) are SIGKILLed, each
its whole process group. The others must finish every row: none lost, none written
twice. A server may have answered a row twice (a row in flight at a killed worker, or
answered by a server as it was killed): counted, not an error.

For each run: the makespan (the first worker's start to the last worker's exit; killed
workers do not count) and rows a second against the fleet's capacity; each server's
peak held against the budget (lowest, median and highest over the servers, the highest
over the budget, and N x budget beside it); the requests the servers got and answered
beyond one a row, and dropped (their client went away); the output read back from
``annotations/`` with pyarrow: rows, ids written more than once, ids of the input
missing, rows that ended in error; the CPU seconds of the workers and of the servers,
and the share of the machine's CPUs other work took.

All the workers run on this machine, so a killed worker's claims are known dead at
once (a claim names its machine and pid); on hosts of their own the others would wait
out its lease (``--claim-lease``, 60 s by default) before taking its units over.

Run it as::

    python benchmarks/fleet.py                          # N = 1,4,8,32 over 16 and 256 servers
    python benchmarks/fleet.py --workers 1,4,8 --servers 16
    python benchmarks/fleet.py --quick                  # N = 1,4 over 16 servers, 4,000 rows
    python benchmarks/fleet.py --at HEAD~3              # the workers on an older commit
    python benchmarks/fleet.py --worker-arg=--adaptive  # a flag for every worker

Prints the figures; exits 1 when a run failed (a worker's error, a time limit, rows
lost or written twice), else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson
import pyarrow.parquet as pq

import _against
import _harness as harness
from _nginx import LOOPBACK, raise_nofile_limit
from _sim_server import READY, ServerModel

SIM_SERVER = str(Path(__file__).resolve().with_name("_sim_server.py"))
SERVED_MODEL = "sim"
TEMPLATE = "Classify the sentiment of this review as positive or negative.\n\nReview: {text}"
REFERENCE_SERVERS = 16
"""The default latency is ``--latency`` x servers / this: the same capacity for all."""
POLL = 0.1
"""Seconds between two looks at the workers."""
STATS_EVERY = 0.5
"""Seconds between two reads of the servers' counters."""
SLOT_ENV = "LLM_ANNOTATOR_WORKER_SLOT"
SENT = re.compile(r"this run sent (\d+)")
"""In the line a worker prints at its end: the rows it sent."""


# --------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------


def build_corpus(folder: Path, rows: int, files: int) -> Path:
    """``rows`` rows (``id`` 0 .. rows - 1, a short ``text``) in ``files`` JSONL files."""
    folder.mkdir(parents=True)
    per_file, extra = divmod(rows, files)
    first = 0
    for f in range(files):
        count = per_file + (f < extra)
        lines = [
            orjson.dumps({"id": i, "text": f"Review {i}: {'great' if i % 3 else 'poor'} value."})
            for i in range(first, first + count)
        ]
        (folder / f"part-{f:04d}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        first += count
    return folder


# --------------------------------------------------------------------------------------
# The servers: processes of the simulated server, several ports each
# --------------------------------------------------------------------------------------


def _proc_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of process ``pid``, None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ServerProcess:
    """One process of ``_sim_server.py`` serving ``count`` servers on as many ports."""

    def __init__(self, count: int, model: ServerModel, stderr: Path) -> None:
        command = [
            sys.executable, SIM_SERVER, "--servers", str(count),
            "--base-latency", repr(model.base_latency), "--capacity", str(model.capacity),
            "--alpha", repr(model.alpha), "--served-model", SERVED_MODEL,
        ]  # fmt: skip
        self.stderr = stderr
        with stderr.open("w") as sink:
            self.process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=sink,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
        self.ports: list[int] = []
        self.last: list[dict[str, Any]] = []
        """The counters of each server at the last read (kept once the process is gone)."""
        self.cpu = 0.0
        self.killed_at: float | None = None

    def wait_ready(self, timeout: float) -> None:
        """Wait for the ports.

        Raises:
            RuntimeError: If the process exits or stays silent for ``timeout`` seconds.
        """
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith(READY):
            self.stop()
            tail = harness.tail(self.stderr.read_text(errors="replace"), 10)
            raise RuntimeError(f"a server process did not start:\n{tail}")
        self.ports = [int(p) for p in line[len(READY) :].split(",")]

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def read(self) -> list[dict[str, Any]]:
        """Every server's counters (the last ones read, once the process is gone)."""
        if self.alive:
            url = f"http://{LOOPBACK}:{self.ports[0]}/bench/group"
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(url, timeout=10) as answer,
            ):
                self.last = json.loads(answer.read())
            self.cpu = _proc_cpu(self.process.pid) or self.cpu
        return self.last

    def kill(self) -> None:
        """Read the counters, then SIGKILL the process: its servers are gone at once."""
        self.read()
        self.killed_at = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        """Terminate the process (SIGKILL after 5 s) and reap it."""
        if not self.alive:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


class Fleet:
    """S simulated servers in a few processes; the first ``victims`` in one of their own.

    The victims are the servers a faulty run kills; runs without faults have the same
    layout, so that the two differ in the kill alone.
    """

    def __init__(
        self, servers: int, victims: int, per_process: int, model: ServerModel, logs: Path
    ) -> None:
        sizes = [victims] if victims else []
        rest = servers - victims
        while rest > 0:
            sizes.append(min(per_process, rest))
            rest -= sizes[-1]
        self.model = model
        self.victims = victims
        self.processes: list[ServerProcess] = []
        try:
            for n, size in enumerate(sizes):
                self.processes.append(ServerProcess(size, model, logs / f"servers-{n}.err"))
            for process in self.processes:
                process.wait_ready(30.0)
        except BaseException:
            self.stop()
            raise

    @property
    def urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{p}/v1" for proc in self.processes for p in proc.ports]

    def read(self) -> list[dict[str, Any]]:
        """Every server's counters, in the order of :attr:`urls`."""
        return [stats for proc in self.processes for stats in proc.read()]

    def answered(self) -> int:
        return sum(int(s["completed"]) for s in self.read())

    def kill_victims(self) -> None:
        if self.victims:
            self.processes[0].kill()

    def cpu(self) -> float:
        return sum(p.cpu for p in self.processes)

    def stop(self) -> None:
        for process in self.processes:
            process.stop()


# --------------------------------------------------------------------------------------
# The workers: the real command, one process group each
# --------------------------------------------------------------------------------------


class Worker:
    """One ``llm-annotator run --shard claim`` process, in a process group of its own."""

    def __init__(self, index: int, command: list[str], env: dict[str, str], logs: Path) -> None:
        self.index = index
        self.stderr = logs / f"worker-{index}.err"
        self.stdout = logs / f"worker-{index}.out"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env={**env, SLOT_ENV: f"fleet-{index}"},
                start_new_session=True,
            )
        self.started = time.monotonic()
        self.ended: float | None = None
        self.code: int | None = None
        self.cpu = 0.0
        self.killed = False

    @property
    def running(self) -> bool:
        return self.ended is None

    def poll(self) -> bool:
        """Whether the worker has exited (reaped here: its code and CPU time kept)."""
        if self.ended is not None:
            return True
        pid, status, usage = os.wait4(self.process.pid, os.WNOHANG)
        if pid == 0:
            return False
        self.ended = time.monotonic()
        self.code = self.process.returncode = os.waitstatus_to_exitcode(status)
        self.cpu = usage.ru_utime + usage.ru_stime
        return True

    def kill(self, deliberately: bool) -> None:
        """SIGKILL the worker's process group and reap the worker (within 10 s)."""
        if self.poll():
            return
        self.killed = deliberately
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not self.poll() and time.monotonic() < deadline:
            time.sleep(0.01)

    def part(self) -> str:
        """The rows this worker sent, from the summary line it printed ("killed" for
        one killed on purpose, "?" where it printed none)."""
        if self.killed:
            return "killed"
        found = SENT.search(self.stdout.read_text(errors="replace"))
        return f"{int(found.group(1)):,}" if found else "?"

    def failure(self) -> str | None:
        """What went wrong, with the tail of its stderr; None when it finished cleanly."""
        if self.killed or self.code == 0:
            return None
        what = "still running at the time limit" if self.code is None else f"exit {self.code}"
        tail = harness.tail(self.stderr.read_text(errors="replace"), 12)
        return f"worker {self.index} ({what}):\n" + "\n".join(
            f"      {t}" for t in tail.split("\n")
        )


# --------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------


@dataclass
class Output:
    """What the run directory's ``annotations/`` holds."""

    rows: int = 0
    unique: int = 0
    """Ids of the input written at least once."""
    twice: int = 0
    """Ids written more than once (each counted once)."""
    lost: int = 0
    errors: int = 0
    error_types: Counter[str] = field(default_factory=Counter)
    """The error rows by ``error_type``."""
    complete: bool = False


def read_output(run_dir: Path, rows: int) -> Output:
    """The output's rows, read back as users do (pyarrow), against the input's ids."""
    result = Output()
    folder = run_dir / "annotations"
    ids: Counter[int] = Counter()
    for path in sorted(folder.glob("*.parquet")):
        if path.name.startswith((".", "_")):
            continue
        table = pq.read_table(path, columns=["id", "error_type"])
        ids.update(table.column("id").to_pylist())
        result.errors += table.num_rows - table.column("error_type").null_count
        result.error_types.update(
            str(kind) for kind in table.column("error_type").to_pylist() if kind is not None
        )
    result.rows = sum(ids.values())
    result.twice = sum(1 for count in ids.values() if count > 1)
    result.unique = len(ids.keys() & range(rows))
    result.lost = rows - result.unique
    with contextlib.suppress(OSError, ValueError):
        manifest = json.loads((folder / "_manifest.json").read_text())
        result.complete = bool(manifest.get("complete"))
    return result


@dataclass
class Run:
    """One run of N workers over S servers, with or without faults."""

    servers: int
    workers: int
    faults: bool
    capacity: float
    budget: int
    input_rows: int
    status: str = "ok"
    wall: float = 0.0
    rows: int = 0
    peaks: list[int] = field(default_factory=list)
    received: int = 0
    answered: int = 0
    aborted: int = 0
    overshoot: float = 0.0
    output: Output = field(default_factory=Output)
    worker_cpu: float = 0.0
    server_cpu: float = 0.0
    other: float | None = None
    kill_note: str = ""
    parts: list[str] = field(default_factory=list)
    """The rows each worker sent, in the order they started."""
    failures: list[str] = field(default_factory=list)
    starts: float = 0.0
    """Seconds from the first worker's start to the last one's."""
    last_answer: float | None = None
    """Seconds from the first worker's start to the servers' last answer."""
    bound: float = 0.0
    """The least the run could take: every server's slots busy from the start, each
    request a whole ``latency``: ``ceil(rows / (servers x capacity)) x latency``."""

    @property
    def case(self) -> str:
        return "faults" if self.faults else "as is"

    @property
    def rate(self) -> float | None:
        return self.rows / self.wall if self.wall > 0 and self.status == "ok" else None

    @property
    def clean(self) -> bool:
        return (
            self.status == "ok"
            and not self.failures
            and self.output.lost == 0
            and self.output.twice == 0
        )


def victims_of(count: int, share: float, least: int) -> int:
    """How many of ``count`` to kill: ``share`` of them, rounded, at least ``least``."""
    return min(count, max(least, round(count * share)))


def worker_command(args: argparse.Namespace, corpus: Path, out: Path, urls: list[str]) -> list[str]:
    extra = [part for given in args.worker_arg for part in shlex.split(given)]
    return [
        sys.executable, "-m", "llm_annotator.cli", "run",
        "--input", str(corpus), "--output-dir", str(out),
        "--shard", "claim", "--processes", "1",
        "--servers", *urls,
        "--model", SERVED_MODEL,
        "--prompt-template", TEMPLATE, "--id-column", "id",
        "--max-completion-tokens", "16",
        "--batch-size", str(args.batch_size),
        "--max-concurrent-batches-per-client", str(args.batches),
        *extra,
    ]  # fmt: skip


def run_case(
    args: argparse.Namespace,
    servers: int,
    latency: float,
    workers: int,
    faults: bool,
    corpus: Path,
    scratch: Path,
    env: dict[str, str],
) -> Run:
    """Start the fleet, then N workers ``--stagger`` seconds apart; wait for them all."""
    model = ServerModel("sim", latency, args.capacity, args.alpha)
    run = Run(
        servers,
        workers,
        faults,
        capacity=model.throughput * servers,
        budget=args.batch_size * args.batches,
        input_rows=args.rows,
        bound=math.ceil(args.rows / (servers * model.capacity))
        * model.base_latency
        * (1 + model.alpha),
    )
    name = f"s{servers}-n{workers}-{run.case.replace(' ', '')}"
    logs = scratch / f"logs-{name}"
    logs.mkdir()
    out = scratch / f"out-{name}"
    server_victims = victims_of(servers, args.kill_servers, 1)
    worker_victims = 0 if workers == 1 else victims_of(workers, args.kill_workers, 1)
    fleet = Fleet(servers, server_victims, args.per_process, model, logs)
    command = worker_command(args, corpus, out, fleet.urls)
    pool: list[Worker] = []
    rng = random.Random(workers)
    try:
        kill_at = args.kill_at * args.rows if faults else None
        busy0, self0 = harness.busy_seconds(), harness.cpu_seconds()
        first = time.monotonic()
        deadline = first + args.timeout
        next_read = first
        while True:
            now = time.monotonic()
            if len(pool) < workers and now >= first + len(pool) * args.stagger:
                pool.append(Worker(len(pool), command, env, logs))
                continue
            done = [w.poll() for w in pool]
            if len(pool) == workers and all(done):
                break
            if now >= deadline:
                run.status = "timeout"
                break
            if kill_at is not None and now >= next_read:
                next_read = now + STATS_EVERY
                answered = fleet.answered()
                if answered >= kill_at:
                    kill_at = None
                    run.kill_note = kill(fleet, pool, worker_victims, rng, first, answered)
            time.sleep(POLL)
        alive = [w for w in pool if not w.killed]
        if run.status == "ok" and alive:
            ends = [w.ended for w in alive if w.ended is not None]
            run.wall = max(ends) - first
        run.starts = pool[-1].started - first if pool else 0.0
    finally:
        for worker in pool:
            worker.kill(deliberately=False)
        stats = fleet.read()
        fleet.stop()
        (logs / "servers.json").write_text(json.dumps({"first": first, "servers": stats}))
        finishes = [float(s["last_finish"]) for s in stats if s.get("last_finish")]
        run.last_answer = max(finishes) - first if finishes else None
    busy1 = harness.busy_seconds()
    run.worker_cpu = sum(w.cpu for w in pool)
    run.server_cpu = fleet.cpu()
    ours = run.worker_cpu + run.server_cpu + harness.cpu_seconds() - self0
    run.other = harness.machine_other_load(busy0, busy1, ours, run.wall or args.timeout)
    run.peaks = [int(s["max_held"]) for s in stats]
    run.received = sum(int(s["received"]) for s in stats)
    run.answered = sum(int(s["completed"]) for s in stats)
    run.aborted = sum(int(s["aborted"]) for s in stats)
    run.overshoot = max(
        (float(s["overshoot"]) / max(1, int(s["completed"])) for s in stats), default=0.0
    )
    run.output = read_output(out, args.rows)
    run.rows = run.output.unique
    run.failures = [f for f in (w.failure() for w in pool) if f]
    run.parts = [w.part() for w in pool]
    if run.status == "ok" and (run.output.lost or not run.output.complete):
        run.status = "incomplete"
    shutil.rmtree(out, ignore_errors=True)
    return run


def kill(
    fleet: Fleet, pool: list[Worker], victims: int, rng: random.Random, first: float, answered: int
) -> str:
    """SIGKILL the fleet's victim servers and ``victims`` running workers; say what."""
    fleet.kill_victims()
    running = [w for w in pool if w.running]
    chosen = sorted(rng.sample(running, min(victims, len(running))), key=lambda w: w.index)
    for worker in chosen:
        worker.kill(deliberately=True)
    at = time.monotonic() - first
    names = ", ".join(str(w.index) for w in chosen) or "none"
    return (
        f"at {at:.1f} s ({answered:,} rows answered): {fleet.victims} of "
        f"{len(fleet.urls)} servers (their process SIGKILLed), workers {names} of "
        f"{len(pool)} started (process groups SIGKILLed)"
    )


# --------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------


def _n(value: float) -> str:
    return f"{value:,.0f}"


def print_rates(runs: Sequence[Run]) -> None:
    header = ["servers", "workers", "case", "status", "wall s", "starts s", "rows/s",
              "capacity", "x capacity", "last answer s", "bound s", "x bound",
              "worker CPU s", "cores busy", "server CPU s", "other %"]  # fmt: skip
    table = []
    for r in runs:
        rate = r.rate
        last = r.last_answer if r.status == "ok" else None
        table.append([
            str(r.servers), str(r.workers), r.case, r.status,
            f"{r.wall:.1f}" if r.wall else "-", f"{r.starts:.0f}",
            "-" if rate is None else _n(rate), _n(r.capacity),
            "-" if rate is None else f"{rate / r.capacity:.2f}",
            "-" if last is None else f"{last:.1f}", f"{r.bound:.1f}",
            "-" if not last else f"{r.bound / last:.2f}",
            f"{r.worker_cpu:.1f}",
            f"{r.worker_cpu / r.wall:.2f}" if r.wall else "-",
            f"{r.server_cpu:.1f}", harness.percent(r.other),
        ])  # fmt: skip
    harness.print_table(header, table)


def print_held(runs: Sequence[Run]) -> None:
    header = ["servers", "workers", "case", "peak held min", "median", "max", "budget",
              "max/budget", "N x budget", "got - rows", "answered - rows", "dropped",
              "out rows", "out twice", "lost", "error rows"]  # fmt: skip
    table = []
    for r in runs:
        peaks = r.peaks or [0]
        table.append([
            str(r.servers), str(r.workers), r.case,
            _n(min(peaks)), _n(statistics.median(peaks)), _n(max(peaks)), _n(r.budget),
            f"{max(peaks) / r.budget:.2f}", _n(r.workers * r.budget),
            _n(r.received - r.input_rows), _n(r.answered - r.input_rows), _n(r.aborted),
            _n(r.output.rows), _n(r.output.twice), _n(r.output.lost), _n(r.output.errors),
        ])  # fmt: skip
    harness.print_table(header, table)


def print_notes(runs: Sequence[Run]) -> None:
    for r in runs:
        lines = []
        if len(r.peaks) <= 32 and r.peaks:
            lines.append("peak held by server: " + " ".join(map(str, r.peaks)))
        if 1 < len(r.parts) <= 32:
            lines.append("rows sent by each worker: " + " ".join(r.parts))
        if r.kill_note:
            lines.append("killed " + r.kill_note)
        elif r.faults:
            lines.append("nothing killed: the run ended before the kill point")
        if r.overshoot > 0.05:
            lines.append(
                f"the servers ran late: up to {r.overshoot * 1000:.0f} ms a request over the "
                "model (a busy CPU), so the capacity was lower than shown"
            )
        if r.output.error_types:
            kinds = ", ".join(f"{kind} {n:,}" for kind, n in r.output.error_types.most_common())
            lines.append(f"error rows by type: {kinds}")
        if not r.output.complete:
            lines.append("the manifest does not say the run is complete")
        lines += r.failures
        if lines:
            print(f"* {r.servers} servers, {r.workers} workers, {r.case}:")
            for line in lines:
                print(f"    {line}")


def verdict(runs: Sequence[Run]) -> int:
    bad = [r for r in runs if not r.clean]
    over = [r for r in runs if r.peaks and max(r.peaks) > r.budget]
    print()
    if over:
        print(
            f"peak held over the budget in {len(over)} of {len(runs)} runs "
            f"(up to {max(max(r.peaks) / r.budget for r in over):.2f}x)"
        )
    else:
        print("peak held within the budget in every run")
    if bad:
        print(
            f"FAILED: {len(bad)} run(s) lost rows, wrote rows twice, timed out or had a worker fail"
        )
        return 1
    print("every run wrote every row once")
    return 0


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def library(rev: str | None) -> Iterator[tuple[dict[str, str], str]]:
    """The workers' environment: this tree's library, or a worktree of ``rev``'s."""
    if rev is None:
        yield dict(os.environ), harness.versions("llm-annotator")
        return
    short = _against.short(rev)
    with _against.worktree(short) as tree:
        yield _against.environment(tree), f"llm-annotator at {short}"


def latencies(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[float]:
    """One latency per ``--servers`` value."""
    if args.latency is None:
        return [args.base_latency * s / REFERENCE_SERVERS for s in args.servers]
    try:
        given = [float(x) for x in args.latency.split(",") if x.strip()]
    except ValueError:
        parser.error("--latency takes comma-separated seconds")
    if len(given) == 1:
        return given * len(args.servers)
    if len(given) != len(args.servers):
        parser.error("--latency: one value, or one per --servers value")
    return given


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,4,8,32", help="N: workers of each run")
    parser.add_argument("--servers", default="16,256", help="S: simulated servers")
    parser.add_argument("--rows", type=int, default=20_000, help="rows in the corpus")
    parser.add_argument("--files", type=int, default=40, help="JSONL files in the corpus")
    parser.add_argument(
        "--latency",
        help="seconds a request takes, one value or one per --servers value (default: "
        f"0.64 x servers / {REFERENCE_SERVERS}, the same capacity for every fleet)",
    )
    parser.add_argument("--base-latency", type=float, default=0.64, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=16, help="requests a server runs at once")
    parser.add_argument(
        "--alpha", type=float, default=0.0, help="slow-down of a full server (see _sim_server)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="the workers' --batch-size")
    parser.add_argument(
        "--batches", type=int, default=4, help="the workers' --max-concurrent-batches-per-client"
    )
    parser.add_argument("--stagger", type=float, default=1.0, help="seconds between starts")
    parser.add_argument(
        "--kill", action=argparse.BooleanOptionalAction, default=True, help="also runs with faults"
    )
    parser.add_argument("--kill-at", type=float, default=0.3, help="share of rows answered")
    parser.add_argument("--kill-servers", type=float, default=0.1, help="share of servers killed")
    parser.add_argument("--kill-workers", type=float, default=0.1, help="share of workers killed")
    parser.add_argument("--per-process", type=int, default=64, help="servers a process serves")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take")
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="more arguments for every worker, split as a shell would "
        "(--worker-arg=--adaptive, --worker-arg='--claim-lease 10'); repeatable",
    )
    parser.add_argument("--at", metavar="REV", help="run the workers on this commit's library")
    parser.add_argument(
        "--keep", action="store_true", help="keep the scratch folder (logs) and say where"
    )
    parser.add_argument("--quick", action="store_true", help="N = 1,4 over 16 servers, 4,000 rows")
    args = parser.parse_args()
    if args.quick:  # its sizes, where no other was given
        quick = {"workers": "1,4", "servers": "16", "rows": 4000, "files": 8}
        for name, value in quick.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.workers = harness.integers(parser, "--workers", args.workers)
    args.servers = harness.integers(parser, "--servers", args.servers)
    if not args.workers or not args.servers or min(args.workers + args.servers) < 1:
        parser.error("--workers and --servers take positive integers")
    if args.rows < args.files or args.files < 1:
        parser.error("--rows must be at least --files, and --files at least 1")
    per_server = latencies(parser, args)
    harness.exit_on_sigterm()
    raise_nofile_limit()
    began = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    runs: list[Run] = []
    try:
        with library(args.at) as (env, label):
            corpus = build_corpus(scratch / "corpus", args.rows, args.files)
            budget = args.batch_size * args.batches
            print(
                f"fleet: {args.rows:,} rows in {args.files} JSONL files; workers {args.workers} "
                f"started {args.stagger:g} s apart, each --shard claim --processes 1 with a "
                f"budget of {args.batch_size} x {args.batches} = {budget} a server; "
                f"{harness.cpu_count()} cores, nothing pinned; {label}, "
                f"{harness.versions('python')}"
            )
            extra = " ".join(args.worker_arg)
            if extra:
                print(f"  worker flags added: {extra}")
            for servers, latency in zip(args.servers, per_server, strict=True):
                model = ServerModel("sim", latency, args.capacity, args.alpha)
                print(
                    f"  {servers} servers: {args.capacity} requests at once, {latency:g} s "
                    f"each, the rest in line: {model.throughput * servers:,.0f} rows/s in all; "
                    f"up to {args.per_process} a process"
                )
            if args.kill:
                print(
                    f"  faults at {args.kill_at:.0%} of rows answered: {args.kill_servers:.0%} "
                    f"of servers (a process of their own, SIGKILLed) and {args.kill_workers:.0%} "
                    "of workers (at least 1 from N = 4; process groups SIGKILLed); the workers "
                    "share this machine, so a dead worker's claims are taken over at once"
                )
            print()
            for servers, latency in zip(args.servers, per_server, strict=True):
                for workers in args.workers:
                    for faults in (False, True) if args.kill else (False,):
                        run = run_case(
                            args, servers, latency, workers, faults, corpus, scratch, env
                        )
                        runs.append(run)
                        rate = "-" if run.rate is None else f"{run.rate:,.0f} rows/s"
                        print(
                            f"  {servers} servers, {workers} workers, {run.case}: {run.status}, "
                            f"{run.wall:.1f} s, {rate}, peak held {max(run.peaks or [0])}, "
                            f"lost {run.output.lost}, twice {run.output.twice}",
                            flush=True,
                        )
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"\nscratch folder kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    if not runs:
        return 1
    print(
        "\nRows a second against the fleet's capacity (wall: first start to last exit); "
        "the servers' last answer against the least a run could take (bound: every slot "
        "busy from the start, a whole request's latency a round)\n"
    )
    print_rates(runs)
    print("\nWhat each server held (running + waiting) against the budget; rows twice and lost\n")
    print_held(runs)
    print()
    print_notes(runs)
    code = verdict(runs)
    print(f"\nwall time of the benchmark: {time.monotonic() - began:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
