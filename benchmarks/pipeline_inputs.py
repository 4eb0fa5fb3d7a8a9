"""Writing a pipeline step's rows: speed, and memory flat in the number of rows.

A step that reads an earlier step writes the rows it will send (filtered with ``where``,
reshaped by ``preprocess``, multiplied by ``n``) before its job, batch by batch. This
script makes an earlier step's output (an ``annotations.parquet`` of N rows, as a job
writes it: id, response, the answer's bookkeeping, a schema field and a review text of
about 200 bytes), then writes the next step's rows from it with
``where = "sentiment == 'negative'"`` (half the rows), each size in a fresh process, and
prints the rows read per second and the process's peak RSS.

    python benchmarks/pipeline_inputs.py                 # 10^5 and 10^6 rows
    python benchmarks/pipeline_inputs.py --rows 100000 1000000 4000000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def make_output(path: Path, rows: int) -> None:
    """An earlier step's output of ``rows`` rows, written in row groups of 64k."""
    path.mkdir(parents=True, exist_ok=True)
    writer = None
    text = "The room was clean but the breakfast was cold and the staff seemed tired. " * 3
    for start in range(0, rows, 65536):
        count = min(65536, rows - start)
        ids = list(range(start, start + count))
        table = pa.table(
            {
                "id": ids,
                "response": ['{"sentiment": "negative"}' if i % 2 else "{}" for i in ids],
                "finish_reason": ["stop"] * count,
                "num_prompt_tokens": [60] * count,
                "num_output_tokens": [8] * count,
                "error": pa.nulls(count, pa.string()),
                "error_type": pa.nulls(count, pa.string()),
                "server": ["http://127.0.0.1:8000/v1"] * count,
                "model": ["small"] * count,
                "sentiment": ["negative" if i % 2 else "positive" for i in ids],
                "valid": [True] * count,
                "text": [f"{i} {text}" for i in ids],
            }
        )
        if writer is None:
            writer = pq.ParquetWriter(path / "annotations.parquet", table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def measure(upstream: Path, inputs: Path) -> dict[str, float]:
    """Write the next step's rows; the figures of this process."""
    from llm_annotator.pipeline import Step
    from llm_annotator.pipeline.inputs import write_input

    step = Step("reason", "Why: {text}", from_step="label", where="sentiment == 'negative'")
    started = time.perf_counter()
    written = write_input(step, inputs, upstream)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"read": written.read, "rows": written.rows, "seconds": seconds, "peak_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(Path(args.child[0]), Path(args.child[1]))))
        return
    print(f"{'rows read':>10} {'rows written':>13} {'seconds':>8} {'rows/s':>9} {'peak RSS':>9}")
    with tempfile.TemporaryDirectory(prefix="pipeline-inputs-") as scratch:
        for rows in args.rows:
            upstream = Path(scratch) / f"label-{rows}"
            make_output(upstream, rows)
            inputs = Path(scratch) / f"inputs-{rows}"
            done = subprocess.run(
                [sys.executable, __file__, "--child", str(upstream), str(inputs)],
                capture_output=True,
                text=True,
                check=True,
            )
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"{figures['read']:>10,.0f} {figures['rows']:>13,.0f} {figures['seconds']:>8.1f} "
                f"{figures['read'] / figures['seconds']:>9,.0f} {figures['peak_mb']:>6.0f} MB"
            )


if __name__ == "__main__":
    main()
