"""A member's life: every transition method from every state, against the graph."""

from __future__ import annotations

import re

import pytest

from llm_annotator import VLLMOnlineClient
from llm_annotator.pool.member import Member, MemberState

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
    member.note_fault()
    member.back_off(100.0, lambda attempt: 2.0)
    assert not member.takes_work(101.0) and member.takes_work(102.0)
    assert member.evict("gone") and member.evictions == 1 and member.last_error == "gone"
    assert member.admit() is True and member.readmissions == 1
    assert (member.fault_streak, member.overload_streak, member.backoff_until) == (0, 0, 0.0)
    assert member.note_probe(False) == 1 and member.note_probe(False) == 2
    assert member.note_probe(True) == 0


def test_a_fault_streak_counts_samples_not_answers() -> None:
    """A sample that fails again on its retry counts once in the streak (it is as much
    evidence against itself as against the server); a good answer ends the streak."""
    member = member_in(S.JOINING)
    member.admit()
    assert member.streak_with(5) == 1
    assert member.note_fault(5) == 1
    assert member.note_fault(5) == 1  # the same sample again
    assert member.streak_with(5) == 1 and member.streak_with(6) == 2
    assert member.note_fault(6) == 2
    assert member.fault_samples == [5, 6]
    member.note_answer()
    assert (member.fault_streak, member.fault_samples, member.streak_with(5)) == (0, [], 1)
