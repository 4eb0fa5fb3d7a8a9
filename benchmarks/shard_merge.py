"""What sharding a job costs: CPU per row in a shard process against one process, and
the merge's time and peak memory.

1. **CPU per row.** nginx answers every chat completion with a fixed body on four
   loopback ports (pinned to one core). The same input runs through ``llm-annotator
   run`` once whole and once as ``--shard i/4`` in four processes, one after another,
   each pinned to the other core; CPU time (user + system, from the process's rusage)
   per row it took. A shard reads and hashes every row of the input but sends only its
   own, so the figure that matters is CPU per row *it took*. A process also costs CPU
   whatever its rows (start, imports, the servers' check, the store, the report), which
   weighs four times as much on a shard's quarter of the rows; so a quarter of the
   input also runs as one process of its own, the same rows sent at the same start
   cost as a shard's: the difference is what sharding costs a row. The shard that
   finishes last merges them all; its figure is also given less the merge (timed again
   in this process).
2. **The merge.** Four shards of ``--merge-rows`` rows in all (default 10^6), written as
   the job writes them (the store's own JSONL records, each shard consolidated), then
   ``llm-annotator merge`` in a subprocess: wall time and peak RSS.

Run it as::

    python benchmarks/shard_merge.py                 # 40,000 rows, then a 10^6-row merge
    python benchmarks/shard_merge.py --quick         # 8,000 rows, a 10^5-row merge
    python benchmarks/shard_merge.py --rows 160000 --rounds 1 --merge-rows 0

Prints the figures; exits 0 unless the harness fails.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson

import _harness as harness
from _nginx import MODEL, CannedServer

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))


def run_job(base_urls: list[str], data: Path, out: Path, cpu: int, *extra: str) -> float:
    """One ``llm-annotator run`` pinned to ``cpu``; its CPU seconds (user + system)."""
    args = [
        COMMAND, "run", "--servers", *base_urls, "--model", MODEL, "--input", str(data),
        "--id-column", "id", "--prompt-template", harness.TEMPLATE, "--output-dir", str(out),
        "--max-completion-tokens", str(harness.MAX_TOKENS), "--batch-size", "64",
        "--log-format", "json", *extra,
    ]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    process = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
    )
    _, err = process.communicate(timeout=900)
    if process.returncode != 0:
        raise SystemExit(f"llm-annotator run failed:\n{err.decode()[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def rows_of(out: Path) -> int:
    import pyarrow.parquet as pq

    return int(pq.read_metadata(out / "annotations.parquet").num_rows)


def quiet_logs() -> None:
    """Only warnings and errors of what runs in this process."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def merge_cpu(run_dir: Path) -> float:
    """CPU seconds of merging ``run_dir``'s shards again, in this process."""
    from llm_annotator.jobs.shards.merge import merge

    quiet_logs()
    before = harness.cpu_seconds()
    merge(run_dir)
    return harness.cpu_seconds() - before


def line(label: str, rows: int, cpu: float) -> str:
    """A row of the table."""
    per_row = f"{cpu / rows * 1e6:.0f}" if rows else "-"
    return f"{label:<36}{rows:>8,}{cpu:>8.2f}{per_row:>12}"


def cpu_per_row(rows: int, folder: Path, rounds: int) -> None:
    data = harness.write_input(folder / "input.jsonl", rows)
    quarter = harness.write_input(folder / "quarter.jsonl", rows // 4)
    cpus = sorted(os.sched_getaffinity(0))
    client_cpu, server_cpu = cpus[0], cpus[-1]
    with CannedServer(ports=4, cpu=server_cpu) as server:
        urls = list(server.base_urls)
        run_job(urls, data, folder / "warmup", client_cpu)  # page cache, imports
        print(f"CPU per row, {rows:,} rows, nginx on CPU {server_cpu}, jobs on CPU {client_cpu}")
        print(f"{'run':<36}{'rows':>8}{'CPU s':>8}{'CPU us/row':>12}")
        for round_ in range(1, rounds + 1):
            whole = run_job(urls, data, folder / f"whole-{round_}", client_cpu)
            print(line("one process", rows, whole))
            # A shard's share as a job of its own: the same rows sent, the same start.
            part = run_job(urls, quarter, folder / f"quarter-{round_}", client_cpu)
            print(line("one process, a quarter of the input", rows // 4, part))
            out = folder / f"sharded-{round_}"
            total_cpu = merged = 0.0
            for index in range(4):
                cpu = run_job(urls, data, out, client_cpu, "--shard", f"{index}/4")
                taken = rows_of(out / f"shard-{index:04d}-of-0004")
                total_cpu += cpu
                print(line(f"shard {index}/4", taken, cpu))
                if (out / "annotations.parquet").exists() and not merged:
                    # The last shard merged them all: that merge, timed again here.
                    merged = merge_cpu(out)
                    print(line(f"  less its merge ({merged:.2f} s)", taken, cpu - merged))
            print(line("four shards together", rows_of(out), total_cpu))
            # What a shard costs before its first request: start, read and hash the
            # whole input, find everything done (a finished shard run again).
            fixed = run_job(urls, data, out, client_cpu, "--shard", "0/4")
            print(line("shard 0/4 again (all done)", 0, fixed))


def write_shards(run_dir: Path, rows: int) -> None:
    """Four finished shards of ``rows`` rows in all, as the job leaves them."""
    from llm_annotator.jobs.rundir.consolidate import consolidate
    from llm_annotator.jobs.rundir.store import ResultStore
    from llm_annotator.jobs.shards.shard import SHARDING_FILE, Shard

    fingerprint = {"model": MODEL}
    run_dir.mkdir(parents=True)
    (run_dir / SHARDING_FILE).write_bytes(orjson.dumps({"count": 4, "fingerprint": fingerprint}))
    shards = [Shard(i, 4) for i in range(4)]
    stores = [
        ResultStore.open(s.directory(run_dir), {**fingerprint, "shard": s.index}) for s in shards
    ]
    counts = [0, 0, 0, 0]
    for row_id in range(rows):
        index = next(i for i, s in enumerate(shards) if s.owns(row_id))
        counts[index] += 1
        stores[index].append(
            {
                "id": row_id,
                "text": f"review {row_id}: it was fine",
                "response": "positive",
                "finish_reason": "stop",
                "num_prompt_tokens": 21,
                "num_output_tokens": 1,
                "error": None,
                "error_type": None,
                "server": f"http://10.0.0.{index}:8000/v1",
            }
        )
    for shard, store, count in zip(shards, stores, counts, strict=True):
        store.close()
        consolidate(shard.directory(run_dir))
        status = {"state": "finished", "total": count, "done": count}
        (shard.directory(run_dir) / "status.json").write_bytes(orjson.dumps(status))


def merge_figures(rows: int, folder: Path) -> None:
    quiet_logs()
    run_dir = folder / "merge"
    started = time.monotonic()
    write_shards(run_dir, rows)
    print(f"\nthe merge: {rows:,} rows in 4 shards (written in {time.monotonic() - started:.1f} s)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(
        [COMMAND, "merge", str(run_dir)], capture_output=True, text=True, timeout=1800
    )
    seconds = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"llm-annotator merge failed:\n{done.stderr[-2000:]}")
    merged = rows_of(run_dir)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(f"  llm-annotator merge: {seconds:.1f} s wall, {cpu:.1f} s CPU, {merged:,} rows out")
    print(f"  peak RSS of the merge process: {after.ru_maxrss / 1024:.0f} MB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=40_000, help="rows of the CPU runs")
    parser.add_argument("--merge-rows", type=int, default=1_000_000, help="rows merged")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the CPU runs")
    parser.add_argument("--quick", action="store_true", help="8,000 rows, a 10^5-row merge")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.merge_rows = 8_000, 100_000
    folder = Path(tempfile.mkdtemp(prefix="shard-bench-"))
    try:
        if args.rows:
            cpu_per_row(args.rows, folder, args.rounds)
        if args.merge_rows:
            merge_figures(args.merge_rows, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
