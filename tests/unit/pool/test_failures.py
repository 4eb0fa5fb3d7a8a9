"""The pool's decisions for a failed request: pure functions, tested with tables.

Each row is one situation (what failed, what the member and the sample have been
through) and the steps the dispatcher must carry out, in order. The pool tests in
``test_bad_servers.py`` and the fault tests show the same decisions on live servers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from llm_annotator import ErrorKind
from llm_annotator.pool.failures import (
    Effect,
    Failure,
    Limits,
    after_check,
    after_proof,
    settle,
)

E = Effect
LIMITS = Limits(max_sample_retries=2, max_server_faults=3, max_overload_requeues=50)
SERVER_FAULT = (E.BLAME, E.COUNT_SAMPLE_FAULT, E.COUNT_FAULT, E.REQUEUE)


@pytest.mark.parametrize(
    ("failure", "effects"),
    [
        # The server is gone: evict, the sample is requeued by the eviction.
        (Failure(ErrorKind.CONNECT), (E.EVICT,)),
        (Failure(ErrorKind.ENGINE_DEAD), (E.EVICT,)),
        # A drop or a connect timeout: one shared health check decides.
        (Failure(ErrorKind.DISCONNECTED), (E.VERIFY,)),
        (Failure(ErrorKind.CONNECT_TIMEOUT), (E.VERIFY,)),
        # ... unless the member is out already: nothing to verify.
        (Failure(ErrorKind.DISCONNECTED, member_working=False), (E.REQUEUE,)),
        # Overloaded: pause the member, requeue; the 51st overload ends the sample.
        (Failure(ErrorKind.OVERLOADED, overloads=1), (E.BACK_OFF, E.REQUEUE)),
        (Failure(ErrorKind.OVERLOADED, overloads=50), (E.BACK_OFF, E.REQUEUE)),
        (Failure(ErrorKind.OVERLOADED, overloads=51), (E.BACK_OFF, E.ERROR_ROW)),
        # Settings that waiting cannot fix: disable the member, the sample goes on.
        (Failure(ErrorKind.AUTH), (E.REQUEUE, E.DISABLE)),
        (Failure(ErrorKind.TLS), (E.REQUEUE, E.DISABLE)),
        (Failure(ErrorKind.NOT_FOUND), (E.REQUEUE, E.DISABLE)),
        (Failure(ErrorKind.REDIRECT), (E.REQUEUE, E.DISABLE)),
        # The sample's fault: an error row, the member is not blamed.
        (Failure(ErrorKind.BAD_REQUEST), (E.ERROR_ROW,)),
        (Failure(ErrorKind.HTTP_ERROR), (E.ERROR_ROW,)),
        # The server's fault: blamed, counted, the sample sent elsewhere.
        (Failure(ErrorKind.MALFORMED), SERVER_FAULT),
        (Failure(ErrorKind.OVERSIZED), SERVER_FAULT),
        (Failure(ErrorKind.SERVER_ERROR), SERVER_FAULT),
        # A timeout on a member that answered others meanwhile: the sample asks too much.
        (Failure(ErrorKind.READ_TIMEOUT, answered_since_sent=True), (E.ERROR_ROW,)),
        # ... on a member that answered nothing since: the member's fault.
        (Failure(ErrorKind.READ_TIMEOUT, answered_since_sent=False), SERVER_FAULT),
    ],
)
def test_what_a_failed_request_leads_to(failure: Failure, effects: tuple[Effect, ...]) -> None:
    assert settle(failure, LIMITS) == effects


@pytest.mark.parametrize(
    ("changes", "effects"),
    [
        # The third fault in a row evicts; the sample still goes elsewhere.
        ({"fault_streak": 2}, SERVER_FAULT),
        ({"fault_streak": 3}, (*SERVER_FAULT, E.EVICT_FOR_FAULTS)),
        # A sample that failed past its resends while others succeed: an error row.
        (
            {"sample_faults": 3, "pool_answered_since_first_fault": True},
            (E.BLAME, E.COUNT_SAMPLE_FAULT, E.COUNT_FAULT, E.ERROR_ROW),
        ),
        # The same while nothing else is answered (a storm, or the last sample on a
        # member): a test completion on the member tells which is at fault.
        (
            {"sample_faults": 3, "pool_answered_since_first_fault": False},
            (E.BLAME, E.COUNT_SAMPLE_FAULT, E.COUNT_FAULT, E.PROVE),
        ),
        ({"sample_faults": 2, "pool_answered_since_first_fault": True}, SERVER_FAULT),
        # Its error row and the member's eviction, both at once.
        (
            {"sample_faults": 3, "pool_answered_since_first_fault": True, "fault_streak": 3},
            (E.BLAME, E.COUNT_SAMPLE_FAULT, E.COUNT_FAULT, E.ERROR_ROW, E.EVICT_FOR_FAULTS),
        ),
        # A hedged copy is still in flight elsewhere: wait for it, count nothing.
        ({"hedged_copy_in_flight": True, "fault_streak": 3}, (E.BLAME,)),
        # The member was evicted after the request went out: the sample was on it.
        ({"member_working": False}, (E.BLAME, E.COUNT_SAMPLE_FAULT, E.COUNT_EVICTION)),
    ],
)
def test_a_server_fault(changes: dict[str, object], effects: tuple[Effect, ...]) -> None:
    failure = replace(Failure(ErrorKind.MALFORMED), **changes)  # type: ignore[arg-type]
    assert settle(failure, LIMITS) == effects


@pytest.mark.parametrize(
    ("failure", "healthy", "effects"),
    [
        # A failed health check evicts, whatever the failure was.
        (Failure(ErrorKind.DISCONNECTED), False, (E.EVICT,)),
        (Failure(ErrorKind.CONNECT_TIMEOUT), False, (E.EVICT,)),
        # Answered meanwhile (a hedged copy, say): nothing left to do.
        (Failure(ErrorKind.DISCONNECTED, still_open=False), True, ()),
        # A drop on a healthy server is its fault, counted once per reset.
        (Failure(ErrorKind.DISCONNECTED, fresh_drop=True), True, (E.COUNT_DROP, *SERVER_FAULT)),
        (
            Failure(ErrorKind.DISCONNECTED, fresh_drop=False, fault_streak=3),
            True,
            (E.BLAME, E.COUNT_SAMPLE_FAULT, E.REQUEUE),
        ),
        (
            Failure(ErrorKind.DISCONNECTED, fault_streak=3),
            True,
            (E.COUNT_DROP, *SERVER_FAULT, E.EVICT_FOR_FAULTS),
        ),
        # A connect timeout on a healthy server: tried again, then an error row.
        (Failure(ErrorKind.CONNECT_TIMEOUT, retries=2), True, (E.COUNT_RETRY, E.REQUEUE)),
        (Failure(ErrorKind.CONNECT_TIMEOUT, retries=3), True, (E.COUNT_RETRY, E.ERROR_ROW)),
    ],
)
def test_after_the_shared_health_check(
    failure: Failure, healthy: bool, effects: tuple[Effect, ...]
) -> None:
    assert after_check(failure, healthy, LIMITS) == effects


def test_every_kind_has_a_decision() -> None:
    """No failure kind falls through: each gives at least one step, and each either
    ends the sample, puts it back, or holds it for a check (nothing is lost)."""
    keeps = {E.REQUEUE, E.ERROR_ROW, E.EVICT, E.VERIFY, E.COUNT_EVICTION}
    for kind in ErrorKind:
        for answered in (False, True):
            effects = settle(Failure(kind, answered_since_sent=answered), LIMITS)
            assert keeps & set(effects), (kind, effects)


@pytest.mark.parametrize(
    ("failure", "works", "effects"),
    [
        # The member completes another prompt: the sample is sent once more (its next
        # fault ends it, as the completion counts as an answer since its first).
        (Failure(ErrorKind.SERVER_ERROR), True, (E.REQUEUE,)),
        (Failure(ErrorKind.DISCONNECTED), True, (E.REQUEUE,)),
        (Failure(ErrorKind.SERVER_ERROR, member_working=False), True, (E.REQUEUE,)),
        # It does not: the member is at fault and goes; the sample was on it.
        (Failure(ErrorKind.SERVER_ERROR), False, (E.EVICT,)),
        # ... evicted already meanwhile: the sample goes back on the queue.
        (Failure(ErrorKind.SERVER_ERROR, member_working=False), False, (E.REQUEUE,)),
        # Answered meanwhile (a hedged copy): nothing left to do.
        (Failure(ErrorKind.SERVER_ERROR, still_open=False), True, ()),
        (Failure(ErrorKind.SERVER_ERROR, still_open=False), False, ()),
    ],
)
def test_after_a_test_completion(
    failure: Failure, works: bool, effects: tuple[Effect, ...]
) -> None:
    assert after_proof(failure, works) == effects


def test_every_effect_has_one_step_that_carries_it_out() -> None:
    """The settler carries out each Effect the failure rules may decide; a new Effect with
    no step would be skipped silently."""
    from llm_annotator.pool.effects import Effects
    from llm_annotator.pool.health import HealthMonitor
    from llm_annotator.pool.queue import QueuePool
    from llm_annotator.pool.settle import Settler

    pool = QueuePool(["http://127.0.0.1:9/v1"], model="m")
    state = pool._state
    settler = Settler(state, Effects(state), HealthMonitor(state, Effects(state)))
    assert set(settler._steps) == set(Effect)
    pool.close()
