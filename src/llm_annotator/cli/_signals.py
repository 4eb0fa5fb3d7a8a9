"""SIGINT and SIGTERM for the subcommands that hold local servers."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class Interrupted(BaseException):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """Turn the first SIGINT or SIGTERM into :class:`Interrupted` while the block runs.

    Later ones are ignored, so that a second Ctrl-C cannot cut the shutdown short.
    """
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if not received:
            received.append(signum)
            raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM while the block runs (a shutdown in progress)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
