"""A corpus job at scale against nginx: how long before the first request, how much
memory, how much of the corpus each shard reads, how fast, how long the merge takes.

nginx answers every chat completion with a fixed body on four loopback ports and logs
each request with its time (``$msec``), so "the first request" and "requests a second"
are what the server saw. For each corpus (``--rows`` rows in ``--files`` files, as
Parquet and as gzip JSONL; built once into ``--cache``):

1. **Start and memory.** ``llm-annotator run --input CORPUS/`` for ``--seconds`` seconds,
   then SIGINT: the time from the process's start to nginx's first chat completion, the
   requests a second from then on, and the process's peak RSS (``VmHWM``). Beside it,
   the same rows as one JSONL file (a one-file job, which scans its input first).
2. **Bytes read by each of 4 shards** (the first size, gzip JSONL): ``--shard i/4`` run
   to the end under ``strace``, every ``read``/``pread64`` on a file of the corpus
   summed; against a quarter of the corpus plus its largest file. The four shards
   finish the corpus.
3. **The merge** of that run (1,000 units): ``llm-annotator merge`` wall time.
4. **Local worker processes:** ``--processes 1`` and ``--processes 2`` on the same
   corpus (fresh run folders), requests a second over ``--seconds`` each.
5. **A whole run** of the first size (``--whole-rows``), start to end, side by side in
   one run, each a fresh process pinned to the core nginx does not use: (a) the rows as
   one JSONL file, a one-file job (scanned first, consolidated into
   ``annotations.parquet`` at the end); (b) the same rows as the gzip JSONL corpus (its
   units written as they finish); (c) the same one file with ``--shard claim`` (one
   worker: ``--processes 1``), cut into byte-range units of ``--unit-size``. Each with
   wall time, rows a second, its ratio to (a), CPU seconds, peak RSS (``ru_maxrss``:
   the process's ``VmHWM``) and the share of its core other work took. ``--rounds``
   repeats the three, each round begun by the next case.
6. **Peak memory of a one-file job** over a whole run at ``--peak-rows`` (none by
   default; 10^7 rows take over half an hour): (a) alone, its file written directly.

Run it as::

    python benchmarks/corpus_scale.py                    # 10^6 and 10^7 rows, 1,000 files
    python benchmarks/corpus_scale.py --quick            # 10^5 rows, 100 files, 10 s windows
    python benchmarks/corpus_scale.py --rows 1000000 --skip-start --skip-shards \
        --skip-processes                                 # part 5 alone, about 11 minutes

Prints the figures; exits 0 unless the harness fails.
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

import _harness as harness
from _nginx import MODEL, CannedServer

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))
FORMATS = ("parquet", "jsonl.gz")


def text_of(i: int) -> str:
    stars = "great" if i % 3 else "poor"
    return f"Review {i}: a {stars} product, it arrived on time and works as described."


def build(folder: Path, rows: int, files: int, kind: str) -> Path:
    """A corpus of ``rows`` rows (``id``, ``text``) in ``files`` files, built once."""
    done = folder / ".complete"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    per_file = rows // files
    for f in range(files):
        ids = range(f * per_file, (f + 1) * per_file if f < files - 1 else rows)
        name = folder / f"part-{f:05d}.{kind}"
        if kind == "parquet":
            table = pa.table({"id": list(ids), "text": [text_of(i) for i in ids]})
            pq.write_table(table, name)
        else:
            lines = b"".join(orjson.dumps({"id": i, "text": text_of(i)}) + b"\n" for i in ids)
            name.write_bytes(gzip.compress(lines, compresslevel=1))
    done.touch()
    return folder


def one_file(corpus: Path, target: Path) -> Path:
    """The corpus's rows as one JSONL file (for the one-file job beside it)."""
    if target.exists():
        return target
    with target.open("wb") as out:
        for part in sorted(corpus.glob("*.jsonl.gz")):
            out.write(gzip.decompress(part.read_bytes()))
    return target


def write_one_file(target: Path, rows: int) -> Path:
    """``rows`` rows (``id``, ``text``, as the corpora's) as one JSONL file, built once."""
    if target.exists():
        return target
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as out:
        for start in range(0, rows, 100_000):
            ids = range(start, min(start + 100_000, rows))
            out.write(b"".join(orjson.dumps({"id": i, "text": text_of(i)}) + b"\n" for i in ids))
    partial.rename(target)
    return target


def job_args(urls: list[str], data: Path, out: Path, *extra: str) -> list[str]:
    return [
        COMMAND, "run", "--servers", *urls, "--model", MODEL, "--input", str(data),
        "--id-column", "id", "--prompt-template", harness.TEMPLATE, "--output-dir", str(out),
        "--max-completion-tokens", str(harness.MAX_TOKENS), "--log-format", "json",
        "--processes", "1", *extra,
    ]  # fmt: skip


def posts(log: Path, since: float, until: float = float("inf")) -> list[float]:
    """The times of the chat completions nginx served in [since, until)."""
    times = []
    with log.open() as file:
        for line in file:
            stamp, method, uri = line.split()
            at = float(stamp)
            if method == "POST" and uri.endswith("/chat/completions") and since <= at < until:
                times.append(at)
    return times


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MB; its children's too."""
    total = 0.0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for each in pids:
        match = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{each}/status").read_text())
        total += int(match.group(1)) / 1024 if match else 0.0
    return total


def window(
    urls: list[str], data: Path, out: Path, log: Path, seconds: float, *extra: str
) -> dict[str, float]:
    """Run a job for ``seconds`` after its first request, then SIGINT it."""
    started = time.time()
    process = subprocess.Popen(
        job_args(urls, data, out, *extra),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    first = None
    deadline = started + 600
    while first is None:
        if process.poll() is not None or time.time() > deadline:
            raise SystemExit(f"the job ended or never sent a request: {' '.join(extra)}")
        time.sleep(0.05)
        sent = posts(log, started)
        first = sent[0] if sent else None
    time.sleep(seconds)
    rss = peak_rss_mb(process.pid)
    end = time.time()
    process.send_signal(signal.SIGINT)
    process.wait(timeout=120)
    rate = len(posts(log, first, end)) / (end - first)
    return {"first": first - started, "rate": rate, "rss": rss}


def bytes_read(urls: list[str], corpus: Path, out: Path, shard: str) -> tuple[int, float]:
    """Bytes a shard reads from the corpus's files over its whole run (strace), and
    its wall time."""
    trace = out.with_suffix(f".{shard.replace('/', '-')}.strace")
    started = time.monotonic()
    done = subprocess.run(
        ["strace", "-f", "--seccomp-bpf", "-y", "-e", "trace=read,pread64,readv,preadv",
         "-o", str(trace),
         *job_args(urls, corpus, out, "--shard", shard)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        timeout=7200,
    )  # fmt: skip
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"shard {shard} failed: {done.stderr.decode()[-2000:]}")
    prefix = str(corpus) + "/"
    total = harness.traced_bytes(trace, lambda path: path.startswith(prefix))
    trace.unlink()
    return total, seconds


@dataclass
class Whole:
    """A whole run: wall and CPU seconds, peak RSS in MB (``ru_maxrss`` from ``wait4``:
    the process's ``VmHWM``), the share of its core other work took."""

    wall: float
    cpu: float
    rss: float
    other: float | None


def whole_run(command: list[str], cpu: int, logs: Path) -> Whole:
    """Run ``command`` to its end pinned to ``cpu``."""
    core0 = harness.busy_seconds(cpu)
    began = time.perf_counter()
    with logs.with_suffix(".out").open("wb") as out, logs.with_suffix(".err").open("wb") as err:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        )
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - began
        process.returncode = os.waitstatus_to_exitcode(status)
    core1 = harness.busy_seconds(cpu)
    if process.returncode != 0:
        tail = harness.tail(logs.with_suffix(".err").read_text(errors="replace"), 20)
        raise SystemExit(f"the whole run failed (exit {process.returncode}): {tail}")
    cpu_time = usage.ru_utime + usage.ru_stime
    other = None
    if core0 is not None and core1 is not None:
        other = max(0.0, (core1 - core0 - cpu_time) / wall)
    return Whole(wall, cpu_time, usage.ru_maxrss / 1024, other)


def output_rows(run: Path) -> tuple[int, int]:
    """(rows, units) of a finished run's output: ``annotations.parquet`` (one unit) or
    ``annotations/``."""
    single = run / "annotations.parquet"
    if single.exists():
        return int(pq.read_metadata(single).num_rows), 1
    parts = list((run / "annotations").glob("*.parquet"))
    return sum(int(pq.read_metadata(p).num_rows) for p in parts), len(parts)


def part_five(
    args: argparse.Namespace,
    urls: list[str],
    corpora: dict[tuple[int, str], Path],
    scratch: Path,
    cpu: int,
) -> None:
    """A whole run, start to end: the one file, the corpus, the one file by claims."""
    rows = args.whole_rows or args.rows[0]
    corpus = corpora.get((rows, "jsonl.gz"))
    if corpus is None:
        raise SystemExit(f"--whole-rows {rows}: give it in --rows too (its corpus is built)")
    single = one_file(corpus, args.cache / f"one-{rows}.jsonl")
    cases = {
        "(a) one file, one-file job": (single, ()),
        f"(b) corpus jsonl.gz, {args.files:,} files": (corpus, ()),
        f"(c) one file, --shard claim, units of {args.unit_size}": (
            single,
            ("--shard", "claim", "--unit-size", args.unit_size),
        ),
    }
    first = next(iter(cases))
    print(
        f"\n5. a whole run to the end, {rows:,} rows ({single.stat().st_size / 1e6:,.1f} MB "
        f"as one file), side by side: each case a fresh process on CPU {cpu}, nginx on the "
        f"other; {args.rounds} round(s), the cases in turn"
    )
    header = ["case", "round", "wall s", "rows/s", "x (a)", "CPU s", "CPU x (a)", "peak RSS MB",
              "rows out", "units", "other %"]  # fmt: skip
    table: list[list[str]] = []
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    labels = list(cases)
    for round_ in range(args.rounds):
        turn = labels[round_ % 3 :] + labels[: round_ % 3]  # each case first in a round
        for label in turn:
            data, extra = cases[label]
            out = scratch / f"whole-{label[1]}-{round_}"
            f = whole_run(job_args(urls, data, out, *extra), cpu, out.with_suffix(".log"))
            written, units = output_rows(out)
            shutil.rmtree(out, ignore_errors=True)
            rate = rows / f.wall
            rates.setdefault(label, []).append(rate)
            cpus.setdefault(label, []).append(f.cpu)
            table.append([
                label, str(round_ + 1), f"{f.wall:.1f}", f"{rate:,.0f}", "", f"{f.cpu:.1f}", "",
                f"{f.rss:,.0f}", f"{written:,}", str(units), harness.percent(f.other),
            ])  # fmt: skip
            print(f"  {label}, round {round_ + 1}: {f.wall:.1f} s", flush=True)
    for row in table:  # against (a) of the same round
        label, round_ = row[0], int(row[1]) - 1
        row[4] = f"{rates[label][round_] / rates[first][round_]:.3f}"
        row[6] = f"{cpus[label][round_] / cpus[first][round_]:.3f}"
    table.sort(key=lambda row: (int(row[1]), labels.index(row[0])))
    harness.print_table(header, table)
    best = {label: max(r) for label, r in rates.items()}
    for label in list(cases)[1:]:
        ratio = best[label] / best[first]
        print(
            f"  {label[:3]} against (a), best round of each: {ratio:.3f}x rows/s "
            f"({'within' if abs(ratio - 1) <= 0.05 else 'outside'} 5%), "
            f"{min(cpus[label]) / min(cpus[first]):.3f}x CPU seconds"
        )


def part_six(args: argparse.Namespace, urls: list[str], scratch: Path, cpu: int) -> None:
    """Peak memory of a one-file job over a whole run, at each ``--peak-rows``."""
    print(f"\n6. a one-file job's peak memory over a whole run (CPU {cpu})")
    for rows in args.peak_rows:
        single = write_one_file(args.cache / f"one-{rows}.jsonl", rows)
        out = scratch / f"peak-{rows}"
        f = whole_run(job_args(urls, single, out), cpu, out.with_suffix(".log"))
        written, _ = output_rows(out)
        shutil.rmtree(out, ignore_errors=True)
        print(
            f"  {rows:,} rows ({single.stat().st_size / 1e6:,.0f} MB): peak RSS "
            f"{f.rss:,.0f} MB, {f.wall:.0f} s, {rows / f.wall:,.0f} rows/s, "
            f"{written:,} rows out, other {harness.percent(f.other)}"
        )


def size_of(folder: Path) -> tuple[int, int]:
    sizes = [
        p.stat().st_size for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
    ]
    return sum(sizes), max(sizes)


def part_one(
    args: argparse.Namespace,
    urls: list[str],
    corpora: dict[tuple[int, str], Path],
    scratch: Path,
    log: Path,
) -> None:
    """Start and memory: each corpus, and the one file, for a window."""
    print("\n1. start and memory: run for a window after the first request, then SIGINT")
    print(f"{'input':<34}{'first request s':>16}{'requests/s':>12}{'peak RSS MB':>13}")
    figures: dict[str, dict[str, float]] = {}
    for rows in args.rows:
        for kind in FORMATS:
            label = f"corpus {kind} {rows:,}"
            figures[label] = window(
                urls, corpora[rows, kind], scratch / label.replace(" ", "-"), log, args.seconds
            )
            f = figures[label]
            print(f"{label:<34}{f['first']:>16.2f}{f['rate']:>12,.0f}{f['rss']:>13,.0f}")
        single = one_file(corpora[rows, "jsonl.gz"], args.cache / f"one-{rows}.jsonl")
        label = f"one file jsonl {rows:,}"
        figures[label] = window(urls, single, scratch / label.replace(" ", "-"), log, args.seconds)
        f = figures[label]
        print(f"{label:<34}{f['first']:>16.2f}{f['rate']:>12,.0f}{f['rss']:>13,.0f}")
    if len(args.rows) > 1:
        for kind in FORMATS:
            small, large = (
                figures[f"corpus {kind} {r:,}"]["rss"] for r in (args.rows[0], args.rows[-1])
            )
            ratio = large / small
            print(f"  peak RSS {kind}: {args.rows[-1]:,} rows / {args.rows[0]:,}: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[10**6, 10**7])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "llm-annotator-corpus-bench"
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-start", action="store_true", help="leave out part 1")
    parser.add_argument("--skip-shards", action="store_true", help="leave out parts 2 and 3")
    parser.add_argument("--skip-processes", action="store_true", help="leave out part 4")
    parser.add_argument("--skip-whole", action="store_true", help="leave out part 5")
    parser.add_argument(
        "--whole-rows", type=int, help="part 5's size, one of --rows (default: the first)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="part 5's rounds")
    parser.add_argument(
        "--unit-size", default="16M", help="part 5 (c): the unit size of --shard claim"
    )
    parser.add_argument(
        "--peak-rows", type=int, nargs="*", default=[], help="part 6: one-file job sizes"
    )
    args = parser.parse_args()
    if args.quick:
        args.rows, args.files, args.seconds = [10**5], 100, 10.0
    client_cpu, server_cpu = harness.pick_cpus()
    scratch = Path(tempfile.mkdtemp(prefix="corpus-bench-"))
    log = scratch / "access.log"
    print(f"corpus_scale: {args.files} files, rows {args.rows}, windows of {args.seconds:g} s; "
          f"nginx on CPU {server_cpu}; {harness.versions('llm-annotator', 'pyarrow')}")  # fmt: skip
    corpora = {}
    for rows in args.rows:
        for kind in FORMATS:
            began = time.monotonic()
            corpora[rows, kind] = build(
                args.cache / f"{kind}-{rows}-{args.files}", rows, args.files, kind
            )
            print(f"  corpus {kind} {rows:,} rows: {size_of(corpora[rows, kind])[0] / 1e6:,.1f} MB "
                  f"(built or found in {time.monotonic() - began:.0f} s)")  # fmt: skip
    with CannedServer(ports=4, cpu=server_cpu, access_log=log) as server:
        urls = list(server.base_urls)
        if not args.skip_start:
            part_one(args, urls, corpora, scratch, log)
        if not args.skip_shards:
            rows, kind = args.rows[0], "jsonl.gz"
            corpus = corpora[rows, kind]
            total, largest = size_of(corpus)
            run = scratch / "sharded"
            bound = (total / 4 + largest) / 1e6
            print(f"\n2. bytes read by each of 4 shards, {kind} {rows:,} rows ({total / 1e6:,.1f} "
                  f"MB; a quarter plus the largest file: {bound:,.2f} MB)")  # fmt: skip
            print(f"{'shard':<10}{'MB read':>10}{'of corpus':>11}{'seconds':>10}")
            for index in range(4):
                read, seconds = bytes_read(urls, corpus, run, f"{index}/4")
                print(f"{index}/4{'':<7}{read / 1e6:>10,.2f}{read / total:>11.1%}{seconds:>10.1f}")
            began = time.monotonic()
            merged = subprocess.run([COMMAND, "merge", str(run)], capture_output=True, timeout=600)
            wall = time.monotonic() - began
            units = len(list((run / "annotations").glob("*.parquet")))
            print(f"\n3. merge of {units:,} units: {wall:.2f} s wall (the command, imports "
                  f"included; exit {merged.returncode})")  # fmt: skip
        if not args.skip_processes:
            print("\n4. local worker processes on this machine (requests/s over the window)")
            rows = args.rows[0]
            for processes in (1, 2):
                out = scratch / f"processes-{processes}"
                f = window(
                    urls,
                    corpora[rows, "jsonl.gz"],
                    out,
                    log,
                    args.seconds,
                    "--processes",
                    str(processes),
                )
                print(f"  --processes {processes}: {f['rate']:,.0f} requests/s, "
                      f"first request after {f['first']:.2f} s")  # fmt: skip
        if not args.skip_whole:
            part_five(args, urls, corpora, scratch, client_cpu)
        if args.peak_rows:
            part_six(args, urls, scratch, client_cpu)
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
