"""Reading a vLLM server's ``/metrics``: is its engine making progress?"""

from __future__ import annotations

import math

PROGRESS_COUNTERS = (
    b"vllm:prompt_tokens_total",
    b"vllm:generation_tokens_total",
    b"vllm:request_success_total",
)
"""Counters that grow whenever the engine does work: prompts read, tokens generated,
requests finished. An API server whose engine is hung keeps answering ``/metrics`` with
these standing still."""


def engine_progress(body: bytes) -> float | None:
    """The sum of the progress counters in a Prometheus text body, or None if it has
    none of them (not a vLLM server, or one whose metrics are off).

    Every series of a counter counts (one per engine and model label set).

    Examples:
        >>> engine_progress(b'# HELP x\\nvllm:generation_tokens_total{model_name="m"} 12.0\\n'
        ...                 b'vllm:request_success_total{finished_reason="stop"} 3\\n')
        15.0
        >>> engine_progress(b"<html>not metrics</html>") is None
        True
    """
    total = 0.0
    found = False
    for line in body.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        if b"{" in line:
            name, _, labelled = line.partition(b"{")
            fields = labelled.rpartition(b"}")[2].split()
        else:
            name, *fields = line.split()
        if name.strip() not in PROGRESS_COUNTERS or not fields:
            continue
        try:
            value = float(fields[0])  # a timestamp may follow the value
        except ValueError:
            continue
        if math.isfinite(value):
            total += value
            found = True
    return total if found else None
