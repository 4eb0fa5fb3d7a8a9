"""Prompt templates: parsed once, refused when unsafe, rendered from a row's values."""

from __future__ import annotations

from typing import Any

import pytest

from llm_annotator.errors import ConfigurationError, PromptError
from llm_annotator.jobs.rows.prompts import PromptTemplate, build_messages


def test_fields_are_unique_in_order_of_first_use() -> None:
    """`fields` lists each column once, in the order the template first uses it."""
    template = PromptTemplate("{b} then {a}, again {b:>3} and {c!r}")
    assert template.fields == ("b", "a", "c")
    assert template.template == "{b} then {a}, again {b:>3} and {c!r}"


@pytest.mark.parametrize(
    ("template", "values", "prompt"),
    [
        ("Classify: {text}", {"text": "great film"}, "Classify: great film"),
        ("{a}{b}", {"a": "x", "b": "y"}, "xy"),
        ("{{not a field}} {a}", {"a": 1}, "{not a field} 1"),
        ("{a} {a}", {"a": "twice"}, "twice twice"),
        ("n={n}, f={f}, b={b}", {"n": 3, "f": 0.5, "b": True}, "n=3, f=0.5, b=True"),
        ("{tags}", {"tags": ["a", "é"]}, '["a","é"]'),
        ("{meta}", {"meta": {"k": 1, "v": [None]}}, '{"k":1,"v":[null]}'),
        ("{pair}", {"pair": (1, 2)}, "[1,2]"),
        ("{score:.2f}", {"score": 0.12345}, "0.12"),
        ("[{name:>6}]", {"name": "ab"}, "[    ab]"),
        ("{n:03d}", {"n": 7}, "007"),
        ("{text!r}", {"text": "hi"}, "'hi'"),
        ("{text!a}", {"text": "é"}, "'\\xe9'"),
        ("{n!s:>3}", {"n": 5}, "  5"),
        ("{text}", {"text": "{other} {0} {x.y}"}, "{other} {0} {x.y}"),
        ("{text}", {"text": ""}, ""),
    ],
)
def test_render(template: str, values: dict[str, Any], prompt: str) -> None:
    """Strings as they are, lists and dicts as JSON, scalars as str, specs on the value."""
    assert PromptTemplate(template).render(values) == prompt


def test_render_ignores_extra_columns() -> None:
    """Columns the template does not use are left out."""
    assert PromptTemplate("{a}").render({"a": "x", "b": "unused"}) == "x"


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("{text.__class__}", "reaches into a value"),
        ("{text.__class__.__init__.__globals__}", "reaches into a value"),
        ("{a[0]}", "reaches into a value"),
        ("{a.b}", "reaches into a value"),
        ("{}", "positional"),
        ("{0}", "positional"),
        ("{a:{width}}", "nested field"),
        ("{a!x}", "unknown conversion"),
        ("{a", "not a valid template"),
        ("a } b {c}", "not a valid template"),
        ("no fields at all", "uses no column"),
        ("only {{braces}}", "uses no column"),
        ("", "uses no column"),
    ],
)
def test_unsafe_or_broken_templates_are_refused(template: str, problem: str) -> None:
    """Templates that reach into values, are positional, nested, invalid or constant fail."""
    with pytest.raises(PromptError, match="prompt_template") as info:
        PromptTemplate(template)
    assert problem in str(info.value)
    assert isinstance(info.value, ConfigurationError)


def test_template_must_be_a_string() -> None:
    """A non-str template is refused."""
    with pytest.raises(PromptError, match="must be a str"):
        PromptTemplate(b"{a}")  # type: ignore[arg-type]


def test_missing_field_names_where_field_and_columns() -> None:
    """A row without a field the template uses: where, which field, what the row has."""
    template = PromptTemplate("Classify {text}")
    with pytest.raises(PromptError) as info:
        template.render({"id": 1, "body": "x"}, "data.jsonl line 18")
    assert str(info.value) == (
        "data.jsonl line 18: the prompt_template uses {text}, but the row has no column "
        "'text'; its columns: id, body"
    )


def test_none_value_is_refused_with_where_and_field() -> None:
    """A null value cannot be rendered: the message names where, the field and the columns."""
    with pytest.raises(PromptError) as info:
        PromptTemplate("{a} {text}").render({"a": "x", "text": None}, "data.csv line 3")
    message = str(info.value)
    assert message.startswith("data.csv line 3: the prompt_template uses {text}")
    assert "null" in message
    assert "its columns: a, text" in message


def test_message_without_where_has_no_prefix() -> None:
    """Without `where`, the message starts with the problem."""
    with pytest.raises(PromptError, match=r"^the prompt_template uses \{a\}"):
        PromptTemplate("{a}").render({})


def test_format_spec_that_does_not_fit_the_value_is_a_prompt_error() -> None:
    """A numeric spec on a string value is a PromptError naming where and the field."""
    with pytest.raises(PromptError) as info:
        PromptTemplate("{score:.2f}").render({"score": "high"}, "list item 4")
    assert str(info.value).startswith("list item 4: the format spec of {score:.2f}")
    assert "'high'" in str(info.value)


def test_many_columns_are_listed_briefly() -> None:
    """A row with many columns lists the first 30 and counts the rest."""
    row = {f"c{i}": i for i in range(40)}
    with pytest.raises(PromptError, match=r"c29, and 10 more$"):
        PromptTemplate("{text}").render(row)


def test_check_columns_passes_when_all_fields_exist() -> None:
    """Known columns: no error."""
    PromptTemplate("{a} {b}").check_columns(("b", "a", "c"), "data.parquet")


def test_check_columns_names_unknown_fields_where_and_columns() -> None:
    """Unknown fields are all named, with the input and its columns and a close match."""
    template = PromptTemplate("{txt} {label} {id}")
    with pytest.raises(PromptError) as info:
        template.check_columns(["id", "text"], "data.parquet")
    assert str(info.value) == (
        "the prompt_template uses {txt}, {label}, but data.parquet has no columns 'txt', "
        "'label' (did you mean 'text'?); its columns: id, text"
    )


def test_check_columns_with_no_columns() -> None:
    """An input without columns says so."""
    with pytest.raises(PromptError, match=r"its columns: \(none\)"):
        PromptTemplate("{a}").check_columns([], "a list of 0 rows")


def test_values_cannot_reach_attributes_through_the_template() -> None:
    """A value's own format machinery is used only through format(value, spec)."""

    class Sneaky:
        secret = "leaked"

        def __format__(self, spec: str) -> str:
            return f"<{spec}>"

    prompt = PromptTemplate("{v} {v:x}").render({"v": Sneaky()})
    assert prompt == "<> <x>"
    assert "leaked" not in prompt


def test_build_messages() -> None:
    """A user message, preceded by the system message when there is one."""
    assert build_messages("p") == [{"role": "user", "content": "p"}]
    assert build_messages("p", "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "p"},
    ]
