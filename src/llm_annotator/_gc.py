"""Fewer full garbage collections while many requests are in flight.

With thousands of requests in flight, each one's objects (coroutines, loop handles,
connection state) live long enough to reach the collector's oldest generation, so
CPython's default thresholds run a full collection every thousand or so requests, each
over hundreds of thousands of live objects: measured at 4,096 in flight, more than half
of the process's CPU went to collections that freed almost nothing
(benchmarks/annotate_overhead.py). While a call runs, the oldest generation is
collected ten times less often; the thresholds are restored when the last call ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_OLDEST_THRESHOLD = 100
"""Collections of the middle generation between two full ones (CPython's default: 10)."""

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, ...] = ()


@contextlib.contextmanager
def fewer_full_collections() -> Iterator[None]:
    """Raise the oldest generation's threshold for the duration of the block.

    Nested and concurrent blocks share one change; a threshold the user set higher is
    kept.

    Examples:
        >>> before = gc.get_threshold()
        >>> with fewer_full_collections():
        ...     gc.get_threshold()[2] >= 100
        True
        >>> gc.get_threshold() == before
        True
    """
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            first, middle, oldest = (*_saved, 10, 10)[:3]
            gc.set_threshold(first, middle, max(oldest, _OLDEST_THRESHOLD))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.set_threshold(*_saved)
