"""What the pool does with a failed request, and what a member's failures count up to.

Pure functions: the failure taxonomy and the pool's thresholds, decided from numbers the
pool hands in, tested with tables. The pool does the I/O; what a member's failures count
up to is kept in its :class:`~llm_annotator.pool.books.FaultBook`.
"""

from __future__ import annotations

from enum import Enum

from llm_annotator.errors import ErrorKind
from llm_annotator.pool.books import FaultBook as FaultBook  # re-exported: it was defined here


class Action(Enum):
    """The pool's answer to one failed request."""

    EVICT = "evict"
    """The server is gone: evict it, requeue the sample (no error row)."""
    VERIFY = "verify"
    """Hold the sample for a health check of the server: evict if it fails (the sample
    counts as on the server when it fell), else requeue the sample.

    A dropped connection is how a killed server looks, but also how a live server that
    cuts its answers off looks (:func:`fault_once_healthy`); a connect timeout is how a
    dead host looks, but also how thousands of connections opened at once by a busy
    client can look. One health check (shared by every sample that doubts the server)
    tells them apart within seconds, before the sample can carry its harm further."""
    BACKOFF = "backoff"
    """The server is overloaded: pause it a little, requeue the sample elsewhere."""
    SERVER_FAULT = "server_fault"
    """The server's fault (garbage, a 5xx, a cut-off body): send the sample to another
    member, count the failure against this one (a few in a row evict it)."""
    TIMED_OUT = "timed_out"
    """Past its deadline: the server's fault if the member has stopped answering
    anything (:func:`timeout_action`), else the sample's (it asks too much)."""
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
    ErrorKind.SERVER_ERROR: Action.SERVER_FAULT,
    ErrorKind.READ_TIMEOUT: Action.TIMED_OUT,
    ErrorKind.AUTH: Action.DISABLE,
    ErrorKind.NOT_FOUND: Action.DISABLE,
    ErrorKind.REDIRECT: Action.DISABLE,
    ErrorKind.BAD_REQUEST: Action.ERROR_ROW,
    ErrorKind.HTTP_ERROR: Action.ERROR_ROW,
    ErrorKind.MALFORMED: Action.SERVER_FAULT,
    ErrorKind.OVERSIZED: Action.SERVER_FAULT,
    ErrorKind.POISON: Action.ERROR_ROW,
    # Kinds of the job's own error rows (no client answers them): the sample's.
    ErrorKind.INPUT: Action.ERROR_ROW,
    ErrorKind.INVALID_OUTPUT: Action.ERROR_ROW,
    ErrorKind.TRUNCATED: Action.ERROR_ROW,
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
        >>> action_for(ErrorKind.MALFORMED)
        <Action.SERVER_FAULT: 'server_fault'>
        >>> action_for(ErrorKind.BAD_REQUEST)
        <Action.ERROR_ROW: 'error_row'>
    """
    return _ACTIONS[kind]


def fault_once_healthy(kind: ErrorKind) -> bool:
    """Whether a failure that :data:`Action.VERIFY` held for a health check is the
    server's fault when the server passes the check.

    A dropped connection on a server that still answers ``/health`` is the server's
    (it cuts its answers off), so it counts against the member like garbage. A connect
    timeout on such a server is more likely our own burst of new connections: the
    sample is only tried again, a bounded number of times.

    Examples:
        >>> fault_once_healthy(ErrorKind.DISCONNECTED), fault_once_healthy(ErrorKind.CONNECT_TIMEOUT)
        (True, False)
    """  # noqa: E501
    return kind is ErrorKind.DISCONNECTED


def timeout_action(*, member_answering: bool) -> Action:
    """What a request past its deadline means: if its member still answers other
    requests, the sample asked for more than the deadline allows (an error row);
    if the member answers nothing, the member is at fault.

    Examples:
        >>> timeout_action(member_answering=True)
        <Action.ERROR_ROW: 'error_row'>
        >>> timeout_action(member_answering=False)
        <Action.SERVER_FAULT: 'server_fault'>
    """
    return Action.ERROR_ROW if member_answering else Action.SERVER_FAULT


def evicts(fault_streak: int, max_server_faults: int) -> bool:
    """Whether a member with ``fault_streak`` server faults in a row is evicted.

    Examples:
        >>> [evicts(n, 3) for n in (1, 2, 3)]
        [False, False, True]
    """
    return fault_streak >= max_server_faults


def gives_up_on_sample(faults: int, max_resends: int, *, pool_answered_since: bool) -> bool:
    """Whether a sample that got ``faults`` server-fault answers becomes an error row.

    It does once it has been sent again ``max_resends`` times and still failed, but
    only if the pool has answered other samples since its first failure: then it is the
    sample that breaks servers. While nothing is answered (a 5xx storm, every member
    broken) it stays open: it is the servers, and a resumed job retries it. (So a sample
    is always sent again at least once: at its first failure nothing has been answered
    since yet, even with ``max_resends=0``.) A successful test completion of a member
    counts as an answer.

    Examples:
        >>> gives_up_on_sample(3, 2, pool_answered_since=True)
        True
        >>> gives_up_on_sample(3, 2, pool_answered_since=False)
        False
        >>> gives_up_on_sample(2, 2, pool_answered_since=True)
        False
    """
    return faults > max_resends and pool_answered_since
