"""Steps checked as a whole (names, what they read, cycles), their keys, and the plan:
what a run does with each step, decided before anything runs."""

from __future__ import annotations

from typing import Any

import pytest

from llm_annotator import VLLMOnlineRuntimeOptions
from llm_annotator.errors import ConfigurationError
from llm_annotator.pipeline import Pipeline, Step
from llm_annotator.pipeline.plan import Recorded, plan
from llm_annotator.pipeline.steps import ordered, step_key


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"name": "1abc", "prompt_template": "{x}", "data": "d"}, "a step's name must be"),
        ({"name": "a/b", "prompt_template": "{x}", "data": "d"}, "a step's name must be"),
        ({"name": "a", "prompt_template": "{x}"}, "give one of data, from_step or prompts"),
        (
            {"name": "a", "prompt_template": "{x}", "data": "d", "prompts": ["p"]},
            "got data, prompts",
        ),
        ({"name": "a", "data": "d"}, "give a prompt_template"),
        ({"name": "a", "prompts": []}, "prompts must be a non-empty list"),
        ({"name": "a", "prompts": "one"}, "prompts must be a non-empty list"),
        ({"name": "a", "prompts": ["ok", ""]}, "every prompt must be a non-empty string"),
        ({"name": "a", "prompts": ["p"], "n": 0}, "n must be an integer >= 1"),
        ({"name": "a", "prompts": ["p"], "copies": True}, "copies must be an integer >= 1"),
        ({"name": "a", "prompt_template": "{x}", "data": "d", "copies": 2}, "copies is for"),
        ({"name": "a", "prompt_template": "{x}", "from_step": "b", "id_column": "i"}, "ids"),
        ({"name": "a", "prompts": ["p"], "id_column": "i"}, "numbers its prompts"),
        ({"name": "a", "prompt_template": "{x}", "data": "d", "where": "f(x)"}, "a call"),
        ({"name": "a", "prompt_template": "{x}", "data": "d", "preprocess": 3}, "callable"),
        (
            {
                "name": "a",
                "prompts": ["p"],
                "n": 2,
                "options": VLLMOnlineRuntimeOptions(seed=1, temperature=1.0),
            },
            "same answer to every copy",
        ),
    ],
)
def test_a_bad_step_is_refused_with_its_name_and_why(kwargs: dict[str, Any], said: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        Step(**kwargs)
    assert said in str(refused.value)


def _step(name: str, source: str | None = None, template: str = "{x}") -> Step:
    if source is None:
        return Step(name, template, data="d.jsonl")
    return Step(name, template, from_step=source)


def test_steps_run_after_what_they_read_and_bad_graphs_are_named() -> None:
    steps = [_step("c", "b"), _step("b", "a"), _step("a"), _step("z")]
    assert [s.name for s in ordered(steps)] == ["a", "b", "c", "z"]
    with pytest.raises(ConfigurationError, match="two steps are named 'a'"):
        ordered([_step("a"), _step("a")])
    with pytest.raises(ConfigurationError, match="reads from_step 'x', which is not a step"):
        ordered([_step("a"), _step("b", "x")])
    with pytest.raises(ConfigurationError, match="cycle: b -> c -> b"):
        ordered([_step("a"), _step("b", "c"), _step("c", "b")])
    with pytest.raises(ConfigurationError, match="cycle: a -> a"):
        ordered([_step("a", "a")])
    with pytest.raises(ConfigurationError, match="at least one step"):
        ordered([])


def test_a_steps_key_follows_its_settings_and_what_it_reads() -> None:
    """The same settings give the same key; another template, hook or upstream another."""
    a = _step("b", "a").settings("k1")
    assert step_key(a) == step_key(_step("b", "a").settings("k1"))
    assert step_key(a) != step_key(_step("b", "a").settings("k2"))
    assert step_key(a) != step_key(_step("b", "a", "{y}").settings("k1"))
    hooked = Step("b", "{x}", from_step="a", postprocess=_columns)
    assert step_key(hooked.settings("k1")) != step_key(a)
    assert hooked.settings("k1")["postprocess"].endswith("test_plan:_columns")


def _columns(row: dict[str, Any], answer: Any) -> dict[str, Any]:
    return {"size": len(answer)}


ORDER = [("a", None), ("b", "a"), ("c", "b"), ("d", None)]
SETTINGS = {name: {"prompt_template": f"{name} {{x}}"} for name, _ in ORDER}
KEYS = {name: f"k-{name}" for name, _ in ORDER}


def _recorded(**states: str) -> dict[str, Recorded]:
    return {name: Recorded(KEYS[name], state, SETTINGS[name]) for name, state in states.items()}  # type: ignore[arg-type]


def _actions(**kwargs: Any) -> list[tuple[str, str]]:
    keys = kwargs.pop("keys", KEYS)
    settings = kwargs.pop("settings", SETTINGS)
    recorded = kwargs.pop("recorded")
    return [(p.name, p.action) for p in plan(ORDER, keys, settings, recorded, **kwargs)]


def test_done_steps_are_skipped_begun_ones_resumed_new_ones_run() -> None:
    assert _actions(recorded=_recorded(a="done", b="begun")) == [
        ("a", "skip"),
        ("b", "resume"),
        ("c", "run"),
        ("d", "run"),
    ]


def test_a_changed_step_is_refused_naming_what_changed_and_its_readers() -> None:
    keys = {**KEYS, "b": "new-b", "c": "new-c"}
    settings = {**SETTINGS, "b": {"prompt_template": "B {x}"}}
    recorded = _recorded(a="done", b="done", c="done")
    with pytest.raises(ConfigurationError) as refused:
        _actions(keys=keys, settings=settings, recorded=recorded)
    message = str(refused.value)
    assert "step b changed since it ran (prompt_template: 'b {x}' -> 'B {x}')" in message
    assert "the steps that read it (c) would be redone too" in message
    assert "--force" in message
    forced = plan(ORDER, keys, settings, recorded, force=True)
    assert [(p.name, p.action) for p in forced] == [
        ("a", "skip"),
        ("b", "redo"),
        ("c", "redo"),
        ("d", "run"),
    ]
    assert forced[2].why == "reads step b, whose rows change"


def test_a_changed_step_never_begun_needs_no_force() -> None:
    keys = {**KEYS, "c": "new-c"}
    assert _actions(keys=keys, recorded=_recorded(a="done", b="done"))[2] == ("c", "run")


def test_selected_steps_need_what_they_read_done_as_it_is_now() -> None:
    assert _actions(recorded=_recorded(a="done"), selected=["b"]) == [
        ("a", "leave"),
        ("b", "run"),
        ("c", "leave"),
        ("d", "leave"),
    ]
    with pytest.raises(ConfigurationError, match="reads step a, which is not done"):
        _actions(recorded=_recorded(a="begun"), selected=["b"])
    with pytest.raises(ConfigurationError, match="reads step a, which is not done"):
        _actions(keys={**KEYS, "a": "other"}, recorded=_recorded(a="done"), selected=["b"])
    with pytest.raises(ConfigurationError, match="e, f are not a step"):
        _actions(recorded={}, selected=["e", "f"])


def test_a_pipeline_plans_from_its_record_without_a_client(tmp_path: Any) -> None:
    (tmp_path / "d.jsonl").write_text('{"x": 1}\n')
    steps = [_step("b", "a"), Step("a", "{x}", data=str(tmp_path / "d.jsonl"))]
    pipeline = Pipeline(steps, tmp_path / "p")
    assert [(p.name, p.action) for p in pipeline.plan()] == [("a", "run"), ("b", "run")]
    assert [v.state for v in pipeline.describe()] == ["not run", "not run"]
    assert repr(pipeline).endswith("steps=[a, b]>")
