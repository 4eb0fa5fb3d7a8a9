"""How much of one large JSONL file each of 4 shards reads, and how fast: the one-file
job's split by id hash (every shard scans the whole file, then reads its rows) against
the same file cut into byte-range units (``--shard i/N`` of a file that cuts into units,
``--shard claim``, ``--processes``: each shard reads only its ranges).

Three cases (``--only``), each with the ways side by side in one run, each shard in a
fresh process, one after another:

- **input** (no server): the input side of a shard only, rows read and decoded,
  nothing sent. Each shard reports its ``rchar`` (bytes read by ``read``/``pread``,
  from ``/proc/self/io``, less what the same process read before its first row: the
  imports) and its peak RSS (``VmHWM``). The byte ranges are as large as the command
  cuts them (a quarter of a shard's share; ``--unit-mb`` to choose).
- **run** (nginx): the real command, ``llm-annotator run --input big.jsonl --id-column
  id --shard i/4``, against nginx answering every chat completion with a fixed body on
  four loopback ports (pinned to one core, the shards to the other), each shard run to
  the end. The old split by id hash is the same command with ``--jsonl``: a corpus job
  does not take ``--jsonl``, so the job keeps the one-file layout (``runs_as_units``),
  where every shard scans the whole file and the last one merges
  (``annotations.parquet``); without it the file runs as units (``annotations/``).
  ``--jsonl`` also writes ``annotations.jsonl``, which costs memory: ``--ways
  hash,whole,ranges`` adds the id hash forced instead by a ``--unit-size`` larger than
  the file (one unit: the one-file layout too), with nothing else changed. The ways
  alternate shard by shard (hash 0, ranges 0, hash 1, ...). For each shard: wall
  time from the command's start to its exit, rows a second, CPU seconds, peak RSS
  (``ru_maxrss`` from ``wait4``: the process's ``VmHWM``), and for context its
  ``rchar`` less that of the same command over a one-row file. That is no measure of
  the input: the event loop (uvloop) reads the answers from the sockets with ``read``,
  each shard reads its store back when it finishes, and the last id-hash shard reads
  the others' stores to merge them.
- **bytes** (nginx): the same commands again into other run directories, under
  ``strace -f -P big.jsonl``: every ``read``/``pread64``/``readv``/``preadv`` on the
  input file summed, against the shard's share of it. A run of its own, as the trace
  slows a process by a fifth to a half.

Run it as::

    python benchmarks/one_file_shards.py                  # 10^6 rows (~59 MB), ~20 minutes
    python benchmarks/one_file_shards.py --only input,run # no strace, ~8 minutes
    python benchmarks/one_file_shards.py --only run --ways hash,whole,ranges  # ~10 minutes
    python benchmarks/one_file_shards.py --quick          # 10^5 rows, ~2 minutes

Prints one line per shard and way, then the totals; exits 0 unless a shard fails, nginx
cannot start, or the rows do not add up.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson
import pyarrow.parquet as pq

import _harness as harness
from _nginx import MODEL, CannedServer, NginxError

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))
WAYS = {
    "hash": "id hash (--jsonl)",
    "whole": "id hash (--unit-size)",
    "ranges": "byte ranges",
}
"""The ways of the run and bytes cases, and their labels."""


def way_args(way: str, size: int) -> tuple[str, ...]:
    """The arguments that choose ``way`` for a file of ``size`` bytes: ``--jsonl`` (a
    corpus job does not take it) or a unit larger than the file (it does not cut) keep
    the one-file layout; nothing more cuts the file into units."""
    if way == "hash":
        return ("--jsonl",)
    if way == "whole":
        return ("--unit-size", str(size + (1 << 20)))
    return ()


NOISY = 0.15
"""A run whose core other work took more of than this is called noisy."""

_SHARD = """
import json, sys, time
def io():
    fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
    return int(fields["rchar"])
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
path, way, index, count, unit_bytes = sys.argv[1:6]
index, count, unit_bytes = int(index), int(count), int(unit_bytes)
from llm_annotator.jobs.rows.corpus import list_corpus
from llm_annotator.jobs.rows.inputs import open_input
from llm_annotator.jobs.shards.shard import Shard
from llm_annotator.jobs.shards.split import units_of_shard
before, started, rows = io(), time.perf_counter(), 0
if way == "hash":
    source = open_input(path, id_column="id", peek=False)
    selection = Shard(index, count).select(source)
    for row in source.rows(selection):
        rows += 1
else:
    corpus = list_corpus(path, unit_bytes=unit_bytes, split_lines=True)
    for unit in units_of_shard(corpus.units, index, count):
        for row in unit.read("id"):
            rows += 1
print(json.dumps({"rows": rows, "rchar": io() - before, "seconds": time.perf_counter() - started,
                  "peak": peak()}))
"""


def make_file(path: Path, rows: int) -> None:
    with path.open("wb") as out:
        for start in range(0, rows, 10_000):
            out.write(
                b"".join(
                    orjson.dumps({"id": i, "text": f"review {i}: " + "fine " * (i % 9)}) + b"\n"
                    for i in range(start, min(start + 10_000, rows))
                )
            )


def shard_unit_bytes(size: int, shards: int) -> int:
    """The unit size ``llm-annotator run --shard i/N`` cuts a file of ``size`` bytes into:
    a quarter of a shard's share, within the library's bounds."""
    from llm_annotator.jobs.corpus import SHARD_UNIT_MIN
    from llm_annotator.jobs.rows.corpus import UNIT_BYTES

    return min(UNIT_BYTES, max(SHARD_UNIT_MIN, -(-size // (4 * shards))))


def input_case(args: argparse.Namespace, path: Path) -> bool:
    """The input side of each shard, both ways; whether every row was read once."""
    size = path.stat().st_size
    unit = args.unit_mb << 20 if args.unit_mb else shard_unit_bytes(size, args.shards)
    print(
        f"\n1. input only (no server), {args.shards} shards, each in a fresh process; "
        f"byte ranges of {unit / 2**20:.2f} MiB ({-(-size // unit)} units)"
    )
    totals: dict[str, int] = {}
    for way in ("hash", "ranges"):  # side by side, in one run
        rows = 0
        for index in range(args.shards):
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    _SHARD,
                    str(path),
                    way,
                    str(index),
                    str(args.shards),
                    str(unit),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            figures = json.loads(done.stdout)
            rows += figures["rows"]
            print(
                f"{way:>6} shard {index}: {figures['rows']:>9,} rows, read "
                f"{figures['rchar'] / 1e6:7.1f} MB = {figures['rchar'] / size:6.1%} of the "
                f"file ({figures['rchar'] / (size / args.shards):5.2f}x its quarter), "
                f"{figures['rows'] / figures['seconds']:>9,.0f} rows/s, peak "
                f"{figures['peak'] / 1e6:.0f} MB"
            )
        totals[way] = rows
    if set(totals.values()) != {args.rows}:
        print(f"rows read do not add up: {totals}")
        return False
    print("every row read exactly once by one shard, both ways")
    return True


# --------------------------------------------------------------------------------------
# The run case: the command against nginx
# --------------------------------------------------------------------------------------


@dataclass
class Process:
    """What one finished ``llm-annotator run`` process did."""

    wall: float
    cpu: float
    peak: int
    """``ru_maxrss`` in bytes: the process's ``VmHWM``."""
    rchar: int
    rows: int
    other: float | None
    """The share of its core that other work took meanwhile."""


def job_args(urls: list[str], data: Path, out: Path, *extra: str) -> list[str]:
    return [
        COMMAND, "run", "--servers", *urls, "--model", MODEL, "--input", str(data),
        "--id-column", "id", "--prompt-template", harness.TEMPLATE, "--output-dir", str(out),
        "--max-completion-tokens", str(harness.MAX_TOKENS), "--log-format", "json",
        "--processes", "1", *extra,
    ]  # fmt: skip


def run_process(command: list[str], cpu: int, logs: Path) -> Process:
    """Run ``command`` pinned to ``cpu`` to its end; its figures. Its ``rchar`` is read
    while it is a zombie (ended, not yet reaped), its peak RSS from ``wait4``."""
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    core0 = harness.busy_seconds(cpu)
    began = time.perf_counter()
    with out.open("wb") as stdout, err.open("wb") as stderr:
        process = subprocess.Popen(
            command,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        wall = time.perf_counter() - began
        core1 = harness.busy_seconds(cpu)
        try:
            io = Path(f"/proc/{process.pid}/io").read_text()
            rchar = int(re.search(r"rchar: (\d+)", io).group(1))  # type: ignore[union-attr]
        except (OSError, AttributeError):
            rchar = -1
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(
            f"the job failed (exit {process.returncode}): {' '.join(command[-6:])}\n"
            + harness.tail(err.read_text(errors="replace"), 20)
        )
    cpu_time = usage.ru_utime + usage.ru_stime
    other = None
    if core0 is not None and core1 is not None and wall > 0:
        other = max(0.0, (core1 - core0 - cpu_time) / wall)
    sent = re.search(r"this run sent (\d+)", out.read_text())
    return Process(
        wall, cpu_time, usage.ru_maxrss * 1024, rchar, int(sent.group(1)) if sent else -1, other
    )


def input_bytes(command: list[str], cpu: int, data: Path, logs: Path) -> int:
    """The bytes ``command`` reads of the file ``data`` over its whole run: every
    ``read``/``pread64``/``readv``/``preadv`` on it, under ``strace -P``."""
    trace = logs.with_suffix(".strace")
    run_process(
        ["strace", "-f", "-qq", "--seccomp-bpf", "-y", "-P", str(data), "-e", "signal=none",
         "-e", "trace=read,pread64,readv,preadv", "-o", str(trace), *command],
        cpu, logs,
    )  # fmt: skip
    total = harness.traced_bytes(trace, lambda path: path == str(data))
    trace.unlink()
    return total


def output_rows(run: Path, way: str) -> int:
    """The rows of the finished run's output, checking its layout is the way's."""
    single, folder = run / "annotations.parquet", run / "annotations"
    if way != "ranges":
        if folder.exists() or not single.exists():
            raise SystemExit(f"{run}: expected the one-file layout (annotations.parquet)")
        return int(pq.read_metadata(single).num_rows)
    if single.exists() or not folder.is_dir():
        raise SystemExit(f"{run}: expected units (annotations/)")
    return sum(int(pq.read_metadata(p).num_rows) for p in folder.glob("*.parquet"))


def run_case(args: argparse.Namespace, path: Path, scratch: Path) -> bool:
    """Each shard of each way, to the end, against nginx: timed (``run``) and traced
    (``bytes``) as asked; whether the rows add up."""
    size = path.stat().st_size
    share = size / args.shards
    timed, traced = "run" in args.only, "bytes" in args.only
    client_cpu, server_cpu = harness.pick_cpus()
    one_row = scratch / "one-row.jsonl"
    make_file(one_row, 1)
    passes = " and ".join(name for name, on in (("timed", timed), ("under strace", traced)) if on)
    print(
        f"\n2. llm-annotator run --shard i/{args.shards} to the end against nginx (4 ports, "
        f"CPU {server_cpu}), {passes}; each shard a fresh process on CPU {client_cpu}, the "
        "ways alternating shard by shard"
    )
    try:
        server = CannedServer(ports=4, cpu=server_cpu)
        server.start()
    except NginxError as exc:
        print(f"nginx is unavailable, the run is not measured: {exc}")
        return False
    runs: dict[tuple[str, int], Process] = {}
    reads: dict[tuple[str, int], int] = {}
    fixed = None
    try:
        urls = list(server.base_urls)
        if timed:
            fixed = run_process(
                job_args(urls, one_row, scratch / "fixed"), client_cpu, scratch / "fixed"
            )
            print(
                f"  fixed cost (the same command over a one-row file): {fixed.wall:.1f} s, "
                f"rchar {fixed.rchar / 1e6:.1f} MB, peak RSS {fixed.peak / 1e6:.0f} MB"
            )
        for index in range(args.shards):  # hash 0, ranges 0, hash 1, ...: side by side
            for way in args.ways:
                shard = ("--shard", f"{index}/{args.shards}", *way_args(way, size))
                logs = scratch / f"{way}-{index}"
                said = []
                if timed:
                    runs[way, index] = run_process(
                        job_args(urls, path, scratch / f"run-{way}", *shard), client_cpu, logs
                    )
                    said.append(f"{runs[way, index].wall:.1f} s")
                if traced:
                    command = job_args(urls, path, scratch / f"traced-{way}", *shard)
                    reads[way, index] = input_bytes(command, client_cpu, path, logs)
                    said.append(f"read {reads[way, index] / 1e6:.1f} MB of the file")
                print(f"  {way} {index}/{args.shards}: {', '.join(said)}", flush=True)
    finally:
        server.stop()
    print(
        f"\none file: {args.rows:,} rows, {size / 1e6:.1f} MB; a shard's share {share / 1e6:.1f} MB"
    )
    if traced:
        print("  input MB: the bytes of the file the shard read (strace, a run of its own)")
    if timed:
        print(
            "  wall s: the command's start to its exit; peak RSS: ru_maxrss (VmHWM); "
            "rchar-fixed: all it read (sockets, its store read back and, for the last id-hash "
            "shard, the merge) less the one-row command's; other %: its core taken by others"
        )
    header = ["way", "shard"]
    if timed:
        header += ["rows", "wall s", "rows/s", "CPU s"]
    if traced:
        header += ["input MB", "x share"]
    if timed:
        header += ["rchar-fixed MB", "peak RSS MB", "other %"]
    table = []
    for way in args.ways:
        for index in range(args.shards):
            row = [
                WAYS[way],
                f"{index}/{args.shards}",
            ]
            p = runs.get((way, index))
            if p is not None:
                row += [f"{p.rows:,}", f"{p.wall:.1f}", f"{p.rows / p.wall:,.0f}", f"{p.cpu:.1f}"]
            if traced:
                read = reads[way, index]
                row += [f"{read / 1e6:.1f}", f"{read / share:.3f}"]
            if p is not None and fixed is not None:
                row += [
                    f"{(p.rchar - fixed.rchar) / 1e6:,.1f}",
                    f"{p.peak / 1e6:.0f}",
                    harness.percent(p.other),
                ]
            table.append(row)
    harness.print_table(header, table)
    noisy = [f"{w} {i}/{args.shards}" for (w, i), p in runs.items() if (p.other or 0) > NOISY]
    if noisy:
        print(f"  noisy (others took over {NOISY:.0%} of the core): {', '.join(noisy)}")
    fine = True
    print()
    for way in args.ways:
        said = []
        if timed:
            shards = [runs[way, i] for i in range(args.shards)]
            sent = sum(p.rows for p in shards)
            written = output_rows(scratch / f"run-{way}", way)
            walls = [p.wall for p in shards]
            said += [
                f"{sent:,} rows sent, {written:,} in the output",
                f"slowest shard {max(walls):.1f} s",
                f"all shards {sum(walls):.1f} s one after another "
                f"({args.rows / sum(walls):,.0f} rows/s)",
                f"peak RSS up to {max(p.peak for p in shards) / 1e6:.0f} MB",
            ]
            fine = fine and sent == written == args.rows
        if traced:
            written = output_rows(scratch / f"traced-{way}", way)
            total = sum(reads[way, i] for i in range(args.shards))
            said.append(f"the file read {total / size:.2f} times over in all")
            fine = fine and written == args.rows
        print(f"  {way:>6}: " + "; ".join(said))
    if not fine:
        print("rows sent or written do not add up")
    return fine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--quick", action="store_true", help="10^5 rows")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument(
        "--unit-mb",
        type=int,
        default=0,
        help="input case: the byte ranges' size in MiB (default: the command's, a quarter "
        "of a shard's share)",
    )
    parser.add_argument(
        "--only",
        type=lambda text: set(text.split(",")),
        default={"input", "run", "bytes"},
        help="cases, comma-separated: input (no server), run (the command, timed), bytes "
        "(the command under strace); default all three",
    )
    parser.add_argument(
        "--ways",
        type=lambda text: text.split(","),
        default=["hash", "ranges"],
        help="run and bytes cases, comma-separated: hash (the one-file layout forced by "
        "--jsonl), whole (forced by a unit larger than the file), ranges; default hash,ranges",
    )
    args = parser.parse_args()
    if not args.ways or not set(args.ways) <= set(WAYS):
        parser.error(f"--ways takes {', '.join(WAYS)}, comma-separated")
    if args.quick:
        args.rows = 100_000
    if not args.only or not args.only <= {"input", "run", "bytes"}:
        parser.error("--only takes input, run and bytes, comma-separated")
    if not Path("/proc/self/io").exists():
        raise SystemExit("one_file_shards: needs /proc/<pid>/io (Linux with I/O accounting)")
    if "bytes" in args.only and shutil.which("strace") is None:
        raise SystemExit("one_file_shards: the bytes case needs strace")
    scratch = Path(tempfile.mkdtemp(prefix="one-file-shards-"))
    try:
        path = scratch / "big.jsonl"
        make_file(path, args.rows)
        size = path.stat().st_size
        print(
            f"one_file_shards: one file of {args.rows:,} rows, {size / 1e6:.1f} MB; "
            f"{args.shards} shards; {harness.versions('llm-annotator', 'pyarrow')}"
        )
        fine = True
        if "input" in args.only:
            fine = input_case(args, path) and fine
        if args.only & {"run", "bytes"}:
            fine = run_case(args, path, scratch) and fine
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if fine else 1


if __name__ == "__main__":
    sys.exit(main())
