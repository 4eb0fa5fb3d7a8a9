"""``llm-annotator report RUN_DIR``: the run drawn into one HTML file to look at."""

from __future__ import annotations

import argparse


def _report(args: argparse.Namespace) -> int:
    import logging  # here: --help loads no job layer

    import structlog

    from llm_annotator.jobs.run_report import write_html_report
    from llm_annotator.pipeline.report import is_pipeline, write_pipeline_report

    # Reading a shard that a job is writing may meet a half-written last line: no warning.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    if is_pipeline(args.run_dir):
        path = write_pipeline_report(args.run_dir, args.output)
    else:
        path = write_html_report(args.run_dir, args.output)
    print(f"report: {path}")
    return 0


def add_report(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator report`` on its parser."""
    parser.description = (
        "Read a run directory (finished, interrupted, or still running) and write one "
        "self-contained HTML file: throughput over time overall and per server with "
        "evictions and re-admissions marked, the time per row by server, error rows by "
        "type over time, the progress and its tail, and a summary of the run. It needs "
        "no network to open. The plots need matplotlib: pip install "
        "'llm-annotator[report]'."
    )
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="the job's --output-dir, or a pipeline's output_dir (every step on one page)",
    )
    parser.add_argument(
        "--output", metavar="FILE", default=None, help="where to write it (RUN_DIR/report.html)"
    )
    parser.set_defaults(handler=_report)
