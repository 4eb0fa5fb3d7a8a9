"""``where`` filters: comparisons of columns and literals, evaluated by the module's own
walk; anything else is refused by name, and nothing of the expression ever runs."""

from __future__ import annotations

from typing import Any

import pytest

from llm_annotator.errors import ConfigurationError
from llm_annotator.pipeline import Where

ROW = {
    "sentiment": "negative",
    "score": 0.4,
    "votes": 3,
    "tags": "a",
    "labels": ["x", "y"],
    "nested": [[1, 2], [3]],
    "missing": None,
}


@pytest.mark.parametrize(
    ("expression", "holds"),
    [
        ("sentiment == 'negative'", True),
        ("sentiment != 'negative'", False),
        ("score < 0.5", True),
        ("score >= 0.5", False),
        ("0 < votes <= 3", True),
        ("0 < votes < 3", False),
        ("votes == 3 and sentiment == 'negative'", True),
        ("votes == 2 or sentiment == 'positive'", False),
        ("not (votes == 2)", True),
        ("sentiment in ['negative', 'mixed']", True),
        ("sentiment not in ('negative',)", False),
        ("missing is None", True),
        ("missing is not None", False),
        ("absent is None", True),  # a column a row lacks reads as None
        ("votes > -1", True),
        ("score > 'a'", False),  # a comparison that cannot be made is false
        ("missing < 3", False),
        ("'x' == sentiment", False),
        ("sentiment == tags", False),  # two columns
        ("votes == True", False),
        # SQL's three values: a missing value or unlike kinds make a comparison unknown,
        # and a row is kept only when the filter is true.
        ("missing != 1", False),
        ("missing not in [1, 2]", False),
        ("not (missing > 0.5)", False),
        ("not (score > 'a')", False),
        ("votes != 'a'", False),
        ("missing is None or missing > 3", True),
        ("missing > 3 or votes == 3", True),
        ("missing > 3 and votes == 3", False),
        ("not (missing > 3 and votes == 2)", True),
        ("labels == ['x', 'y']", True),
        ("'y' in labels", True),
        ("'z' not in labels", True),
        ("sentiment not in ['a', None]", False),  # SQL: unknown, a NULL in the list
        ("not (sentiment in ['a', None])", False),
        ("sentiment in ['negative', None]", True),
        ("not (missing == tags == 'b')", True),  # unknown and false: false; not: true
        ("nested == [[1, 2], [3]]", True),
        ("[1, 2] in nested", True),
    ],
)
def test_comparisons_hold_as_python_would_and_false_where_they_cannot(
    expression: str, holds: bool
) -> None:
    assert Where(expression)(ROW) is holds


@pytest.mark.parametrize(
    ("expression", "named"),
    [
        ("__import__('os').system('touch /tmp/x')", "a call"),
        ("len(sentiment) > 3", "a call"),
        ("sentiment.upper() == 'A'", "a call"),
        ("row.sentiment == 'a'", "an attribute"),
        ("tags[0] == 'a'", "an index"),
        ("votes + 1 > 3", "arithmetic"),
        ("votes", "the bare column 'votes'"),
        ("(lambda: 1)() == 1", "a call"),
        ("[x for x in tags] == []", "a listcomp"),
        ("(y := 3) == 3", "an assignment"),
        ("f'{votes}' == '3'", "an f-string"),
        ("sentiment is 'negative'", "is takes None, True or False"),
        ("1 == 1", "compares no column"),
        ("sentiment in [tags]", "the column 'tags' inside a list"),
        ("votes > -score", "a sign goes before a number only"),
        ("'a' if votes else 'b'", "a conditional expression"),
        ("votes == {1}", "a set"),
        ("sentiment == b'x'", "a constant"),
    ],
)
def test_anything_but_a_comparison_of_columns_and_literals_is_refused_by_name(
    expression: str, named: str
) -> None:
    with pytest.raises(ConfigurationError, match="is not allowed") as refused:
        Where(expression)
    assert named in str(refused.value)


@pytest.mark.parametrize(
    "expression",
    [
        "",
        "   ",
        "sentiment ==",
        "x" * 5000,
        "x == " + "-" * 995 + "1",
        "not " * 993 + "x == 1",
        "x == '\ud800'",
        "x == 1\x00",
        3,
    ],
)
def test_empty_broken_deep_or_huge_expressions_are_one_clear_error(expression: Any) -> None:
    with pytest.raises(ConfigurationError, match="where"):
        Where(expression)


def test_a_filter_nested_as_deep_as_allowed_evaluates_deep_in_a_stack() -> None:
    """The depth cap bounds evaluation: 60 nots work even called from deep down."""
    where = Where("not " * 60 + "votes == 3")

    def nested(depth: int) -> bool:
        return where(ROW) if depth == 0 else nested(depth - 1)

    assert nested(800) is True


def test_the_columns_read_are_listed_once_in_order() -> None:
    assert Where("b == 1 and (a < 2 or b > 0) and c is None").columns == ("b", "a", "c")
