"""How close the pool comes to the servers' capacity, and what a killed server costs.

Starts four simulated continuous-batching vLLM servers (``_sim_server.py``), each in its
own process, with different speeds and capacities, and drives
``VLLMQueueAnnotator.batch_generate`` over them from this process.

Pool efficiency: for each batch size, the makespan (the ``batch_generate`` call, start-up
probes included) against the work-conserving lower bound, ``N`` divided by the servers'
summed throughput at full load, taken from the simulation's parameters; the tail, from
99% to 100% of the samples done (the pool's ``statistics().completed``, polled every
50 ms); and what each server did (answers, busy and saturated seconds, idle time at the
end).

Each run is made with two dispatches, side by side: ``window`` (this version's
default: a batch slot keeps its batch full as answers arrive; a server's window, what
it may hold, starts at 64 and grows by one with each answer up to ``batch_size x
batches``; once the input is read each server holds its part of what is left by its
pace; the tail hedges the last sent first and the first answer cancels the other
copy) and ``adaptive`` (the same with ``adaptive=True``: each server's window follows
its ``/metrics`` so that it queues little). ``--dispatch`` picks some. ``--against
REV`` adds ``window@REV``: the default dispatch of an older commit (for instance one
of the dispatches before this one), run from a git worktree of it in a worker process
against the same servers, in the efficiency table.

Fault cost: the same run again, with one server SIGKILLed once 30% of the samples are
done; the extra wall time over the run without the fault, against the extra that the
lost capacity explains (the lower bound with that server's throughput gone from the
kill onwards). The pool keeps its default health settings.

Run it as::

    python benchmarks/pool_efficiency.py            # full run, about two minutes
    python benchmarks/pool_efficiency.py --quick    # smoke run, about 20 seconds
    python benchmarks/pool_efficiency.py --against 85f15d7   # beside an older commit

Targets: makespan within 2% of the lower bound; a killed server costs no more than its
lost capacity explains plus 0.5 s. The exit code is 0 whether or not they are met, and
non-zero only when the harness fails (a server does not start, a run raises).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _against
import _harness as harness
from _nginx import MODEL, raise_nofile_limit
from _sim_server import ServerModel, ServerStats, SimServer
from llm_annotator import VLLMQueueAnnotator

POLL = 0.05
"""Seconds between two reads of the pool's completed count."""
TARGET_RATIO = 1.02
TARGET_FAULT_SLACK = 0.5
DISPATCHES = ("adaptive", "window", "stream", "affinity")
"""This version's dispatch with ``adaptive=True``, and the same with its default
``adaptive=False``; by default the runs use these two. ``stream`` sends the same
conversations through ``astream`` (the input read as the call goes, as a job does), and
``affinity`` the same with ``prefix_affinity=True`` and the samples in groups of
:data:`GROUP_SIZE` (the simulated servers cache nothing: this shows only what the
grouping costs the makespan)."""
DEFAULT_DISPATCHES = ("adaptive", "window")
GROUP_SIZE = 40
"""Samples of one group in the ``affinity`` dispatch (spread over the input)."""
RESULT = "RESULT "
"""The marker of a worker's result line."""
DEFAULT_SERVERS = "A:20:32,B:40:32,C:60:24,D:80:16"
"""name:base latency ms:capacity of each simulated server."""


@dataclass
class RunResult:
    """What one ``batch_generate`` call did.

    Attributes:
        batch_size: The pool's batch size.
        dispatch: ``window`` or ``adaptive`` (see :data:`DISPATCHES`), or
            ``window@REV`` for an older commit's.
        samples: Conversations sent.
        makespan: Seconds the call took.
        first: Seconds to the first completed sample (start-up probes included).
        t99: Seconds to 99% of the samples completed (polled).
        drained: Seconds to the last time the queue was seen empty, after which the
            servers only finish what they hold (polled).
        ok: Responses without an error.
        completed: Answers per server, as the pool counted them.
        requeued: Samples the pool took back from each server.
        server_stats: What each server measured; None for a killed one.
        client_cpu: Seconds of CPU this process spent during the call.
        other_load: Share of the machine's CPUs that other processes took during the
            call (None where unknown); a high figure means a noisy run.
        killed: The killed server's name, or None.
        kill_time: Seconds into the call the server was killed.
        done_at_kill: Samples completed when it was killed.
        evicted_after: Seconds from the kill to the pool's eviction of the server.
        errors: Error kinds of the error Responses, counted.
        end: ``time.monotonic()`` when the call returned.
    """

    batch_size: int
    samples: int
    dispatch: str = "adaptive"
    makespan: float = 0.0
    first: float = math.nan
    t99: float = math.nan
    drained: float = math.nan
    ok: int = 0
    completed: dict[str, int] = field(default_factory=dict)
    requeued: dict[str, int] = field(default_factory=dict)
    server_stats: dict[str, ServerStats | None] = field(default_factory=dict)
    client_cpu: float = 0.0
    other_load: float | None = None
    killed: str | None = None
    kill_time: float = math.nan
    done_at_kill: int = 0
    evicted_after: float = math.nan
    errors: dict[str, int] = field(default_factory=dict)
    end: float = 0.0

    @property
    def label(self) -> str:
        """Batch size and dispatch, for tables."""
        return f"{self.batch_size} {self.dispatch}"

    @property
    def tail(self) -> float:
        """Seconds from 99% done to 100% done."""
        return self.makespan - self.t99

    @property
    def drain(self) -> float:
        """Seconds from the queue's last emptying to the end of the call."""
        return self.makespan - self.drained


def lower_bound(models: Sequence[ServerModel], samples: int) -> float:
    """Seconds the servers need at full load, with the work split in the best way."""
    return samples / sum(m.throughput for m in models)


def fault_lower_bound(
    models: Sequence[ServerModel], killed: ServerModel, samples: int, kill_time: float
) -> float:
    """The lower bound when ``killed`` stops contributing ``kill_time`` seconds in."""
    total = sum(m.throughput for m in models)
    if samples <= total * kill_time:
        return samples / total
    return kill_time + (samples - total * kill_time) / (total - killed.throughput)


def run_once(
    servers: Sequence[SimServer],
    batch_size: int,
    samples: int,
    batches_per_server: int,
    events: harness.EventLog,
    kill: SimServer | None = None,
    kill_at: float = 0.3,
    mode: str = "adaptive",
) -> RunResult:
    """One ``batch_generate`` call over ``servers`` with dispatch ``mode``, polled from
    this thread.

    Raises:
        RuntimeError: If the call raises.
    """
    for server in servers:
        server.reset()
    names = {server.base_url: server.model.name for server in servers}
    result = RunResult(batch_size=batch_size, samples=samples, dispatch=mode)
    pool = VLLMQueueAnnotator(
        [server.base_url for server in servers],
        model=MODEL,
        batch_size=batch_size,
        max_concurrent_batches_per_client=batches_per_server,
        adaptive=mode == "adaptive",
        prefix_affinity=mode == "affinity",
    )
    messages = harness.sample_conversations(samples)
    groups = max(1, samples // GROUP_SIZE)

    async def through_stream() -> list[Any]:
        responses: list[Any] = [None] * samples
        try:
            async for index, response in pool.astream(
                enumerate(messages), group=lambda index: index % groups
            ):
                responses[index] = response
        finally:
            await pool.aclose()  # its connections belong to this thread's loop
        return responses

    outcome: dict[str, Any] = {}
    started = threading.Event()

    def call() -> None:
        outcome["start"] = time.monotonic()
        started.set()
        try:
            if mode in ("stream", "affinity"):
                outcome["responses"] = asyncio.run(through_stream())
            else:
                outcome["responses"] = pool.batch_generate(messages=messages)
        except BaseException as exc:  # shown by the main thread
            outcome["error"] = exc
        outcome["end"] = time.monotonic()

    worker = threading.Thread(target=call, name="pool-call")
    cpu0 = harness.cpu_seconds()
    machine0 = harness.busy_seconds()
    servers_cpu = -sum(server.cpu_seconds() for server in servers)
    worker.start()
    started.wait()
    start = outcome["start"]
    goal99 = math.ceil(0.99 * samples)
    while worker.is_alive():
        worker.join(POLL)
        stats = pool.statistics()
        done = stats.completed
        now = time.monotonic() - start
        if stats.queued:
            result.drained = math.nan
        elif math.isnan(result.drained):
            result.drained = now
        if done and math.isnan(result.first):
            result.first = now
        if done >= goal99 and math.isnan(result.t99):
            result.t99 = now
        if kill is not None and result.killed is None and done >= kill_at * samples:
            servers_cpu += kill.cpu_seconds()
            kill.kill()
            result.killed, result.kill_time, result.done_at_kill = kill.model.name, now, done
    wall = time.monotonic() - start
    result.client_cpu = harness.cpu_seconds() - cpu0
    servers_cpu += sum(server.cpu_seconds() for server in servers)
    machine1 = harness.busy_seconds()
    result.other_load = harness.machine_other_load(
        machine0, machine1, result.client_cpu + servers_cpu, wall
    )
    if "error" in outcome:
        pool.close()
        raise RuntimeError(f"batch_generate raised: {outcome['error']!r}") from outcome["error"]
    result.end = outcome["end"]
    result.makespan = outcome["end"] - start
    if math.isnan(result.t99):
        result.t99 = result.makespan
    if math.isnan(result.drained):
        result.drained = result.makespan
    responses = outcome["responses"]
    result.ok = sum(r.ok for r in responses)
    for r in responses:
        if not r.ok:
            result.errors[r.error_type or "?"] = result.errors.get(r.error_type or "?", 0) + 1
    for member in pool.statistics().members:
        result.completed[names[member.server]] = member.completed
        result.requeued[names[member.server]] = member.requeued
    pool.close()
    for server in servers:
        result.server_stats[server.model.name] = server.stats() if server.alive else None
    if result.killed is not None:
        evicted = events.first(("member_evicted",), start + result.kill_time)
        if evicted is not None:
            result.evicted_after = evicted - start - result.kill_time
    return result


# --------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------


def _counts(result: RunResult, models: Sequence[ServerModel]) -> str:
    return "/".join(f"{result.completed.get(m.name, 0):,}" for m in models)


def lagged_bound(result: RunResult, models: Sequence[ServerModel]) -> float:
    """The lower bound with each server's measured mean lag added to its service time.

    The simulated servers sleep a little longer than planned (timer granularity, a busy
    CPU); this bound takes that out of the comparison, leaving what the pool lost.
    """
    total = 0.0
    for m in models:
        stats = result.server_stats.get(m.name)
        lag = stats.overshoot / stats.completed if stats is not None and stats.completed else 0.0
        total += m.capacity / (m.base_latency * (1 + m.alpha) + lag)
    return result.samples / total


def print_efficiency(results: Sequence[RunResult], models: Sequence[ServerModel]) -> None:
    """The pool-efficiency table, then what each server did in each run."""
    names = "/".join(m.name for m in models)
    rows = []
    for r in results:
        bound = lower_bound(models, r.samples)
        lagged = lagged_bound(r, models)
        ratio = r.makespan / bound
        rows.append(
            (
                r.label,
                f"{r.samples:,}",
                f"{r.makespan:.2f}",
                f"{bound:.2f}",
                f"{ratio:.3f}",
                f"{lagged:.2f}",
                f"{r.makespan / lagged:.3f}",
                f"{r.first:.2f}",
                f"{r.tail:.2f}",
                f"{r.drain:.2f}",
                _counts(r, models),
                harness.percent(r.client_cpu / r.makespan),
                harness.percent(r.other_load),
                "PASS" if ratio <= TARGET_RATIO and r.ok == r.samples else "MISS",
            )
        )
    header = ["batch", "N", "makespan s", "bound s", "ratio", "bound+lag s", "ratio+lag"]
    header += ["first s", "tail 99->100% s", "drain s", f"completed {names}"]
    header += ["client CPU %", "other CPU %", f"ratio <= {TARGET_RATIO:.2f}"]
    harness.print_table(header, rows, first_left=False)
    ideal = "/".join(f"{m.throughput / sum(x.throughput for x in models):.1%}" for m in models)
    print(f"ideal split of the work {names}: {ideal}")
    print(
        "bound+lag: the bound with the servers' measured lag added to their service time; "
        "first: first answer;\ndrain: from the queue's last emptying to the end; other CPU: "
        "share of all CPUs used by other processes"
    )
    _error_note(results)
    _noise_note(results)
    print()
    print("per server: busy = >= 1 request in service, full = every slot in service,")
    print("idle at end = from its last answer to the end of the call, lag = mean overrun")
    print("of a request's service time (a CPU-starved server runs behind its model),")
    print("aborted = requests it dropped because the client cancelled them (hedged copies)")
    detail = []
    for r in results:
        for m in models:
            detail.append(_server_row(r, m))
    harness.print_table(
        (
            "batch",
            "server",
            "completed",
            "share",
            "busy s",
            "full s",
            "idle at end s",
            "lag ms",
            "aborted",
        ),
        detail,
        first_left=False,
    )


def _server_row(r: RunResult, m: ServerModel) -> tuple[str, ...]:
    stats = r.server_stats.get(m.name)
    done = r.completed.get(m.name, 0)
    share = f"{done / r.samples:.1%}"
    if stats is None:
        return (r.label, m.name, f"{done:,}", share, "killed", "-", "-", "-", "-")
    idle = r.end - stats.last_finish if stats.last_finish is not None else r.makespan
    lag = 1000 * stats.overshoot / stats.completed if stats.completed else 0.0
    return (
        r.label,
        m.name,
        f"{done:,}",
        share,
        f"{stats.busy:.2f}",
        f"{stats.full:.2f}",
        f"{idle:.2f}",
        f"{lag:.2f}",
        f"{stats.aborted:,}",
    )


def _error_note(results: Sequence[RunResult]) -> None:
    for r in results:
        if r.errors:
            kinds = ", ".join(f"{count:,} {kind}" for kind, count in sorted(r.errors.items()))
            print(f"batch {r.label}: {r.samples - r.ok:,} error rows ({kinds})")


def _noise_note(results: Sequence[RunResult]) -> None:
    noisy = [r for r in results if (r.other_load or 0.0) > harness.MACHINE_NOISY]
    if noisy:
        print(
            f"noisy: other processes took more than {harness.MACHINE_NOISY:.0%} of the CPUs during "
            f"{len(noisy)} run(s); their makespans are long. Rerun on an idle machine, or "
            "with --attempts."
        )


def print_faults(
    pairs: Sequence[tuple[RunResult, RunResult]], models: Sequence[ServerModel]
) -> None:
    """The fault-cost table: each faulty run beside the run without the fault."""
    rows = []
    for clean, faulty in pairs:
        killed = next(m for m in models if m.name == faulty.killed)
        bound = lower_bound(models, clean.samples)
        fault_bound = fault_lower_bound(models, killed, faulty.samples, faulty.kill_time)
        extra = faulty.makespan - clean.makespan
        explained = fault_bound - bound
        ok = faulty.ok == faulty.samples
        verdict = "PASS" if ok and extra <= explained + TARGET_FAULT_SLACK else "MISS"
        rows.append(
            (
                faulty.label,
                f"{faulty.samples:,}",
                f"{faulty.killed} at {faulty.kill_time:.2f} ({faulty.done_at_kill:,})",
                f"{faulty.evicted_after:.2f}",
                f"{faulty.requeued.get(killed.name, 0):,}",
                f"{clean.makespan:.2f}",
                f"{faulty.makespan:.2f}",
                f"{fault_bound:.2f}",
                f"{faulty.makespan / fault_bound:.3f}",
                f"{extra:.2f}",
                f"{explained:.2f}",
                f"{faulty.tail:.2f}",
                f"{faulty.drain:.2f}",
                _counts(faulty, models),
                f"{harness.percent(clean.other_load)}/{harness.percent(faulty.other_load)}",
                verdict if ok else f"MISS ({faulty.samples - faulty.ok} error rows)",
            )
        )
    names = "/".join(m.name for m in models)
    header = ["batch", "N", "killed at s (done)", "evicted +s", "requeued", "no fault s"]
    header += ["fault s", "fault bound s", "ratio", "extra s", "explained s", "tail s"]
    header += ["drain s", f"completed {names}", "other CPU %"]
    header += [f"extra <= expl.+{TARGET_FAULT_SLACK:.0f}"]
    harness.print_table(header, rows, first_left=False)
    print(
        "evicted +s: from the kill to the eviction; requeued: samples taken back from the "
        "killed server;\nexplained: fault bound - bound without the fault; other CPU %: "
        "no-fault run / fault run"
    )
    _error_note([faulty for _, faulty in pairs])
    _noise_note([r for pair in pairs for r in pair])


# --------------------------------------------------------------------------------------
# Set-up and main
# --------------------------------------------------------------------------------------


def parse_servers(text: str, alpha: float) -> list[ServerModel]:
    """``name:base_ms:capacity,...`` into server models."""
    models = []
    for part in text.split(","):
        name, base_ms, capacity = part.split(":")
        models.append(ServerModel(name, float(base_ms) / 1000, int(capacity), alpha))
    if len({m.name for m in models}) != len(models):
        raise ValueError("server names must differ")
    return models


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_number(parser, "--samples", 20_000, "N per run (20,000)")
    parser.add_argument(
        "--batch-sizes", default="32,128,256", help="pool batch sizes to try (32,128,256)"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: N=4,000, batch 32,128")
    parser.add_argument(
        "--servers",
        default=DEFAULT_SERVERS,
        help=f"name:base latency ms:capacity of each server ({DEFAULT_SERVERS})",
    )
    harness.add_number(parser, "--alpha", 0.5, "slow-down of a full server (0.5)")
    harness.add_number(parser, "--batches-per-server", 4, "max_concurrent_batches_per_client (4)")
    parser.add_argument("--kill", default="A", help="the server to kill in the fault runs (A)")
    harness.add_number(parser, "--kill-at", 0.3, "share of samples done at the kill (0.3)")
    parser.add_argument("--no-fault", action="store_true", help="skip the fault runs")
    parser.add_argument(
        "--dispatch",
        default=",".join(DEFAULT_DISPATCHES),
        help="dispatches to compare: adaptive (adaptive=True), window (the default), "
        "stream (the default through astream), affinity (astream with "
        f"prefix_affinity=True, groups of {GROUP_SIZE}) ({','.join(DEFAULT_DISPATCHES)})",
    )
    _against.add_against(parser, "the default dispatch (in the efficiency table)")
    parser.add_argument(
        "--against-dispatch",
        default="window",
        choices=sorted(DISPATCHES),
        help="the dispatch --against runs on the older commit (window)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    harness.add_number(
        parser,
        "--attempts",
        1,
        f"measure a run up to this many times while other processes take more than "
        f"{100 * harness.MACHINE_NOISY:.0f}%% of the CPUs, keeping the quietest (1)",
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="do not pin the client and servers to CPUs"
    )
    harness.add_wait_idle(parser, "run", "0: do not wait")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples = 4_000
        args.batch_sizes = "32,128"
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.dispatch = [d for d in args.dispatch.split(",") if d]
    if not args.dispatch or set(args.dispatch) - set(DISPATCHES):
        parser.error(f"--dispatch takes a comma-separated list of {', '.join(DISPATCHES)}")
    args.models = parse_servers(args.servers, args.alpha)
    if args.kill not in {m.name for m in args.models}:
        parser.error(f"--kill names no server of --servers: {args.kill}")
    if args.samples < 100 or not args.batch_sizes or not 0 < args.kill_at < 1:
        parser.error("need --samples >= 100, a batch size, and 0 < --kill-at < 1")
    return args


@dataclass
class WorkerSpec:
    """A run of one dispatch for a worker on an older commit's library.

    Attributes:
        servers: Each running server as (name, base latency, capacity, alpha, port, pid).
        batch_size: The pool's batch size.
        samples: Conversations sent.
        batches_per_server: ``max_concurrent_batches_per_client``.
        mode: The dispatch (``window`` unless ``--against-dispatch`` says another).
    """

    servers: tuple[tuple[str, float, int, float, int, int], ...]
    batch_size: int
    samples: int
    batches_per_server: int
    mode: str = "window"


def run_against(
    tree: Path, label: str, servers: Sequence[SimServer], batch_size: int, args: argparse.Namespace
) -> RunResult:
    """One run of ``--against-dispatch`` (``window`` by default) of the library in
    ``tree`` (an older commit), in a worker process against the same ``servers``.

    Raises:
        RuntimeError: If the worker reports no result.
    """
    spec = WorkerSpec(
        tuple(
            (s.model.name, s.model.base_latency, s.model.capacity, s.model.alpha, s.port, s.pid)
            for s in servers
        ),
        batch_size,
        args.samples,
        args.batches_per_server,
        args.against_dispatch,
    )
    output = harness.run_worker(__file__, spec, RESULT, 600.0, _against.environment(tree))
    if output.data is None:
        status, note = output.failure(20)
        raise RuntimeError(f"the run on {label} failed ({status}): {note}")
    data = output.data
    data["server_stats"] = {
        name: ServerStats(**stats) if stats is not None else None
        for name, stats in data["server_stats"].items()
    }
    data["dispatch"] = f"{spec.mode}@{label}"
    return RunResult(**data)


def worker(text: str) -> int:
    """The worker's side of :func:`run_against`: the run, reported on one line."""
    spec = harness.read_spec(WorkerSpec, text)
    servers = [
        SimServer.attach(ServerModel(name, base, capacity, alpha), MODEL, port, pid)
        for name, base, capacity, alpha, port, pid in spec.servers
    ]
    events = harness.EventLog(echo=False)
    events.install()
    result = run_once(
        servers, spec.batch_size, spec.samples, spec.batches_per_server, events, mode=spec.mode
    )
    harness.report_result(RESULT, result)
    return 0


def quietest(args: argparse.Namespace, measure: Callable[[], RunResult]) -> RunResult:
    """Measure up to ``--attempts`` times while other processes load the machine; keep the
    run they disturbed least. With ``--wait-idle``, wait that long at most for the CPUs to
    go idle before each attempt."""
    again = (
        "  noisy ({noise:.0%} of the CPUs went to other processes); "
        "measuring again ({attempt} of {attempts})"
    )
    retry = harness.Retry(args.attempts, args.wait_idle, harness.MACHINE_NOISY, again)
    return harness.quietest(measure, lambda result: result.other_load or 0.0, retry, None)


def _pick_cpus(pin: bool) -> tuple[int | None, int | None]:
    """(client CPU, server CPU), or Nones when not pinning or only one CPU is usable."""
    client_cpu, server_cpu = harness.pick_cpus()
    if not pin or client_cpu == server_cpu:
        return None, None
    return client_cpu, server_cpu


def print_setup(args: argparse.Namespace, client_cpu: int | None, server_cpu: int | None) -> None:
    models: list[ServerModel] = args.models
    total = sum(m.throughput for m in models)
    print(
        f"{harness.versions('python')}, {os.cpu_count()} CPUs, "
        f"open-file limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}; "
        + (
            f"client pinned to CPU {client_cpu}, servers to CPU {server_cpu}"
            if client_cpu is not None
            else "nothing pinned"
        )
    )
    print(
        f"{len(models)} simulated servers, one process each; a request entering service "
        f"with k in service takes base * (1 + {args.alpha:g} * k / capacity)"
    )
    for m in models:
        print(
            f"  {m.name}: base {1000 * m.base_latency:.0f} ms, capacity {m.capacity}, "
            f"{1000 * m.base_latency * (1 + m.alpha):.0f} ms at full load, "
            f"{m.throughput:,.0f} req/s at full load"
        )
    print(
        f"  total {total:,.0f} req/s; pool: max_concurrent_batches_per_client="
        f"{args.batches_per_server}, default health settings; N={args.samples:,}"
    )
    print()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the process exit code."""
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    against = _against.short(args.against) if args.against else None
    with contextlib.ExitStack() as stack:
        tree = stack.enter_context(_against.worktree(against)) if against else None
        return _run(args, tree, against)


def _run(args: argparse.Namespace, tree: Path | None, against: str | None) -> int:
    """The benchmark: servers up, the runs, the tables (see the module's docstring)."""
    raise_nofile_limit()  # the servers inherit it
    client_cpu, server_cpu = _pick_cpus(not args.no_pin)
    if client_cpu is not None:
        os.sched_setaffinity(0, {client_cpu})  # before the pool's loop thread exists
    events = harness.EventLog(echo=False)
    events.install()
    models: list[ServerModel] = args.models
    servers = [SimServer(m, MODEL, server_cpu) for m in models]
    try:
        for server in servers:
            server.start()
        print_setup(args, client_cpu, server_cpu)
        run_once(servers, 64, 500, args.batches_per_server, events)  # warm-up, not shown
        clean: dict[tuple[int, str], RunResult] = {}
        for batch_size in args.batch_sizes:
            for mode in args.dispatch:
                print(f"running batch size {batch_size}, {mode} dispatch ...", flush=True)
                measure = partial(
                    run_once,
                    servers,
                    batch_size,
                    args.samples,
                    args.batches_per_server,
                    events,
                    mode=mode,
                )
                clean[batch_size, mode] = quietest(args, measure)
            if tree is not None and against is not None:
                mode = args.against_dispatch
                print(f"running batch size {batch_size}, {mode} dispatch of {against} ...")
                older = partial(run_against, tree, against, servers, batch_size, args)
                clean[batch_size, f"{mode}@{against}"] = quietest(args, older)
        print("\nPool efficiency (makespan against total work / total capacity)\n")
        print_efficiency(list(clean.values()), models)
        if args.no_fault:
            return 0
        victim = next(i for i, m in enumerate(models) if m.name == args.kill)

        def faulty_run(batch_size: int, mode: str) -> RunResult:
            result = run_once(
                servers,
                batch_size,
                args.samples,
                args.batches_per_server,
                events,
                kill=servers[victim],
                kill_at=args.kill_at,
                mode=mode,
            )
            servers[victim] = SimServer(models[victim], MODEL, server_cpu)
            servers[victim].start()
            return result

        pairs = []
        print()
        for batch_size in args.batch_sizes:
            for mode in args.dispatch:
                print(
                    f"running batch size {batch_size}, {mode} dispatch, killing {args.kill} ...",
                    flush=True,
                )
                faulty = quietest(args, partial(faulty_run, batch_size, mode))
                pairs.append((clean[batch_size, mode], faulty))
        print(
            f"\nFault cost ({args.kill} SIGKILLed at {args.kill_at:.0%} done; fault bound = "
            "the lower bound with its throughput gone from the kill on)\n"
        )
        print_faults(pairs, models)
    except (RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        for server in servers:
            tail = server.stderr_tail()
            if tail:
                print(f"server {server.model.name} stderr:\n{tail}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
