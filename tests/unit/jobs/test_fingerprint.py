"""Job fingerprints: canonical form, digest, the list of changes, the job record."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import pytest
import structlog

from llm_annotator.errors import ConfigurationError, FingerprintMismatchError, JobError
from llm_annotator.jobs.rundir.fingerprint import (
    JOB_FORMAT_VERSION,
    describe_changes,
    fingerprint_digest,
    job_record,
    make_fingerprint,
)


class Color(enum.Enum):
    RED = "red"


@dataclass(frozen=True, slots=True)
class Options:
    temperature: float
    stop: tuple[str, ...]


def test_fingerprint_is_canonical_json() -> None:
    """Keys sorted at every depth; tuples, dataclasses and enums become JSON values."""
    fingerprint = make_fingerprint(
        model="m", options=Options(0.5, ("\n",)), color=Color.RED, schema={"b": 1, "a": 2}
    )
    assert fingerprint == {
        "color": "red",
        "model": "m",
        "options": {"stop": ["\n"], "temperature": 0.5},
        "schema": {"a": 2, "b": 1},
    }
    assert list(fingerprint) == ["color", "model", "options", "schema"]
    assert list(fingerprint["schema"]) == ["a", "b"]


def test_equal_settings_give_equal_digests() -> None:
    """The digest ignores key order and Python types; any value change shows."""
    a = make_fingerprint(model="m", options={"top_p": 1, "seed": 3}, stop=("x",))
    b = make_fingerprint(stop=["x"], options={"seed": 3, "top_p": 1}, model="m")
    assert fingerprint_digest(a) == fingerprint_digest(b)
    assert fingerprint_digest(a) != fingerprint_digest({**a, "model": "n"})
    assert len(fingerprint_digest(a)) == 64
    int(fingerprint_digest(a), 16)


def test_a_setting_that_is_not_json_is_refused() -> None:
    """An object JSON cannot hold is a configuration error naming the fingerprint."""
    with pytest.raises(ConfigurationError, match="fingerprint"):
        make_fingerprint(model=object())


def test_changes_list_changed_added_and_removed_keys() -> None:
    """One line per differing key, old value then new; nested options by dotted path."""
    old = {"prompt_template": "Classify: {text}", "model": "m", "options": {"seed": 1}, "x": 1}
    new = {"prompt_template": "Label: {text}", "model": "m", "options": {"seed": 2}, "y": [1]}
    assert describe_changes(old, new) == [
        "options.seed: 1 -> 2",
        "prompt_template: 'Classify: {text}' -> 'Label: {text}'",
        "x: removed (was 1)",
        "y: added [1]",
    ]
    assert describe_changes(old, dict(old)) == []


def test_long_values_are_cut_around_their_first_difference() -> None:
    """A long template that differs at its end shows that end, with … where cut."""
    head = "You are a careful annotator. " * 10
    (line,) = describe_changes({"t": head + "Classify: {text}"}, {"t": head + "Label: {text}"})
    before, after = line.removeprefix("t: ").split(" -> ")
    assert before.startswith("…")
    assert "Classify" in before
    assert after.startswith("…")
    assert "Label" in after
    assert len(before) <= 60
    (added,) = describe_changes({}, {"t": "x" * 500})
    assert added.endswith("…")
    assert len(added) < 80


def test_new_record_holds_fingerprint_digest_and_times() -> None:
    """A new directory's record has the canonical fingerprint, its digest and times."""
    record = job_record(None, {"model": "m", "seed": 1}, where="out", now="t0")
    assert record == {
        "format_version": JOB_FORMAT_VERSION,
        "fingerprint": {"model": "m", "seed": 1},
        "digest": fingerprint_digest({"model": "m", "seed": 1}),
        "created": "t0",
        "updated": "t0",
        "history": [],
    }


def test_same_fingerprint_updates_the_time_only() -> None:
    """Resuming with the same settings keeps the creation time and history."""
    first = job_record(None, {"model": "m"}, where="out", now="t0")
    again = job_record(first, {"model": "m"}, where="out", now="t1")
    assert again == {**first, "updated": "t1"}


def test_other_fingerprint_is_refused_with_the_changes() -> None:
    """A mismatch names every change and the two ways out."""
    first = job_record(None, {"model": "a", "seed": 1}, where="out/run", now="t0")
    with pytest.raises(FingerprintMismatchError) as caught:
        job_record(first, {"model": "b", "seed": 1}, where="out/run", now="t1")
    assert caught.value.changes == ["model: 'a' -> 'b'"]
    message = str(caught.value)
    assert "out/run" in message
    assert "model: 'a' -> 'b'" in message
    assert "force=True" in message
    assert "--force" in message
    assert "new output directory" in message


def test_force_records_the_new_fingerprint_and_keeps_the_old_one() -> None:
    """With force, the old fingerprint moves to the history and a warning is logged."""
    first = job_record(None, {"model": "a"}, where="out", now="t0")
    with structlog.testing.capture_logs() as logs:
        forced = job_record(first, {"model": "b"}, where="out", now="t1", force=True)
    assert forced["fingerprint"] == {"model": "b"}
    assert forced["created"] == "t0"
    assert forced["history"] == [
        {"fingerprint": {"model": "a"}, "digest": first["digest"], "replaced": "t1"}
    ]
    assert [log["log_level"] for log in logs] == ["warning"]
    assert logs[0]["changes"] == ["model: 'a' -> 'b'"]


def test_record_from_a_newer_version_is_refused() -> None:
    """A job.json of a later format is not silently rewritten."""
    first = job_record(None, {"model": "a"}, where="out", now="t0")
    with pytest.raises(JobError, match="newer"):
        job_record({**first, "format_version": 99}, {"model": "a"}, where="out", now="t1")


def test_the_input_is_part_of_the_record_and_another_is_recorded_not_refused() -> None:
    """A new record keeps the input; the same input (same digest) resumes; another is
    taken (the job compares rows by content), kept in input_history with mixed_inputs set
    for good, with or without force; a record without an input (an older directory)
    takes the input, mixed."""
    a = {"where": "a.jsonl", "rows": 3, "digest": "d1"}
    b = {"where": "b.jsonl", "rows": 4, "digest": "d2"}
    first = job_record(None, {"model": "m"}, where="out", now="t0", identity=a)
    assert first["input"] == a and first["mixed_inputs"] is False
    same = job_record(first, {"model": "m"}, where="out", now="t1", identity={**a, "where": "c"})
    assert same["mixed_inputs"] is False
    taken_over = job_record(first, {"model": "m"}, where="out", now="t1", identity=b)
    assert taken_over["input"] == b and taken_over["mixed_inputs"] is True
    with pytest.raises(FingerprintMismatchError, match="other settings"):
        job_record(first, {"model": "n"}, where="out", now="t1", identity=b)
    forced = job_record(first, {"model": "m"}, where="out", now="t1", identity=b, force=True)
    assert forced["input"] == b and forced["mixed_inputs"] is True
    assert forced["input_history"] == [{**a, "replaced": "t1"}] and forced["history"] == []
    back = job_record(forced, {"model": "m"}, where="out", now="t2", identity=b)
    assert back["mixed_inputs"] is True
    older = {k: v for k, v in first.items() if k not in ("input", "input_history", "mixed_inputs")}
    taken = job_record(older, {"model": "m"}, where="out", now="t1", identity=b)
    assert taken["input"] == b and taken["mixed_inputs"] is True
    untouched = job_record(first, {"model": "m"}, where="out", now="t1")
    assert untouched["input"] == a
