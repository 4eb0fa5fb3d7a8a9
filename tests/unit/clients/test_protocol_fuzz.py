"""Fuzzing what a server can send: whatever the bytes, the parsers return an answer or
raise our own error, never anything else.

Bounded: a fixed number of examples per test (a few seconds in all), no deadline per
example, so a slow machine does not turn into a flaky failure.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_annotator.clients._protocol import (
    error_message,
    parse_completion,
    parse_model_list,
    status_error,
)
from llm_annotator.errors import ErrorKind, MalformedResponseError, StatusError
from llm_annotator.response import Response

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=16,
)


def maybe(right: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the right thing, sometimes any JSON value at all."""
    return st.one_of(right, right, json_values)


counts = maybe(st.integers(min_value=0, max_value=10**6))
messages = maybe(
    st.fixed_dictionaries(
        {"role": maybe(st.just("assistant")), "content": maybe(st.none() | st.text(max_size=30))},
        optional={
            "reasoning_content": maybe(st.text(max_size=10)),
            "tool_calls": maybe(st.lists(st.just({"id": "t"}), max_size=1)),
        },
    )
)
choices = maybe(
    st.lists(
        maybe(
            st.fixed_dictionaries(
                {"message": messages, "finish_reason": maybe(st.sampled_from(["stop", "length"]))},
                optional={"stop_reason": json_values, "index": json_values},
            )
        ),
        max_size=2,
    )
)
completions = st.fixed_dictionaries(
    {"choices": choices},
    optional={
        "usage": maybe(
            st.fixed_dictionaries(
                {}, optional={"prompt_tokens": counts, "completion_tokens": counts}
            )
        ),
        "model": json_values,
        "error": json_values,
    },
)


def check(body: bytes) -> None:
    failure: MalformedResponseError | None = None
    try:
        response = parse_completion(body, server="http://s:1/v1", provider="p")
    except MalformedResponseError as error:
        failure = error
    if failure is not None:
        assert failure.kind is ErrorKind.MALFORMED
        assert str(failure).startswith("http://s:1/v1: ")
        return
    assert isinstance(response, Response)
    assert response.text is None or isinstance(response.text, str)
    assert isinstance(response.finish_reason, str)
    for count in (response.num_prompt_tokens, response.num_output_tokens):
        assert count is None or (type(count) is int and count >= 0)
    if response.text is None:
        message = response.raw["choices"][0]["message"] if response.raw else {}
        assert response.reasoning or (
            isinstance(message.get("tool_calls"), list) and message["tool_calls"]
        )


@FUZZ
@given(completions)
def test_completion_shaped_bodies_parse_or_are_malformed(data: dict[str, Any]) -> None:
    """Bodies that look almost like chat completions: an answer that holds, or ours."""
    check(orjson.dumps(data))


@FUZZ
@given(st.binary(max_size=300) | json_values.map(orjson.dumps))
def test_any_bytes_parse_or_are_malformed(body: bytes) -> None:
    """Arbitrary bytes and arbitrary JSON: an answer that holds, or ours."""
    check(body)


@FUZZ
@given(
    st.integers(min_value=100, max_value=599),
    st.binary(max_size=300) | json_values.map(orjson.dumps),
)
def test_error_bodies_always_give_a_status_error(status: int, body: bytes) -> None:
    """Whatever an error answer holds, it becomes one StatusError with a message."""
    message = error_message(body)
    assert isinstance(message, str) and len(message) <= 600
    error = status_error(status, body, "http://s:1/v1", location="http://elsewhere/")
    assert isinstance(error, StatusError)
    assert error.status_code == status
    assert isinstance(error.kind, ErrorKind)


@FUZZ
@given(
    st.binary(max_size=200)
    | json_values.map(orjson.dumps)
    | st.fixed_dictionaries({"data": json_values}).map(orjson.dumps)
)
def test_model_lists_parse_or_are_malformed(body: bytes) -> None:
    """A /models answer is a list of names, or our MalformedResponseError."""
    try:
        names = parse_model_list(body, server="http://s:1/v1")
    except MalformedResponseError:
        return
    assert all(isinstance(name, str) and name for name in names)


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "body",
    [
        b'{"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}], '
        b'"usage": {"prompt_tokens": ' + _deep(1000) + b"}}",
        b'{"choices": [{"message": {"content": "x"}, "finish_reason": "stop"}], '
        b'"usage": {"prompt_tokens": "' + b"9" * 2_000_000 + b'"}}',
        b'{"choices": [{"message": {"content": ' + _deep(1000) + b"}}]}",
        b'{"detail": ' + _deep(1000) + b"}",
        b'{"error": {"message": ' + _deep(1000) + b"}}",
    ],
    ids=["deep-count", "huge-count", "deep-content", "deep-detail", "deep-error"],
)
def test_values_nested_a_thousand_deep_or_huge_are_described_not_quoted(body: bytes) -> None:
    """Values orjson accepts but repr() cannot print (nested ~1000 deep) or should not
    (a 2 MB string) give a short message, never RecursionError or a message of megabytes."""
    try:
        parse_completion(body, server="s", provider="p")
    except MalformedResponseError as error:
        message = str(error)
    else:
        message = ""
    status = str(status_error(500, body, "s"))
    for text in (message, status):
        assert len(text) < 2000
    with pytest.raises(MalformedResponseError):
        parse_model_list(b'{"data": [' + _deep(1000) + b"]}", server="s")
