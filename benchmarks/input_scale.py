"""Whether an annotation job's memory stays flat as its input grows to a million rows.

Starts nginx answering every chat completion with a fixed body on four loopback ports,
pinned to one core, writes JSONL inputs of 10^5 and 10^6 rows, and runs
``VLLMQueueAnnotator.annotate`` (four members, the pool's default 256 rows a batch and 4
batches a member: 4,096 requests in flight) over each in its own fresh subprocess
pinned to the other core, with the same settings.

For each size it shows the wall time and rows per second, the peak RSS of the process
(``ru_maxrss``) and the peak RSS within each phase of the job (sampled from ``/proc``
every 20 ms; the phase is set by the job's log events), pyarrow's peak allocation, and
how long each phase took: the input scan (with the store's opening), the streaming of
rows through the pool, and the consolidation into ``annotations.parquet``.

Target: peak RSS under 1 GB at 10^6 rows, and flat: the 10^6-row peak at most 1.25
times the 10^5-row peak. With ``--trace`` each worker also runs tracemalloc and the
benchmark prints the Python allocations that grew most from the smaller job to the
larger one, at the end of streaming and at the end of consolidation (tracemalloc
slows the job several times and does not see pyarrow's buffers; its timings are not
comparable).

Run it as::

    python benchmarks/input_scale.py            # 10^5 and 10^6 rows, about eight minutes
    python benchmarks/input_scale.py --quick    # 10^4 and 10^5 rows, about a minute
    python benchmarks/input_scale.py --quick --trace    # what grows, by source line
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as harness
from _nginx import MODEL, CannedServer

RESULT_MARKER = "@@input-scale-result "
TARGET_PEAK_MB = 1024.0
TARGET_FLAT_RATIO = 1.25
SAMPLE_INTERVAL = 0.02
"""Seconds between two reads of the process's RSS."""
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class SizeSpec:
    """One job: its input, where it writes, and how it is measured."""

    rows: int
    input_path: str
    workdir: str
    base_urls: tuple[str, ...]
    cpu: int
    timeout: float
    trace: bool


@dataclass
class SizeResult:
    """What one job measured (see the module docstring)."""

    rows: int
    status: str = "ok"
    note: str = ""
    out_rows: int = 0
    succeeded: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    peak_rss_kb: int = 0
    rss_before_mb: float = 0.0
    peak_by_phase_mb: dict[str, float] = field(default_factory=dict)
    arrow_peak_mb: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    other_load: float | None = None
    snapshots: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Whether the job ran to its end with one answered row per input row."""
        return self.status == "ok" and self.out_rows == self.rows == self.succeeded


# --------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * _PAGE / 2**20


class RssSampler:
    """A thread that keeps the peak RSS seen in each phase of the job."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        """Start sampling."""
        self._thread.start()

    def stop(self) -> None:
        """Take a last sample and stop."""
        self._stop.set()
        self._thread.join()
        self._sample()

    def on_event(self, name: str) -> None:
        """Move to the phase a job event starts (called for every log event)."""
        self._sample()  # the phase that ends gets its last sample
        if name == "job_started":
            self.phase = "streaming"
        elif name in harness.STORE_CLOSED:
            self.phase = "consolidation"
        elif name in harness.CONSOLIDATED:
            self.phase = "finish"

    def _sample(self) -> None:
        rss = _rss_mb()
        if rss > self.peaks.get(self.phase, 0.0):
            self.peaks[self.phase] = rss

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL):
            self._sample()


def worker(spec: SizeSpec) -> None:
    """Run one job in this process and print its result line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llm_annotator import VLLMOnlineRuntimeOptions, VLLMQueueAnnotator

    harness.pin_worker(spec.cpu)
    result = SizeResult(rows=spec.rows)
    workdir = Path(spec.workdir)
    sampler = RssSampler()

    def on_event(name: str) -> None:
        sampler.on_event(name)
        if spec.trace and (name in harness.STORE_CLOSED or name in harness.CONSOLIDATED):
            key = "streamed" if name in harness.STORE_CLOSED else "consolidated"
            path = workdir / f"{key}.snapshot"
            tracemalloc.take_snapshot().dump(str(path))
            result.snapshots[key] = str(path)

    log = harness.EventLog(on_event)
    log.install()
    pool = VLLMQueueAnnotator(list(spec.base_urls), model=MODEL)
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=harness.MAX_TOKENS)
    try:
        if spec.trace:
            tracemalloc.start(8)
        result.rss_before_mb = _rss_mb()
        sampler.start()
        clock = harness.Clock(spec.cpu)
        start = clock.start()
        done = pool.annotate(
            spec.input_path,
            harness.TEMPLATE,
            workdir / "run",
            id_column="id",
            options=options,
            progress=False,
        )
        clock.stop()
        end = time.monotonic()
        sampler.stop()
        result.wall, result.cpu, result.other_load = clock.wall, clock.cpu_time, clock.other_load
        result.phases = harness.phase_times(log, start, end)
        result.peak_by_phase_mb = sampler.peaks
        result.arrow_peak_mb = pa.default_memory_pool().max_memory() / 2**20
        result.succeeded = done.num_succeeded
        result.out_rows = pq.read_metadata(done.output_path).num_rows
    except Exception as exc:
        result.status, result.note = "crashed", f"{type(exc).__name__}: {exc}"
    finally:
        pool.close()
    result.peak_rss_kb = harness.peak_rss_kb()
    harness.report_result(RESULT_MARKER, result)


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------


def run_size(
    args: argparse.Namespace, rows: int, server: CannedServer, cpus: tuple[int, int], folder: Path
) -> SizeResult:
    """Write an input of ``rows`` rows to ``folder`` and run its job; the job's result."""
    print(f"writing {rows:,} rows ...", flush=True)
    path = harness.write_input(folder / f"input-{rows}.jsonl", rows)
    if args.wait_idle > 0:
        harness.wait_for_idle(args.wait_idle, cpus)
    print(f"annotating {rows:,} rows ...", flush=True)
    spec = SizeSpec(
        rows=rows,
        input_path=str(path),
        workdir=str(folder / f"job-{rows}"),
        base_urls=tuple(server.base_urls),
        cpu=cpus[0],
        timeout=args.timeout,
        trace=args.trace,
    )
    result = _run_worker(spec)
    path.unlink()
    shutil.rmtree(Path(spec.workdir) / "run", ignore_errors=True)
    return result


def _run_worker(spec: SizeSpec) -> SizeResult:
    """Run one job in a fresh worker subprocess and read back its result."""
    Path(spec.workdir).mkdir(parents=True, exist_ok=True)
    done = harness.run_worker(__file__, spec, RESULT_MARKER, spec.timeout)
    if done.returncode is None:
        return SizeResult(rows=spec.rows, status="timeout", note=f"over {spec.timeout:.0f} s")
    if done.data is None:
        note = f"exit code {done.returncode}:\n{done.tail(15)}"
        return SizeResult(rows=spec.rows, status="crashed", note=note)
    result = SizeResult(**done.data)
    if done.stderr.strip():
        result.note = done.note_with_stderr(result.note, 12)
    return result


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def print_results(results: Sequence[SizeResult]) -> None:
    """The table of sizes, then notes."""
    header = ["rows", "ok", "wall s", "rows/s", "CPU us/row", "peak RSS MB"]
    header += [f"RSS {p} MB" for p in harness.PHASES[:3]] + ["arrow peak MB"]
    header += [f"{p} s" for p in ("scan+open", *harness.PHASES[1:3])] + ["other %"]
    rows = []
    for r in results:
        rows.append(
            (
                f"{r.rows:,}",
                f"{r.succeeded:,}" if r.passed else r.status.upper(),
                f"{r.wall:.1f}",
                f"{r.rows / r.wall:,.0f}" if r.passed and r.wall else "-",
                f"{r.cpu / r.rows * 1e6:,.0f}" if r.passed else "-",
                f"{r.peak_rss_kb / 1024:,.0f}",
                *(_mb(r.peak_by_phase_mb.get(p)) for p in harness.PHASES[:3]),
                f"{r.arrow_peak_mb:,.0f}",
                *(f"{r.phases[p]:.2f}" if p in r.phases else "-" for p in harness.PHASES[:3]),
                harness.percent(r.other_load),
            )
        )
    harness.print_table(header, rows)
    for r in results:
        if r.note:
            print(f"\n* {r.rows:,} rows: {r.status}")
            for note_line in r.note.splitlines():
                print(f"    {note_line}")


def print_verdict(small: SizeResult, large: SizeResult) -> None:
    """The target line: under 1 GB, and flat from the smaller job to the larger one."""
    print()
    if not (small.passed and large.passed):
        print("target: no figure, a job did not finish (MISS)")
        return
    peak_small, peak_large = small.peak_rss_kb / 1024, large.peak_rss_kb / 1024
    ratio = peak_large / peak_small
    slope = (peak_large - peak_small) * 2**20 / (large.rows - small.rows)
    under = peak_large < TARGET_PEAK_MB
    flat = ratio <= TARGET_FLAT_RATIO
    print(
        f"peak RSS {peak_small:,.0f} MB at {small.rows:,} rows, {peak_large:,.0f} MB at "
        f"{large.rows:,} rows: x{ratio:.2f}, {slope:,.0f} bytes per extra row"
    )
    for phase in harness.PHASES[:3]:
        a, b = small.peak_by_phase_mb.get(phase), large.peak_by_phase_mb.get(phase)
        if a is not None and b is not None:
            print(
                f"  {phase:<13} {a:7,.0f} MB -> {b:7,.0f} MB  "
                f"({(b - a) * 2**20 / (large.rows - small.rows):,.0f} bytes per extra row)"
            )
    print(
        f"under {TARGET_PEAK_MB:,.0f} MB: {'PASS' if under else 'MISS'}; "
        f"flat (x{TARGET_FLAT_RATIO} at most): {'PASS' if flat else 'MISS'}"
    )


def print_growth(small: SizeResult, large: SizeResult, top: int = 12) -> None:
    """The Python allocations that grew most from the smaller job to the larger one."""
    for key, title in (("streamed", "end of streaming"), ("consolidated", "end of consolidation")):
        if key not in small.snapshots or key not in large.snapshots:
            continue
        before = tracemalloc.Snapshot.load(small.snapshots[key])
        after = tracemalloc.Snapshot.load(large.snapshots[key])
        keep = [
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
        ]
        before, after = before.filter_traces(keep), after.filter_traces(keep)
        total = sum(s.size for s in after.statistics("filename"))
        print(
            f"\ntracemalloc, {title}: {total / 2**20:,.1f} MB traced at {large.rows:,} rows; "
            f"largest growth from {small.rows:,} rows, by line:"
        )
        for stat in after.compare_to(before, "lineno")[:top]:
            frame = stat.traceback[0]
            where = f"{_short(frame.filename)}:{frame.lineno}"
            print(
                f"  {stat.size_diff / 2**20:+9.1f} MB  {stat.size / 2**20:8.1f} MB  "
                f"{stat.count_diff:+10,} blocks  {where}"
            )


def _short(filename: str) -> str:
    for marker in ("site-packages/", "src/", "lib/python"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default="100000,1000000",
        help="comma-separated row counts, smallest first (default 100000,1000000)",
    )
    parser.add_argument("--quick", action="store_true", help="10^4 and 10^5 rows")
    parser.add_argument(
        "--trace",
        action="store_true",
        help="run tracemalloc in each job and print what grew most (slow)",
    )
    harness.add_number(parser, "--timeout", 1800.0, "seconds one job may take (default 1800)")
    harness.add_wait_idle(parser, "job", "default 0")
    harness.add_worker(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes = "10000,100000"
    args.sizes = sorted(harness.integers(parser, "--sizes", args.sizes))
    if len(args.sizes) < 2 or args.sizes[0] < 1:
        parser.error("--sizes needs at least two positive row counts")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the process exit code."""
    return harness.main_over_nginx(parse_args(argv), SizeSpec, worker, measure)


def measure(
    args: argparse.Namespace, server: CannedServer, client_cpu: int, server_cpu: int
) -> int:
    """Print the set-up, run one job per input size against ``server``, print the results."""
    print(
        f"{harness.versions('llm-annotator', 'pyarrow')}; "
        f"jobs pinned to CPU {client_cpu}, nginx to CPU {server_cpu}; pool: 4 members, "
        "batch_size 256, 4 batches each (4,096 in flight)"
        + ("; tracemalloc on" if args.trace else "")
    )
    harness.print_background([client_cpu, server_cpu], "job")
    cpus = (client_cpu, server_cpu)
    # The folder holds the inputs, and the --trace snapshots that print_growth reads.
    with harness.scratch_folder("input-scale-") as folder:
        results = [run_size(args, rows, server, cpus, folder) for rows in args.sizes]
        print()
        print_results(results)
        print_verdict(results[0], results[-1])
        if args.trace:
            print_growth(results[0], results[-1])
    return 1 if any(r.status == "crashed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
