"""How a run ended: one rule for ``status.json`` and the timeline.

Examples:
    >>> import asyncio
    >>> outcome(None)
    ('finished', None)
    >>> outcome(asyncio.CancelledError()), outcome(KeyboardInterrupt())
    (('interrupted', None), ('interrupted', None))
    >>> outcome(OSError(28, "No space left on device"))
    ('failed', '[Errno 28] No space left on device')
"""

from __future__ import annotations

import asyncio

from llm_annotator.errors import RunInterruptedError

ENDINGS = ("finished", "interrupted", "failed")
"""The ways a run ends."""

INTERRUPTIONS = (RunInterruptedError, asyncio.CancelledError, KeyboardInterrupt)
"""What stops a run from outside (a signal, a cancelled task, Ctrl-C): the run is
``interrupted``, resumable, and nothing is wrong with it."""


def outcome(failure: BaseException | None) -> tuple[str, str | None]:
    """How a run ended that raised ``failure`` (None: it returned), and the error to
    show for a ``failed`` one."""
    if failure is None:
        return "finished", None
    if isinstance(failure, INTERRUPTIONS):
        return "interrupted", None
    return "failed", str(failure) or type(failure).__name__
