"""Reading a vLLM server's ``/metrics``: is its engine making progress, how loaded is it?"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

PROGRESS_COUNTERS = (
    b"vllm:prompt_tokens_total",
    b"vllm:generation_tokens_total",
    b"vllm:request_success_total",
)
"""Counters that grow whenever the engine does work: prompts read, tokens generated,
requests finished. An API server whose engine is hung keeps answering ``/metrics`` with
these standing still."""

RUNNING = b"vllm:num_requests_running"
WAITING = b"vllm:num_requests_waiting"
PREEMPTIONS = b"vllm:num_preemptions_total"
KV_CACHE = b"vllm:kv_cache_usage_perc"
PREFIX_QUERIES = (b"vllm:prefix_cache_queries_total", b"vllm:prefix_cache_queries")
PREFIX_HITS = (b"vllm:prefix_cache_hits_total", b"vllm:prefix_cache_hits")
"""Prompt tokens looked up in the prefix cache and found there (counters; a client
library may or may not add ``_total`` to the name)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """How loaded a vLLM server's engine is, from its ``/metrics`` gauges.

    Attributes:
        running: Requests in the engine's running batch (all its engines together).
        waiting: Requests queued in the server, waiting for a place in the batch.
        preemptions: Requests preempted so far (a counter), or None if not exported.
        kv_cache: Share of the KV cache in use, from 0 to 1 (the fullest engine), or
            None if not exported.
        prefix_cache_queries: Prompt tokens looked up in the prefix cache so far (a
            counter), or None if not exported.
        prefix_cache_hits: Of those, the tokens found there, or None.
    """

    running: float
    waiting: float
    preemptions: float | None = None
    kv_cache: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None


def _sums(body: bytes, names: Collection[bytes]) -> dict[bytes, list[float]]:
    """The finite values of every series of ``names`` in a Prometheus text body."""
    found: dict[bytes, list[float]] = {}
    for line in body.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        if b"{" in line:
            name, _, labelled = line.partition(b"{")
            fields = labelled.rpartition(b"}")[2].split()
        else:
            name, *fields = line.split()
        name = name.strip()
        if name not in names or not fields:
            continue
        try:
            value = float(fields[0])  # a timestamp may follow the value
        except ValueError:
            continue
        if math.isfinite(value):
            found.setdefault(name, []).append(value)
    return found


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
    found = _sums(body, PROGRESS_COUNTERS)
    return sum(sum(values) for values in found.values()) if found else None


def engine_load(body: bytes) -> EngineLoad | None:
    """The engine's load from a Prometheus text body, or None without the running and
    waiting gauges (not a vLLM server, or one whose metrics are off). Series of several
    engines (data parallel) add up; the KV cache is the fullest engine's.

    Examples:
        >>> engine_load(b'vllm:num_requests_running{engine="0"} 30.0\\n'
        ...             b'vllm:num_requests_waiting{engine="0"} 4.0\\n'
        ...             b'vllm:num_requests_waiting{engine="1"} 1.0\\n')
        EngineLoad(running=30.0, waiting=5.0, preemptions=None, kv_cache=None, \
prefix_cache_queries=None, prefix_cache_hits=None)
        >>> engine_load(b"vllm:generation_tokens_total 5\\n") is None
        True
    """
    found = _sums(body, (RUNNING, WAITING, PREEMPTIONS, KV_CACHE, *PREFIX_QUERIES, *PREFIX_HITS))
    if RUNNING not in found or WAITING not in found:
        return None
    preemptions = found.get(PREEMPTIONS)
    kv_cache = found.get(KV_CACHE)
    return EngineLoad(
        running=sum(found[RUNNING]),
        waiting=sum(found[WAITING]),
        preemptions=sum(preemptions) if preemptions else None,
        kv_cache=max(kv_cache) if kv_cache else None,
        prefix_cache_queries=_total(found, PREFIX_QUERIES),
        prefix_cache_hits=_total(found, PREFIX_HITS),
    )


def _total(found: dict[bytes, list[float]], names: tuple[bytes, ...]) -> float | None:
    """The sum of the first of ``names`` found (one counter under either name)."""
    for name in names:
        if name in found:
            return sum(found[name])
    return None
