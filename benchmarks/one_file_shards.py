"""How much of one large JSONL file each of 4 shards reads, and how fast: the one-file
job's split by id hash (every shard scans the whole file, then reads its rows) against
the same file cut into byte-range units (``--shard claim``/``--processes``, or a corpus
split by unit: each shard reads only its ranges).

Each shard's read runs in a fresh process and reports its ``rchar`` (bytes read by
``read``/``pread``, from ``/proc/self/io``, less what the same process read before its
first row: the imports) and its peak RSS (``VmHWM``). No server is involved: this is the
input side of a shard only, rows read and decoded, nothing sent.

Run it as::

    python benchmarks/one_file_shards.py                 # 10^6 rows (~80 MB)
    python benchmarks/one_file_shards.py --rows 100000   # quicker

Prints one line per shard and way, then the totals; exits 0 unless a shard fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--unit-mb", type=int, default=4, help="byte-range unit size (MiB)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "large.jsonl"
        make_file(path, args.rows)
        size = path.stat().st_size
        print(f"one file: {args.rows:,} rows, {size / 1e6:.1f} MB; {args.shards} shards")
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
                        str(args.unit_mb << 20),
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
            return 1
        print("every row read exactly once by one shard, both ways")
    return 0


if __name__ == "__main__":
    sys.exit(main())
