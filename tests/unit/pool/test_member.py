"""A member's life: every transition method from every state, against the graph."""

from __future__ import annotations

import importlib
import re

import pytest

from llm_annotator import VLLMOnlineClient
from llm_annotator.pool.health import SERVED_WELL
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member

S = MemberState
# method -> the states it may start from, and where it leads. A method from any other
# state either refuses (RuntimeError: a pool bug) or, for evict, changes nothing.
ALLOWED = {
    "admit": ({S.JOINING, S.EVICTED}, S.HEALTHY),
    "mark_down": ({S.JOINING}, S.EVICTED),
    "evict": ({S.HEALTHY, S.DRAINING}, S.EVICTED),
    "disable": ({S.JOINING, S.HEALTHY, S.EVICTED, S.DRAINING, S.DISABLED}, S.DISABLED),
    "drain": ({S.JOINING, S.HEALTHY, S.EVICTED, S.DISABLED, S.DRAINING}, S.DRAINING),
}


def member_in(state: MemberState) -> Member:
    member = Member(VLLMOnlineClient(model="m", base_url="http://127.0.0.1:9/v1"))
    member.state = state  # set directly: the state under test, whatever led to it
    return member


def call(member: Member, method: str) -> bool:
    if method in ("mark_down", "evict", "disable"):
        return bool(getattr(member, method)("reason"))
    return bool(getattr(member, method)())


@pytest.mark.parametrize("start", list(MemberState), ids=lambda s: s.value)
@pytest.mark.parametrize("method", list(ALLOWED))
def test_each_method_from_each_state(method: str, start: MemberState) -> None:
    """A transition method leads where the graph says from the states it allows, and
    from any other state refuses (or, for evict, leaves the member as it was)."""
    sources, target = ALLOWED[method]
    member = member_in(start)
    if start in sources:
        changed = call(member, method)
        assert member.state is target
        if method in ("evict", "disable", "drain"):  # admit says rejoined, not changed
            assert changed is (start is not target)
    elif method == "evict":
        assert call(member, method) is False
        assert member.state is start
    else:
        with pytest.raises(RuntimeError, match=re.escape("member http://127.0.0.1:9/v1")):
            call(member, method)


def test_counters_follow_the_transitions() -> None:
    """An eviction counts; the next admission counts as a readmission and clears the
    streaks; a first admission is a join, not a readmission."""
    member = member_in(S.JOINING)
    assert member.admit() is False and member.readmissions == 0
    member.faults.note_fault()
    member.faults.back_off(100.0, lambda attempt: 2.0)
    assert not member.takes_work(101.0) and member.takes_work(102.0)
    assert member.evict("gone") and member.evictions == 1 and member.last_error == "gone"
    assert member.admit() is True and member.readmissions == 1
    faults = member.faults
    assert (faults.fault_streak, faults.overload_streak, faults.backoff_until) == (0, 0, 0.0)
    assert member.health.probe(False) == 1 and member.health.probe(False) == 2
    assert member.health.probe(True) == 0


def test_a_fault_streak_counts_samples_not_answers() -> None:
    """A sample that fails again on its retry counts once in the streak (it is as much
    evidence against itself as against the server); a good answer ends the streak."""
    member = member_in(S.JOINING)
    member.admit()
    faults = member.faults
    assert faults.streak_with(5) == 1
    assert faults.note_fault(5) == 1
    assert faults.note_fault(5) == 1  # the same sample again
    assert faults.streak_with(5) == 1 and faults.streak_with(6) == 2
    assert faults.note_fault(6) == 2
    assert faults.fault_samples == [5, 6]
    member.note_answer()
    assert (faults.fault_streak, faults.fault_samples, faults.streak_with(5)) == (0, [], 1)


def test_a_member_keeps_each_concern_in_a_book_of_the_books_module() -> None:
    """A member holds its identity, its state, what it holds and its public counters;
    what stall detection, the window, the health checks, the failure rules and the
    prefix cache count of it lives in one book each, defined in the leaf
    ``pool.books`` and still importable from the concern's module that writes it."""
    member = member_in(S.JOINING)
    books = {
        "stall": "llm_annotator.pool.stall",
        "window": "llm_annotator.pool.window",
        "health": "llm_annotator.pool.health",
        "faults": "llm_annotator.pool.failures",
        "prefix_cache": "llm_annotator.pool.affinity",
    }
    for name, module in books.items():
        book = type(getattr(member, name))
        assert book.__module__ == "llm_annotator.pool.books"
        assert getattr(importlib.import_module(module), book.__name__) is book
    fields = set(vars(member))
    assert fields - set(books) == {
        *("client", "url", "state", "in_flight", "suspects", "on_move", "last_error"),
        *("completed", "errors", "evictions", "readmissions", "requeued", "hedged"),
    }


def test_an_admission_starts_the_books_afresh_and_an_eviction_is_on_the_health_record() -> None:
    member = member_in(S.JOINING)
    member.admit()
    member.faults.note_fault(3)
    member.health.probe(False)
    member.health.failed_canaries = 2
    assert member.evict("gone") and member.health.eviction_streak == 1
    assert member.health.failed_probes == 0
    member.admit()
    assert (member.faults.fault_streak, member.health.failed_canaries) == (0, 0)
    for _ in range(SERVED_WELL):  # good answers clear the record of evictions
        member.note_answer()
    assert member.health.eviction_streak == 0


def test_a_member_serves_its_clients_model_or_the_one_its_server_lists() -> None:
    """``member.model`` is the model its client was given; for a client given none, the
    model its server lists (``note_model``) is what the client asks for from then on."""
    given = member_in(S.JOINING)
    assert given.model == given.client.model == "m"
    bare = Member(VLLMOnlineClient(base_url="http://127.0.0.1:9/v1"))
    assert bare.model is None
    bare.note_model("listed")
    assert bare.model == bare.client.model == "listed"
