"""Rows per second one CPU core drives through a whole annotation job.

Starts nginx answering every chat completion with a fixed body on four loopback ports,
pinned to one core, writes a JSONL input in a temporary folder, and measures each case
in a fresh subprocess pinned to the other core:

* ours: ``VLLMQueueAnnotator.annotate`` from the JSONL file to the consolidated
  ``annotations.parquet`` (and ``report.json``), one pool member per port,
  ``max_concurrent_batches_per_client=4`` and ``batch_size`` set so that 512 or 4,096
  requests are in flight in total; ``ours_bare`` is the same with the run timeline off,
  ``ours_metrics`` with live metrics served too (``--only`` picks cases);
* the OpenAI SDK's default ``AsyncOpenAI`` driven by ``asyncio.gather`` under a
  semaphore: read the JSONL, render the prompt, send, append each answer to a JSONL
  file. The honest minimal script with the same result (no resume, no consolidation);
* the same loop with the SDK's aiohttp transport (``openai.DefaultAioHttpClient``).

Each case first runs a small job of ``c`` rows (not timed, it opens the connections),
then the timed one. For each case the table shows rows per second end to end (the whole
call: scan, streaming, consolidation, report), for ours also the streaming phase alone
(from the job's log events; ``report.json``'s ``this_run`` figures cover the whole
call), CPU time per row (user + system, all threads), peak RSS, samples the pool took
back from a member and sent again, and the share of the client's and nginx's cores other
work took. A second table splits our job into its phases.

Run it as::

    python benchmarks/annotate_overhead.py            # full run, about three minutes
    python benchmarks/annotate_overhead.py --quick    # smoke run, about a minute

Targets: at least 4,000 rows per second end to end at 4,096 in flight, and at least 15
times the SDK default client at 512 in flight. The exit code is 0 whether or not they
are met, and non-zero only when the harness fails (nginx cannot start, a worker dies).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as harness
from _nginx import ANSWER, MODEL, CannedServer

CaseKind = Literal["ours", "ours_bare", "ours_metrics", "ours_gc", "sdk", "sdk_aiohttp"]

RESULT_MARKER = "@@annotate-overhead-result "
"""Prefix of the one stdout line on which a worker subprocess reports its result."""
NOISY = 0.2
"""Above this share of either core taken by other work, a row is called noisy."""
AGAIN = "  noisy ({noise:.0%}); measuring again"
"""What a noisy case prints before it is measured again (see ``harness.Retry``)."""
TARGET_RPS_4096 = 4000.0
TARGET_RATIO_512 = 15.0
BATCHES_PER_MEMBER = 4
"""``max_concurrent_batches_per_client`` of the pool; ``batch_size`` follows from it."""
GC_VARIANT = (700, 10, 100)
"""The collector thresholds of the ``ours_gc`` case (CPython's defaults are 700, 10, 10)."""

CASES = ("ours", "ours_bare", "ours_metrics", "ours_gc", "sdk", "sdk_aiohttp")
OURS = ("ours", "ours_bare", "ours_metrics", "ours_gc")


# --------------------------------------------------------------------------------------
# What the parent hands a worker, and what a worker hands back
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseSpec:
    """One measurement.

    Attributes:
        kind: Which client runs the job.
        label: The row's name in the table.
        in_flight: Requests in flight in total.
        rows: Rows of the timed job.
        input_path: The timed job's JSONL input.
        warmup_path: The warm-up job's input (``in_flight`` rows), or "" for none.
        workdir: A folder of the worker's own for the outputs.
        base_urls: The OpenAI base URLs (one pool member per URL; the SDK uses the first).
        cpu: The CPU the worker pins itself to.
        timeout: Seconds the whole case (warm-up included) may take.
    """

    kind: CaseKind
    label: str
    in_flight: int
    rows: int
    input_path: str
    warmup_path: str
    workdir: str
    base_urls: tuple[str, ...]
    cpu: int
    timeout: float


@dataclass
class CaseResult(harness.CaseFigures):
    """What one worker measured (the figures of every case: ``harness.CaseFigures``).

    ``ok`` counts the rows with an answer in the output, ``errors`` the failed rows by
    kind; the timed part is the timed job.

    Attributes:
        label: The row's name.
        kind: Which client ran the job.
        in_flight: Requests in flight.
        rows: Rows of the timed job.
        out_rows: Rows in the output file (the Parquet file for ours).
        gc_seconds: Seconds the cyclic garbage collector ran during the timed job.
        gc_full: Full (generation 2) collections during the timed job.
        phases: Seconds of each phase of our job (see :func:`harness.phase_times`).
        report_rps: ``this_run.rows_per_second`` of our ``report.json``.
        report_wall: ``this_run.wall_seconds`` of our ``report.json``.
        requeued: Samples the pool took back from members and sent again.
    """

    label: str
    kind: str
    in_flight: int
    rows: int
    out_rows: int = 0
    gc_seconds: float = 0.0
    gc_full: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    report_rps: float | None = None
    report_wall: float | None = None
    requeued: int = 0

    @property
    def passed(self) -> bool:
        """Whether every row got its answer within the time limit."""
        return (
            self.status == "ok"
            and not self.errors
            and self.ok == self.rows
            and self.out_rows == self.rows
            and self.wall > 0
        )

    @property
    def rps(self) -> float | None:
        """Rows per second end to end, or None for a failed case."""
        return self.rows / self.wall if self.passed else None

    @property
    def stream_rps(self) -> float | None:
        """Rows per second of the streaming phase alone, where known."""
        seconds = self.phases.get("streaming")
        return self.rows / seconds if self.passed and seconds else None

    @property
    def cpu_us_per_row(self) -> float | None:
        """Microseconds of CPU per row, or None for a failed case."""
        return self.cpu / self.rows * 1e6 if self.passed else None


# --------------------------------------------------------------------------------------
# Worker side: runs in a fresh subprocess, pinned to one core
# --------------------------------------------------------------------------------------


class GcTimer:
    """Seconds the cyclic garbage collector ran, in every thread, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.full += info["generation"] == 2


_GC = GcTimer()


class JobClock(harness.Clock):
    """Wall, CPU, collector and the core's busy time around the timed job."""

    def __init__(self, cpu: int) -> None:
        super().__init__(cpu)
        self._gc0 = 0.0
        self._full0 = 0

    def start(self) -> float:
        """Start the clocks; return the monotonic start time."""
        self._gc0, self._full0 = _GC.seconds, _GC.full
        return super().start()

    def finish(self, result: CaseResult) -> None:
        """Stop the clocks and put the figures into ``result``."""
        self.stop()
        result.wall, result.cpu, result.other_load = self.wall, self.cpu_time, self.other_load
        result.gc_seconds = _GC.seconds - self._gc0
        result.gc_full = _GC.full - self._full0


def _worker_ours(spec: CaseSpec, result: CaseResult) -> None:
    import pyarrow.parquet as pq

    from llm_annotator import Annotator, VLLMOnlineRuntimeOptions, VLLMQueueAnnotator

    log = harness.EventLog()
    log.install()
    members = len(spec.base_urls)
    batch_size = max(1, spec.in_flight // (members * BATCHES_PER_MEMBER))
    pool = VLLMQueueAnnotator(
        list(spec.base_urls),
        model=MODEL,
        batch_size=batch_size,
        max_concurrent_batches_per_client=BATCHES_PER_MEMBER,
    )
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=harness.MAX_TOKENS)
    workdir = Path(spec.workdir)

    annotator = Annotator(
        pool,
        progress=False,
        timeline=spec.kind != "ours_bare",
        metrics_port=0 if spec.kind == "ours_metrics" else None,
    )

    def job(path: str, out: str) -> Any:
        return annotator.annotate(
            path, harness.TEMPLATE, workdir / out, id_column="id", options=options
        )

    try:
        if spec.warmup_path:
            job(spec.warmup_path, "warmup")
        clock = JobClock(spec.cpu)
        start = clock.start()
        done = job(spec.input_path, "run")
        clock.finish(result)
        end = time.monotonic()
    finally:
        pool.close()
    result.phases = harness.phase_times(log, start, end)
    result.ok = done.num_succeeded
    result.out_rows = pq.read_metadata(done.output_path).num_rows
    if done.num_failed:
        result.errors["error rows"] = done.num_failed
    report = json.loads(Path(done.report_path).read_text())
    this_run = report.get("this_run", {})
    result.report_rps = this_run.get("rows_per_second")
    result.report_wall = this_run.get("wall_seconds")
    result.requeued = sum(s.get("requeued", 0) for s in report.get("per_server", {}).values())


def _read_rows(path: str) -> list[dict[str, Any]]:
    with open(path) as source:
        return [json.loads(line) for line in source]


def _worker_sdk(spec: CaseSpec, result: CaseResult, use_aiohttp: bool) -> None:
    import openai

    errors: Counter[str] = Counter()
    samples: dict[str, str] = {}

    async def job(client: Any, path: str, out_path: Path) -> int:
        """The minimal loop: read, render, send all under a semaphore, append answers."""
        semaphore = asyncio.Semaphore(spec.in_flight)
        rows = _read_rows(path)
        good = 0
        with out_path.open("w") as out:

            async def one(row: dict[str, Any]) -> None:
                nonlocal good
                prompt = harness.TEMPLATE.format(**row)
                async with semaphore:
                    try:
                        completion = await client.chat.completions.create(
                            model=MODEL,
                            messages=[{"role": "user", "content": prompt}],
                            max_completion_tokens=harness.MAX_TOKENS,
                        )
                    except Exception as exc:
                        kind = harness.error_kind(exc)
                        errors[kind] += 1
                        samples.setdefault(kind, (str(exc) or repr(exc))[:300])
                        out.write(json.dumps({"id": row["id"], "error": str(exc)}) + "\n")
                        return
                choice = completion.choices[0]
                usage = completion.usage
                record = {
                    "id": row["id"],
                    "response": choice.message.content,
                    "finish_reason": choice.finish_reason,
                    "num_prompt_tokens": usage.prompt_tokens if usage else None,
                    "num_output_tokens": usage.completion_tokens if usage else None,
                    **row,
                }
                out.write(json.dumps(record) + "\n")
                if choice.message.content == ANSWER:
                    good += 1

            await asyncio.gather(*(one(row) for row in rows))
        return good

    async def main() -> None:
        http_client = None
        if use_aiohttp:
            factory = getattr(openai, "DefaultAioHttpClient", None)
            if factory is None:
                result.status = "unavailable"
                result.note = f"openai {openai.__version__} has no aiohttp transport"
                return
            try:
                http_client = factory()
            except RuntimeError as exc:
                result.status, result.note = "unavailable", str(exc)
                return
        client = openai.AsyncOpenAI(
            base_url=spec.base_urls[0], api_key="x", http_client=http_client
        )
        workdir = Path(spec.workdir)
        try:
            if spec.warmup_path:
                await job(client, spec.warmup_path, workdir / "warmup.jsonl")
                errors.clear()
            clock = JobClock(spec.cpu)
            clock.start()
            result.ok = await job(client, spec.input_path, workdir / "run.jsonl")
            clock.finish(result)
        finally:
            await client.close()
        with (workdir / "run.jsonl").open("rb") as out:
            result.out_rows = sum(1 for _ in out)

    asyncio.run(main())
    result.errors = dict(errors)
    result.samples = samples


def worker(spec: CaseSpec) -> None:
    """Measure one case in this process and print its result line."""
    harness.pin_worker(spec.cpu)
    result = CaseResult(label=spec.label, kind=spec.kind, in_flight=spec.in_flight, rows=spec.rows)

    def report(status: str | None = None, note: str = "") -> None:
        if not watchdog.claim():
            return
        if status is not None:
            result.status = status
        if note:
            result.note = note
        result.peak_rss_kb = harness.peak_rss_kb()
        harness.report_result(RESULT_MARKER, result)

    def expire() -> None:
        report("timeout", f"stopped at the {spec.timeout:.0f} s limit")
        os._exit(0)

    watchdog = harness.Watchdog(spec.timeout, expire)
    watchdog.start()
    if spec.kind == "ours_gc":
        gc.set_threshold(*GC_VARIANT)
    try:
        if spec.kind in OURS:
            _worker_ours(spec, result)
        else:
            _worker_sdk(spec, result, use_aiohttp=spec.kind == "sdk_aiohttp")
    except Exception as exc:
        report("crashed", f"{type(exc).__name__}: {exc}")
        raise
    report()


# --------------------------------------------------------------------------------------
# Parent side: starts nginx, runs each case in its own subprocess, prints the tables
# --------------------------------------------------------------------------------------


def run_case(spec: CaseSpec, server: CannedServer, server_cpu: int) -> CaseResult:
    """Run ``spec`` in a fresh worker subprocess; add nginx's side of the picture."""
    result = harness.watch_server(server, server_cpu, partial(_run_worker, spec))
    shutil.rmtree(spec.workdir, ignore_errors=True)
    return result


def _run_worker(spec: CaseSpec) -> CaseResult:
    Path(spec.workdir).mkdir(parents=True, exist_ok=True)
    done = harness.run_worker(__file__, spec, RESULT_MARKER, spec.timeout + 60)
    if done.data is None:
        status, note = done.failure(12)
        return CaseResult(
            spec.label, spec.kind, spec.in_flight, spec.rows, status=status, note=note
        )
    result = CaseResult(**done.data)
    if result.status == "crashed" or done.stderr.strip():
        result.note = done.note_with_stderr(result.note, 12)
    return result


def _figure(value: float | None, fmt: str = ",.0f", missing: str = "-") -> str:
    return missing if value is None else format(value, fmt)


def print_results(results: Sequence[CaseResult]) -> None:
    """The main table, the phase table of our jobs, then notes on failed or noisy rows."""
    header = ["job", "in flight", "rows", "ok", "wall s", "rows/s", "stream rows/s"]
    header += ["CPU us/row", "RSS MB", "GC s (full)", "requeued", "other % cl/srv"]
    rows = []
    for r in results:
        if r.status == "unavailable":
            rows.append((r.label, f"{r.in_flight:,}", *["-"] * 3, "n/a", *["-"] * 6))
            continue
        rows.append(
            (
                r.label,
                f"{r.in_flight:,}",
                f"{r.rows:,}",
                f"{r.ok:,}",
                f"{r.wall:.2f}" if r.wall else "-",
                _figure(r.rps, missing="FAILED"),
                _figure(r.stream_rps),
                _figure(r.cpu_us_per_row),
                f"{r.peak_rss_kb / 1024:.0f}" if r.peak_rss_kb else "-",
                f"{r.gc_seconds:.2f} ({r.gc_full})" if r.wall else "-",
                f"{r.requeued:,}" if r.kind.startswith("ours") else "-",
                harness.percent(r.other_load) + "/" + harness.percent(r.server_other_load),
            )
        )
    harness.print_table(header, rows)
    ours = [r for r in results if r.kind.startswith("ours") and r.phases]
    if ours:
        print("\nour job's phases (seconds; from its log events):")
        phase_rows = [
            (
                f"{r.label} @ {r.in_flight:,}",
                *(f"{r.phases[p]:.3f}" if p in r.phases else "-" for p in harness.PHASES),
                f"{r.wall:.3f}",
                _figure(r.report_wall, ".3f"),
                _figure(r.report_rps),
            )
            for r in ours
        ]
        harness.print_table(
            (
                "job",
                *harness.PHASES,
                "total",
                "report wall_seconds",
                "report rows_per_second",
            ),
            phase_rows,
        )
    harness.print_noisy(results, NOISY)
    harness.print_notes([r for r in results if not r.passed or r.tcp or r.note], _headline)


def _headline(r: CaseResult) -> str:
    status = "passed" if r.passed else r.status
    if not r.passed and r.status == "ok":
        status = f"failed: {r.rows - r.ok:,} of {r.rows:,} rows without the expected answer"
    return f"{r.label} at {r.in_flight:,} in flight: {status}"


def _title(spec: CaseSpec) -> str:
    return f"{spec.label} at {spec.in_flight:,} in flight"


def _find(results: Sequence[CaseResult], kind: str, in_flight: int) -> CaseResult | None:
    return next((r for r in results if r.kind == kind and r.in_flight == in_flight), None)


def print_targets(results: Sequence[CaseResult]) -> None:
    """The two target lines, PASS or MISS."""
    print()
    text = harness.rate_verdict(_find(results, "ours", 4096), TARGET_RPS_4096, "rows/s")
    print(f"ours end to end at 4,096 in flight: {text}")
    ours, sdk = _find(results, "ours", 512), _find(results, "sdk", 512)
    text = harness.ratio_verdict(ours, sdk, TARGET_RATIO_512)
    print(f"ours / SDK default at 512 in flight, end to end: {text}")


def build_cases(
    args: argparse.Namespace, base_urls: Sequence[str], cpu: int, folder: Path
) -> list[CaseSpec]:
    """The cases to run, in order, with their inputs written to ``folder``.

    ``--only`` (a set of case kinds, or None) filters them.
    """
    inputs: dict[int, str] = {}

    def input_of(rows: int) -> str:
        if rows not in inputs:
            inputs[rows] = str(harness.write_input(folder / f"input-{rows}.jsonl", rows))
        return inputs[rows]

    table: list[tuple[CaseKind, str, int]] = [
        ("ours", "ours: pool.annotate, 4 ports", args.rows),
        ("ours_bare", "ours, timeline off", args.rows),
        ("ours_metrics", "ours + live metrics served", args.rows),
        ("ours_gc", f"ours + gc.set_threshold{GC_VARIANT}", args.rows),
        ("sdk", "openai AsyncOpenAI default + gather", args.sdk_rows),
        ("sdk_aiohttp", "openai AsyncOpenAI + DefaultAioHttpClient", args.sdk_rows),
    ]
    cases = []
    for in_flight in args.in_flight:
        for kind, label, rows in table:
            if args.only is not None and kind not in args.only:
                continue
            if kind == "ours_gc" and not args.gc_variant:
                continue
            cases.append(
                CaseSpec(
                    kind=kind,
                    label=label,
                    in_flight=in_flight,
                    rows=rows,
                    input_path=input_of(rows),
                    warmup_path="" if args.cold else input_of(in_flight),
                    workdir=str(folder / f"{kind}-{in_flight}"),
                    base_urls=tuple(base_urls),
                    cpu=cpu,
                    timeout=args.case_timeout,
                )
            )
    return cases


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    harness.add_number(parser, "--rows", 40_000, "rows of our timed job (default 40,000)")
    harness.add_number(
        parser,
        "--sdk-rows",
        5_000,
        "rows of the SDK loops' timed jobs (default 5,000; they are slow)",
    )
    parser.add_argument(
        "--in-flight",
        default="512,4096",
        help="comma-separated requests in flight (default 512,4096)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 8,000 rows for ours, 1,000 for the SDK"
    )
    parser.add_argument(
        "--only", default="", help=f"comma-separated cases: {', '.join(CASES)} (default all)"
    )
    parser.add_argument(
        "--gc-variant",
        action="store_true",
        help=f"also run ours with gc.set_threshold{GC_VARIANT} in the worker",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="no warm-up job: the timed job opens its connections itself",
    )
    harness.add_case_timeout(parser, 180.0)
    harness.add_wait_idle(parser, "case", "default 0")
    harness.add_attempts(parser, NOISY)
    harness.add_worker(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.sdk_rows = 8_000, 1_000
    args.in_flight = harness.integers(parser, "--in-flight", args.in_flight)
    if min([args.rows, args.sdk_rows, args.attempts, *args.in_flight]) < 1:
        parser.error("--rows, --sdk-rows, --in-flight and --attempts must be positive")
    args.only = harness.chosen(parser, "--only", args.only, CASES)
    return args


def measure(
    args: argparse.Namespace, server: CannedServer, client_cpu: int, server_cpu: int
) -> int:
    """Print the set-up, write the inputs, run every job against ``server``, print tables."""
    print(harness.versions("python", "openai", "aiohttp", "uvloop", "pyarrow", "llm-annotator"))
    print(
        f"jobs pinned to CPU {client_cpu}, nginx (1 worker, 4 ports) to CPU {server_cpu}; "
        f"pool: 4 members, {BATCHES_PER_MEMBER} batches each, batch_size = in flight / "
        f"{4 * BATCHES_PER_MEMBER}; max_completion_tokens {harness.MAX_TOKENS}; "
        + ("no warm-up" if args.cold else "one untimed warm-up job of c rows per case")
    )
    if client_cpu == server_cpu:
        print("warning: only one CPU is available, so nginx shares it with the jobs")
    harness.print_background([client_cpu, server_cpu], "case")
    retry = harness.Retry(args.attempts, args.wait_idle, NOISY, AGAIN)
    reports = (print_results, print_targets)
    with harness.scratch_folder("annotate-overhead-") as folder:
        cases = build_cases(args, server.base_urls, client_cpu, folder)
        cpus = (client_cpu, server_cpu)
        return harness.measure_cases(server, cpus, cases, run_case, _title, retry, reports, 12)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the process exit code."""
    return harness.main_over_nginx(parse_args(argv), CaseSpec, worker, measure)


if __name__ == "__main__":
    sys.exit(main())
