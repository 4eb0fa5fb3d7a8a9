"""The built-in demo: local vLLM servers on the tiny model, a small dataset, a table.

``llm-annotator demo`` (and ``make demo``) runs it: it starts local servers, annotates a
built-in dataset through them into a run directory, and prints a sample of the output
rows with the run's figures. The tiny model has random weights, so the answers are noise; the point
is the path they take.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import orjson
import pyarrow.parquet as pq

from llm_annotator.cli._signals import Interrupted, signals_interrupt
from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions
from llm_annotator.errors import ConfigurationError
from llm_annotator.local import start_local_servers
from llm_annotator.pool import VLLMQueueAnnotator

_SUBJECTS = ("the film", "this phone", "the hotel", "our waiter", "the update", "that book")
_VERDICTS = (
    "was a delight from start to end",
    "broke after two days",
    "felt overpriced but fine",
    "exceeded every expectation",
    "was slow and confusing",
    "is exactly what I needed",
)

PROMPT = "Classify the sentiment of this review as positive or negative: {text}"

SENTIMENT_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["positive", "negative"]}},
    "required": ["label"],
    "additionalProperties": False,
}
"""The answer the labelled reviews are annotated with."""


def labelled_reviews() -> list[dict[str, Any]]:
    """The bundled labelled sample: 100 short reviews of shops, films, hotels, gadgets
    and the like, half positive and half negative, each with its gold ``label``.

    Examples:
        >>> rows = labelled_reviews()
        >>> len(rows), rows[1]
        (100, {'id': 1, 'text': 'The food was awful and cold.', 'label': 'negative'})
    """
    data = resources.files("llm_annotator.cli").joinpath("data", "reviews.jsonl")
    return [orjson.loads(line) for line in data.read_bytes().splitlines() if line]


def demo_rows(count: int) -> list[str]:
    """``count`` short reviews, built from fixed parts (no download).

    Examples:
        >>> demo_rows(2)
        ['the film was a delight from start to end.', 'the film broke after two days.']
    """
    pairs = itertools.cycle(itertools.product(_SUBJECTS, _VERDICTS))
    return [f"{subject} {verdict}." for subject, verdict in itertools.islice(pairs, count)]


def run_demo(
    *,
    num_servers: int = 2,
    num_rows: int = 400,
    out: TextIO,
    base_urls: Sequence[str] = (),
    output_dir: str | Path | None = None,
) -> int:
    """Annotate the built-in rows with local servers and print what happened.

    Args:
        num_servers: Local servers to start (when ``base_urls`` is empty).
        num_rows: Rows of the built-in dataset to annotate.
        out: Where the report goes.
        base_urls: Servers already running; none are started then.
        output_dir: The run directory; a new temporary one by default.

    Returns:
        0 when every row was annotated, 1 otherwise.
    """
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
        raise ConfigurationError(f"--rows must be a positive number of rows, got {num_rows!r}")
    rows = [{"text": text} for text in demo_rows(num_rows)]
    # Sampled, not greedy: random weights pick the end token at once when greedy. No
    # seed: vLLM's CPU build kills its engine on seeded requests under load.
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=8, temperature=1.0)
    if output_dir is None:
        output_dir = Path(tempfile.mkdtemp(prefix="llm-annotator-demo-"))
    servers = None
    if not base_urls:
        print(f"starting {num_servers} local vLLM servers on the tiny model...", file=out)
        started = time.monotonic()
        servers = start_local_servers(num_servers)
    try:
        if servers is not None:
            base_urls = servers.base_urls
            ready = time.monotonic() - started
            print(f"  ready in {ready:.1f} s: {', '.join(base_urls)}", file=out)
        with VLLMQueueAnnotator(list(base_urls), batch_size=64) as pool:
            result = pool.annotate(rows, PROMPT, output_dir, options=options)
            members = pool.statistics().members
    finally:
        if servers is not None:
            servers.stop()
    table = pq.read_table(result.output_path).to_pylist()
    print(f"\n{'id':>4}  {'text':<44} response", file=out)
    for row in table[:8]:
        answer = repr(row["response"]) if not row["error"] else f"ERROR {row['error_type']}"
        print(f"{row['id']:>4}  {row['text']:<44} {answer[:60]}", file=out)
    report = orjson.loads(result.report_path.read_bytes())
    this_run = report["this_run"]
    print(
        f"\n{result.num_succeeded}/{result.num_rows} rows annotated in {result.seconds:.1f} s "
        f"({this_run['rows_per_second']:.0f} rows/s, "
        f"{this_run['output_tokens_per_second']:.0f} output tokens/s)",
        file=out,
    )
    for member in members:
        print(
            f"  {member.server}: {member.completed} rows, {member.evictions} evictions, "
            f"state {member.state}",
            file=out,
        )
    if report["by_error_type"]:
        print(f"  errors: {report['by_error_type']}", file=out)
    print(f"\nannotations: {result.output_path}\nreport:      {result.report_path}", file=out)
    return 0 if result.num_succeeded == len(rows) else 1


def _demo(args: argparse.Namespace) -> int:
    # SIGTERM as SIGINT: the servers the demo started are stopped on the way out, not
    # left running (the job inside installs its own handlers while it runs).
    with signals_interrupt():
        try:
            return run_demo(
                num_servers=args.num_servers,
                num_rows=args.rows,
                out=sys.stdout,
                base_urls=args.servers,
                output_dir=args.output_dir,
            )
        except Interrupted as interrupted:
            print(
                f"llm-annotator demo: stopped by {signal.Signals(interrupted.signum).name}",
                file=sys.stderr,
            )
            return 128 + interrupted.signum


def add_demo(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="annotate a built-in dataset with local vLLM servers on the tiny model",
        description=(
            "Start local vLLM servers on the tiny model (or use --servers), send a built-in "
            "dataset through the pool, and print a sample of the answers and the figures."
        ),
    )
    parser.add_argument("--num-servers", type=int, default=2, help="default: 2")
    parser.add_argument("--rows", type=int, default=2000, help="rows to annotate (default 2000)")
    parser.add_argument(
        "--servers", nargs="+", default=[], metavar="URL", help="use running servers instead"
    )
    parser.add_argument(
        "--output-dir", default=None, help="run directory (default: a new temporary one)"
    )
    parser.set_defaults(handler=_demo)
