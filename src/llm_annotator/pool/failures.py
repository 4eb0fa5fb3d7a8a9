"""What one failed request means for its sample and its member, decided without I/O.

Two tables, tested as such. The failure taxonomy: :func:`action_for` gives the pool's
:class:`Action` for each kind of failure, and small pure functions hold the pool's
thresholds (:func:`evicts`, :func:`gives_up_on_sample`). The steps: the settler
(:mod:`~llm_annotator.pool.settle`) gathers what it knows when a request fails
(:class:`Failure`: the kind of failure, the member's state, the sample's counts so far)
and carries out, in order, the :class:`Effect` values that :func:`settle` returns;
after the shared health check that a :data:`Effect.VERIFY` asks for, it does the same
with :func:`after_check`. No asyncio, no clock and no member object here; what a
member's failures count up to is kept in its :class:`~llm_annotator.pool.books.FaultBook`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from llm_annotator import _constants as default
from llm_annotator.errors import ErrorKind
from llm_annotator.pool.books import FaultBook as FaultBook  # re-exported: pool.policy had it

# -- the failure taxonomy: whose fault it is, and the pool's thresholds ----------------


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


# -- the steps the settler carries out for one failure --------------------------------


class Effect(Enum):
    """One step the settler carries out for a failed request of a sample."""

    BLAME = "blame"
    """Record the error as the member's last (it is the member's fault)."""
    REQUEUE = "requeue"
    """Put the sample back on the queue (no error row)."""
    VERIFY = "verify"
    """Hold the sample for the member's shared health check, then :func:`after_check`."""
    EVICT = "evict"
    """Evict the member; the sample counts as on it when it fell (requeued unless that
    makes it poison)."""
    DISABLE = "disable"
    """Take the member out for good (its settings are wrong)."""
    BACK_OFF = "back_off"
    """Pause the overloaded member and count the overload against the sample."""
    ERROR_ROW = "error_row"
    """End the sample with this error as its Response."""
    COUNT_SAMPLE_FAULT = "count_sample_fault"
    """Count a server-fault answer against the sample (it then avoids this member)."""
    COUNT_FAULT = "count_fault"
    """Count the answer against the member's streak of server faults."""
    EVICT_FOR_FAULTS = "evict_for_faults"
    """Evict the member for its streak; every sample of the streak counts as on it."""
    COUNT_EVICTION = "count_eviction"
    """The member was evicted after the request was sent: the sample counts as on it
    when it broke (requeued unless that makes it poison)."""
    COUNT_DROP = "count_drop"
    """Remember when a dropped connection was last counted against the member."""
    COUNT_RETRY = "count_retry"
    """Count a retry of the sample after a connect timeout on a healthy member."""
    PROVE = "prove"
    """Hold the sample for a test completion on the member, then :func:`after_proof`:
    it failed on every try while nothing else was answered, so either the sample or
    the server is at fault, and only a completion of another prompt tells which."""


@dataclass(frozen=True, slots=True)
class Limits:
    """The pool's thresholds that the decisions use."""

    max_sample_retries: int = default.MAX_SAMPLE_RETRIES
    max_server_faults: int = default.MAX_SERVER_FAULTS
    max_overload_requeues: int = default.MAX_OVERLOAD_REQUEUES


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Failure:
    """What the settler knows when a request of one sample failed.

    Counts include this failure, as if it were counted.

    Attributes:
        kind: How the request failed.
        member_working: The member is HEALTHY or DRAINING (not evicted or disabled
            since the request was sent).
        answered_since_sent: The member answered another request after this one was
            sent (so it is not hung).
        overloads: Overload answers the sample got, this one included.
        retries: Retries of the sample after connect timeouts, this one included.
        sample_faults: Server-fault answers the sample got, this one included.
        pool_answered_since_first_fault: Some sample succeeded after this sample's
            first server-fault answer.
        fault_streak: The member's server faults in a row, this one included (a
            sample counts once in a streak).
        hedged_copy_in_flight: A hedged copy of the sample is still in flight on
            another member.
        fresh_drop: The request was sent after the member's last counted dropped
            connection (so this drop is a new event, not the same reset).
        still_open: The sample has no Response yet (for :func:`after_check`).
    """

    kind: ErrorKind
    member_working: bool = True
    answered_since_sent: bool = False
    overloads: int = 1
    retries: int = 1
    sample_faults: int = 1
    pool_answered_since_first_fault: bool = False
    fault_streak: int = 1
    hedged_copy_in_flight: bool = False
    fresh_drop: bool = True
    still_open: bool = True


def settle(failure: Failure, limits: Limits = DEFAULT_LIMITS) -> tuple[Effect, ...]:
    """The steps for a request that failed, by whose fault it is.

    Examples:
        >>> settle(Failure(ErrorKind.CONNECT))
        (<Effect.EVICT: 'evict'>,)
        >>> settle(Failure(ErrorKind.BAD_REQUEST))
        (<Effect.ERROR_ROW: 'error_row'>,)
        >>> settle(Failure(ErrorKind.AUTH))
        (<Effect.REQUEUE: 'requeue'>, <Effect.DISABLE: 'disable'>)
    """
    action = action_for(failure.kind)
    if action is Action.TIMED_OUT:
        action = timeout_action(member_answering=failure.answered_since_sent)
    if action is Action.EVICT:
        return (Effect.EVICT,)
    if action is Action.VERIFY:
        # An evicted member has nothing left to verify.
        return (Effect.VERIFY,) if failure.member_working else (Effect.REQUEUE,)
    if action is Action.BACKOFF:
        ends = failure.overloads > limits.max_overload_requeues
        return (Effect.BACK_OFF, Effect.ERROR_ROW if ends else Effect.REQUEUE)
    if action is Action.SERVER_FAULT:
        return server_fault(failure, limits)
    if action is Action.DISABLE:
        return (Effect.REQUEUE, Effect.DISABLE)
    return (Effect.ERROR_ROW,)


def server_fault(
    failure: Failure,
    limits: Limits = DEFAULT_LIMITS,
    *,
    counts: bool = True,
) -> tuple[Effect, ...]:
    """The steps for an answer that was the member's fault: the sample goes elsewhere
    (or ends, once it has failed on every try while others succeed), and the member is
    evicted after ``max_server_faults`` in a row. ``counts`` is False for an event
    counted already (one reset that dropped many requests).

    Examples:
        >>> [e.value for e in server_fault(Failure(ErrorKind.MALFORMED))]
        ['blame', 'count_sample_fault', 'count_fault', 'requeue']
        >>> server_fault(Failure(ErrorKind.MALFORMED, hedged_copy_in_flight=True))
        (<Effect.BLAME: 'blame'>,)
    """
    if failure.hedged_copy_in_flight:
        return (Effect.BLAME,)  # its other copy is still on its way
    if not failure.member_working:
        # Sent before the member was evicted, answered after: it was on the member
        # when it broke, like the requests the eviction cancelled.
        return (Effect.BLAME, Effect.COUNT_SAMPLE_FAULT, Effect.COUNT_EVICTION)
    if not counts:
        return (Effect.BLAME, Effect.COUNT_SAMPLE_FAULT, Effect.REQUEUE)
    gives_up = gives_up_on_sample(
        failure.sample_faults,
        limits.max_sample_retries,
        pool_answered_since=failure.pool_answered_since_first_fault,
    )
    if gives_up:
        last = Effect.ERROR_ROW
    elif failure.sample_faults > limits.max_sample_retries:
        last = Effect.PROVE  # nothing else answered since: the sample, or the server?
    else:
        last = Effect.REQUEUE
    effects = [Effect.BLAME, Effect.COUNT_SAMPLE_FAULT, Effect.COUNT_FAULT, last]
    if evicts(failure.fault_streak, limits.max_server_faults):
        effects.append(Effect.EVICT_FOR_FAULTS)
    return tuple(effects)


def after_check(
    failure: Failure,
    healthy: bool,
    limits: Limits = DEFAULT_LIMITS,
) -> tuple[Effect, ...]:
    """The steps once the member's shared health check has answered ``healthy``.

    A member that fails it is evicted. On a healthy member, a dropped connection is
    the member's fault (it cuts answers off), counted once per reset; a connect timeout
    is more likely our own burst of connections: the sample is tried again, a bounded
    number of times, so a sample that always breaks its connection ends.

    Examples:
        >>> after_check(Failure(ErrorKind.DISCONNECTED), healthy=False)
        (<Effect.EVICT: 'evict'>,)
        >>> after_check(Failure(ErrorKind.CONNECT_TIMEOUT, retries=1), healthy=True)
        (<Effect.COUNT_RETRY: 'count_retry'>, <Effect.REQUEUE: 'requeue'>)
    """
    if not healthy:
        return (Effect.EVICT,)
    if not failure.still_open:
        return ()
    if fault_once_healthy(failure.kind):
        drop = (Effect.COUNT_DROP,) if failure.fresh_drop else ()
        return drop + server_fault(failure, limits, counts=failure.fresh_drop)
    ends = failure.retries > limits.max_sample_retries
    return (Effect.COUNT_RETRY, Effect.ERROR_ROW if ends else Effect.REQUEUE)


def after_proof(failure: Failure, works: bool) -> tuple[Effect, ...]:
    """The steps once the member's test completion (for :data:`Effect.PROVE`) has
    answered. A member that completes another prompt works: the sample is sent once
    more (the completion counts as an answer since its first fault, so if it fails
    again it ends as an error row, and a short burst of 5xx costs it nothing). A member
    that does not complete one is evicted (the sample counts as on it).

    Examples:
        >>> after_proof(Failure(ErrorKind.SERVER_ERROR), works=True)
        (<Effect.REQUEUE: 'requeue'>,)
        >>> after_proof(Failure(ErrorKind.SERVER_ERROR), works=False)
        (<Effect.EVICT: 'evict'>,)
    """
    if not failure.still_open:
        return ()
    if not works and failure.member_working:
        return (Effect.EVICT,)
    return (Effect.REQUEUE,)
