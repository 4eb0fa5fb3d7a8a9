"""When to retry a failed request, and how long to wait first: pure functions."""

from __future__ import annotations

import random

from llm_annotator._constants import RETRY_INITIAL_DELAY, RETRY_MAX_DELAY
from llm_annotator.errors import ErrorKind


def should_retry(kind: ErrorKind, attempt: int, max_retries: int) -> bool:
    """Whether a request that failed with ``kind`` on try ``attempt`` (0-based) goes again.

    Examples:
        >>> should_retry(ErrorKind.CONNECT, 0, 2)
        True
        >>> should_retry(ErrorKind.CONNECT, 2, 2)
        False
        >>> should_retry(ErrorKind.BAD_REQUEST, 0, 2)
        False
    """
    return attempt < max_retries and kind.retryable


def retry_delay(
    attempt: int,
    *,
    initial: float = RETRY_INITIAL_DELAY,
    maximum: float = RETRY_MAX_DELAY,
    jitter: float | None = None,
) -> float:
    """Seconds to wait before retry number ``attempt + 1``.

    The delay doubles from ``initial`` up to ``maximum``; up to a quarter of it is taken
    off at random, so many requests failing together do not come back together.

    Args:
        attempt: How many tries have failed before this wait, minus one (0-based).
        initial: The first delay.
        maximum: The cap.
        jitter: A number in [0, 1) that picks the reduction; random when None.

    Examples:
        >>> [retry_delay(a, jitter=0.0) for a in range(6)]
        [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
        >>> retry_delay(0, jitter=0.99) >= 0.375
        True
    """
    base = min(maximum, initial * 2.0 ** max(0, attempt))
    fraction = random.random() if jitter is None else jitter
    return base * (1.0 - 0.25 * fraction)
