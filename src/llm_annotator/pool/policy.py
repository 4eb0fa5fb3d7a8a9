"""What the pool does with a failed request: the failure taxonomy as a pure function."""

from __future__ import annotations

from enum import Enum

from llm_annotator.errors import ErrorKind


class Action(Enum):
    """The pool's answer to one failed request."""

    EVICT = "evict"
    """The server is gone: evict it, requeue the sample (no error row)."""
    VERIFY = "verify"
    """Evict if the server fails a health check, else requeue the sample.

    A dropped connection is how a killed server looks, but also how a keep-alive
    connection closed by a live server at the wrong moment looks; a connect timeout is
    how a dead host looks, but also how thousands of connections opened at once by a
    busy client can look. One health check (shared by every sample that doubts the
    server) tells them apart within seconds."""
    BACKOFF = "backoff"
    """The server is overloaded: pause it a little, requeue the sample elsewhere."""
    RETRY = "retry"
    """Transient: requeue the sample after a jittered delay, a bounded number of times."""
    CHECK_HEALTH = "check_health"
    """Slow or hung: evict if the server fails a health check, else an error row."""
    DISABLE = "disable"
    """Configuration error (auth, unknown model, TLS, a redirect to elsewhere): take
    the server out for good, requeue the sample."""
    ERROR_ROW = "error_row"
    """This sample is at fault: keep the error as its result."""


_ACTIONS = {
    ErrorKind.CONNECT: Action.EVICT,
    ErrorKind.CONNECT_TIMEOUT: Action.VERIFY,
    ErrorKind.TLS: Action.DISABLE,
    ErrorKind.DISCONNECTED: Action.VERIFY,
    ErrorKind.ENGINE_DEAD: Action.EVICT,
    ErrorKind.OVERLOADED: Action.BACKOFF,
    ErrorKind.SERVER_ERROR: Action.RETRY,
    ErrorKind.READ_TIMEOUT: Action.CHECK_HEALTH,
    ErrorKind.AUTH: Action.DISABLE,
    ErrorKind.NOT_FOUND: Action.DISABLE,
    ErrorKind.REDIRECT: Action.DISABLE,
    ErrorKind.BAD_REQUEST: Action.ERROR_ROW,
    ErrorKind.HTTP_ERROR: Action.ERROR_ROW,
    ErrorKind.MALFORMED: Action.ERROR_ROW,
    ErrorKind.OVERSIZED: Action.ERROR_ROW,
    ErrorKind.POISON: Action.ERROR_ROW,
}


CONFIGURATION_KINDS = frozenset(
    {ErrorKind.AUTH, ErrorKind.TLS, ErrorKind.REDIRECT, ErrorKind.NOT_FOUND}
)
"""Failures that waiting does not fix: the settings (key, CA bundle, URL) must change."""


def action_for(kind: ErrorKind) -> Action:
    """The pool's action for a request that failed with ``kind``.

    Examples:
        >>> action_for(ErrorKind.CONNECT)
        <Action.EVICT: 'evict'>
        >>> action_for(ErrorKind.BAD_REQUEST)
        <Action.ERROR_ROW: 'error_row'>
    """
    return _ACTIONS[kind]
