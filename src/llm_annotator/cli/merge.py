"""``llm-annotator merge RUN_DIR``: a sharded job's shards, into one output."""

from __future__ import annotations

import argparse


def _merge(args: argparse.Namespace) -> int:
    from llm_annotator.jobs.shards.merge import merge  # here: --help loads no job layer

    merged = merge(args.run_dir, jsonl=args.jsonl)
    result = merged.result
    print(
        f"annotations: {merged.output_path} ({result.num_rows} rows from {merged.shards} "
        f"shards: {result.num_succeeded} answered, {result.num_failed} failed)"
    )
    print(f"report: {merged.report_path}")
    return 0


def add_merge(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator merge`` on its parser."""
    parser.description = (
        "Check that every shard of a sharded run directory finished with all its "
        "rows, then consolidate them into RUN_DIR/annotations.parquet (one row per "
        "id) and RUN_DIR/report.json. Names the shards that are missing, running or "
        "incomplete, and what to run, instead. The last shard to finish does this "
        "by itself."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the sharded job's --output-dir")
    parser.add_argument("--jsonl", action="store_true", help="also write annotations.jsonl")
    parser.set_defaults(handler=_merge)
