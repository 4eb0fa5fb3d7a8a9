"""The built-in demo: local vLLM servers on the tiny model, a small dataset, a table.

``llm-annotator demo`` (and ``make demo``) runs it: it starts local servers, sends every
row of a built-in dataset to them at once, and prints a sample of the answers with the
run's figures. The tiny model has random weights, so the answers are noise; the point
is the path they take.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Sequence
from typing import TextIO

from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions
from llm_annotator.local import start_local_servers
from llm_annotator.pool import VLLMQueueAnnotator
from llm_annotator.response import Response

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


def demo_rows(count: int) -> list[str]:
    """``count`` short reviews, built from fixed parts (no download).

    Examples:
        >>> demo_rows(2)
        ['the film was a delight from start to end.', 'the film broke after two days.']
    """
    pairs = itertools.cycle(itertools.product(_SUBJECTS, _VERDICTS))
    return [f"{subject} {verdict}." for subject, verdict in itertools.islice(pairs, count)]


def _annotate(
    base_urls: Sequence[str], rows: Sequence[str], options: VLLMOnlineRuntimeOptions
) -> tuple[list[Response], VLLMQueueAnnotator]:
    conversations = [[{"role": "user", "content": PROMPT.format(text=row)}] for row in rows]
    with VLLMQueueAnnotator(list(base_urls), batch_size=64) as pool:
        return pool.batch_generate(messages=conversations, options=options), pool


def run_demo(
    *, num_servers: int = 2, num_rows: int = 400, out: TextIO, base_urls: Sequence[str] = ()
) -> int:
    """Annotate the built-in rows with local servers and print what happened.

    Args:
        num_servers: Local servers to start (when ``base_urls`` is empty).
        num_rows: Rows of the built-in dataset to annotate.
        out: Where the report goes.
        base_urls: Servers already running; none are started then.

    Returns:
        0 when every row was annotated, 1 otherwise.
    """
    rows = demo_rows(num_rows)
    # Sampled, not greedy: random weights pick the end token at once when greedy.
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=8, temperature=1.0, seed=0)
    servers = None
    if not base_urls:
        print(f"starting {num_servers} local vLLM servers on the tiny model...", file=out)
        started = time.monotonic()
        servers = start_local_servers(num_servers)
        base_urls = servers.base_urls
        print(f"  ready in {time.monotonic() - started:.1f} s: {', '.join(base_urls)}", file=out)
    try:
        started = time.monotonic()
        responses, pool = _annotate(base_urls, rows, options)
        elapsed = time.monotonic() - started
    finally:
        if servers is not None:
            servers.stop()
    ok = [r for r in responses if r.ok]
    output_tokens = sum(r.num_output_tokens or 0 for r in ok)
    print(f"\n{'row':>4}  {'review':<44} answer", file=out)
    for index in range(min(8, len(rows))):
        r = responses[index]
        answer = repr(r.text) if r.ok else f"ERROR {r.error_type}: {r.error}"
        print(f"{index:>4}  {rows[index]:<44} {answer[:60]}", file=out)
    print(
        f"\n{len(ok)}/{len(rows)} rows annotated in {elapsed:.1f} s "
        f"({len(rows) / elapsed:.0f} rows/s, {output_tokens / elapsed:.0f} output tokens/s)",
        file=out,
    )
    for member in pool.statistics().members:
        print(
            f"  {member.server}: {member.completed} rows, {member.evictions} evictions, "
            f"state {member.state}",
            file=out,
        )
    errors = Counter(r.error_type for r in responses if not r.ok)
    if errors:
        print(f"  errors: {dict(errors)}", file=out)
    return 0 if len(ok) == len(rows) else 1
