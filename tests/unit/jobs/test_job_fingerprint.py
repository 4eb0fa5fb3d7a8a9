"""A job's fingerprint: derived from the declaration of the job options, and the same,
key for key and value for value, as the one every existing run directory records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest

from llm_annotator import VLLMOnlineRuntimeOptions
from llm_annotator._job_options import OPTIONS
from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs.rows.sample import Sample
from llm_annotator.jobs.rundir import fingerprint
from llm_annotator.jobs.rundir.fingerprint import (
    RECORDED,
    ByCaller,
    fingerprint_digest,
    job_fingerprint,
)
from llm_annotator.jobs.spec import JobSpec, Postprocess

_SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}


def _plain() -> JobSpec:
    return JobSpec([{"text": "a"}], "Classify: {text}", Path("out"))


def _full() -> JobSpec:
    """A job that sets every option (any callable serves as a hook: the fingerprint
    records its name)."""
    return JobSpec(
        [{"text": "a", "lang": "en"}],
        "Label {text} in {lang}",
        Path("out"),
        system_message="Be brief.",
        id_column="uid",
        options=VLLMOnlineRuntimeOptions(
            temperature=0.5, max_completion_tokens=16, seed=7, output_schema=_SCHEMA
        ),
        gen_kwargs={"top_k": 5, "stop": ("\n",)},
        columns=("text", "lang"),
        retry_errors=True,
        force=True,
        write_jsonl=True,
        max_regenerations=1,
        limit=10,
        shuffle_seed=3,
        validate=json.loads,
        shard=(0, 2),
        skip_bad_files=True,
        claim_lease=30.0,
        unit_size="64M",
        group_by="lang",
        postprocess=cast("Postprocess", json.dumps),
    )


_PLAIN: dict[str, Any] = {
    "columns": None,
    "gen_kwargs": {},
    "id_column": None,
    "model": None,
    "options": {},
    "output_schema": None,
    "prompt_template": "Classify: {text}",
    "system_message": None,
}
"""The fingerprint of a job with every option at its default, as run directories hold it."""

_FULL: dict[str, Any] = {
    "columns": ["text", "lang"],
    "gen_kwargs": {"stop": ["\n"], "top_k": 5},
    "id_column": "uid",
    "model": "m-7b",
    "options": {
        "add_generation_prompt": True,
        "max_tokens": 16,
        "response_format": {
            "json_schema": {
                "name": "response",
                "schema": {
                    "properties": {"label": {"type": "string"}},
                    "required": ["label"],
                    "type": "object",
                },
            },
            "type": "json_schema",
        },
        "seed": 7,
        "temperature": 0.5,
    },
    "output_schema": {
        "properties": {"label": {"type": "string"}},
        "required": ["label"],
        "type": "object",
    },
    "postprocess": "json:dumps",
    "prompt_template": "Label {text} in {lang}",
    "sample": {"input_rows": 100, "limit": 10, "shuffle_seed": 3},
    "system_message": "Be brief.",
    "validate": "json:loads",
}
"""The fingerprint of :func:`_full` on model ``m-7b``, a sample of an input of 100 rows."""


def test_a_job_at_the_defaults_keeps_the_fingerprint_run_directories_hold() -> None:
    """Every option at its default: the same keys, values and digest as before the
    fingerprint was derived from the declaration (a change refuses every resume)."""
    fingerprint = job_fingerprint(_plain(), None)
    assert fingerprint == _PLAIN
    assert list(fingerprint) == sorted(_PLAIN)
    assert fingerprint_digest(fingerprint) == (
        "8189079968c0191f98b8fb0dcd2bbf96c88c3b1650f84cf3fee3e6de22143a39"
    )


def test_a_job_that_sets_every_option_keeps_the_fingerprint_run_directories_hold() -> None:
    """Every option set, called as the drivers call it (the sample, and the hooks' names
    again, as extras): the same keys, values and digest as before."""
    spec = _full()
    sample = Sample(spec.limit, spec.shuffle_seed).fingerprint(100)
    fingerprint = job_fingerprint(spec, "m-7b", sample=sample, **spec.hook_names())
    assert fingerprint == _FULL
    assert fingerprint_digest(fingerprint) == (
        "6223945f2ae7424b31466fec36defcc0477a910e3e463c57280ca69fccd3a550"
    )


def test_the_hooks_are_recorded_without_the_caller_naming_them() -> None:
    """``validate`` and ``postprocess`` are recorded from the spec, so a driver need not
    pass their names; one that does gets the same fingerprint."""
    spec = _full()
    sample = Sample(spec.limit, spec.shuffle_seed).fingerprint(100)
    assert job_fingerprint(spec, "m-7b", sample=sample) == _FULL


def _probe(name: str) -> dict[str, Any]:
    """Keywords of a job that sets option ``name`` (``shuffle_seed`` needs a limit)."""
    value = getattr(_full(), name)
    return {"limit": 10, name: value} if name == "shuffle_seed" else {name: value}


def test_each_fingerprinted_option_is_recorded_and_no_other() -> None:
    """Setting an option changes the fingerprint exactly when it is declared
    fingerprinted. An option whose entry the caller makes (``limit`` and
    ``shuffle_seed``: the sample depends on the input's size) is refused without it."""
    base = job_fingerprint(_plain(), "m")
    for name, option in OPTIONS.items():
        assert getattr(_full(), name) != option.default, name  # the probe sets it
        spec = JobSpec([{"text": "a"}], "Classify: {text}", Path("out"), **_probe(name))
        how = RECORDED.get(name)
        if isinstance(how, ByCaller):
            assert option.fingerprinted, name
            with pytest.raises(TypeError, match=f"extra {how.key!r}"):
                job_fingerprint(spec, "m")
            sample = Sample(spec.limit, spec.shuffle_seed).fingerprint(100)
            assert job_fingerprint(spec, "m", **{how.key: sample}) == {**base, how.key: sample}
            continue
        assert (job_fingerprint(spec, "m") != base) is option.fingerprinted, name


def test_only_fingerprinted_options_have_a_conversion() -> None:
    """The table of conversions names fingerprinted options only (the others are not
    recorded, so a conversion of one would be dead)."""
    assert {name for name in RECORDED if not OPTIONS[name].fingerprinted} == set()


def test_an_option_without_a_conversion_is_recorded_unless_at_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fingerprinted option the table does not name (a new one) is recorded under its
    name, and left out at its default, so that jobs without it keep their fingerprint."""
    bare = {name: how for name, how in RECORDED.items() if name != "id_column"}
    monkeypatch.setattr(fingerprint, "RECORDED", bare)
    assert "id_column" not in job_fingerprint(_plain(), "m")
    spec = JobSpec([{"text": "a"}], "Classify: {text}", Path("out"), id_column="uid")
    assert job_fingerprint(spec, "m")["id_column"] == "uid"


def test_an_extra_cannot_contradict_what_the_spec_records() -> None:
    """An extra that repeats an entry recorded from the spec must give the same value;
    another value is a mistake of the caller, refused by name."""
    spec = JobSpec([{"text": "a"}], "Classify: {text}", Path("out"), validate=json.loads)
    assert job_fingerprint(spec, "m", validate="json:loads")["validate"] == "json:loads"
    with pytest.raises(ValueError, match="validate"):
        job_fingerprint(spec, "m", validate="other:check")
    with pytest.raises(ValueError, match="prompt_template"):
        job_fingerprint(spec, "m", prompt_template="Label: {text}")


def test_a_hook_that_is_not_callable_is_refused() -> None:
    """A ``validate`` that is no callable cannot be named in the fingerprint."""
    spec = JobSpec([{"text": "a"}], "Classify: {text}", Path("out"), validate="json:loads")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="validate must be a callable"):
        job_fingerprint(spec, "m")
