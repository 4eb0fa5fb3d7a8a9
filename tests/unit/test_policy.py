"""Error classification and retry policy: pure functions, tested with tables."""

from __future__ import annotations

import pytest

from llm_annotator import ErrorKind
from llm_annotator.clients._protocol import (
    classify_status,
    error_message,
    parse_completion,
    status_error,
)
from llm_annotator.clients._retry import retry_delay, should_retry
from llm_annotator.errors import MalformedResponseError


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        (400, "This model's maximum context length is 512 tokens", ErrorKind.BAD_REQUEST),
        (422, "field required", ErrorKind.BAD_REQUEST),
        (413, "too large", ErrorKind.BAD_REQUEST),
        (401, "bad key", ErrorKind.AUTH),
        (403, "forbidden", ErrorKind.AUTH),
        (404, "The model `x` does not exist.", ErrorKind.NOT_FOUND),
        (429, "slow down", ErrorKind.OVERLOADED),
        (503, "The engine is currently busy", ErrorKind.OVERLOADED),
        (
            500,
            "EngineCore encountered an issue. See stack trace (above) for the root cause.",
            ErrorKind.ENGINE_DEAD,
        ),
        (500, "something else broke", ErrorKind.SERVER_ERROR),
        (502, "Bad Gateway", ErrorKind.SERVER_ERROR),
        (504, "Gateway Timeout", ErrorKind.SERVER_ERROR),
        (408, "Request Timeout", ErrorKind.SERVER_ERROR),
        (409, "Conflict", ErrorKind.SERVER_ERROR),
        (418, "teapot", ErrorKind.HTTP_ERROR),
    ],
)
def test_status_classification(status: int, message: str, kind: ErrorKind) -> None:
    """Each status maps to the kind its row of the failure taxonomy names."""
    assert classify_status(status, message) is kind


@pytest.mark.parametrize(
    ("kind", "server_gone", "retryable"),
    [
        (ErrorKind.CONNECT, True, True),
        (ErrorKind.CONNECT_TIMEOUT, True, True),
        (ErrorKind.DISCONNECTED, True, True),
        (ErrorKind.ENGINE_DEAD, True, True),
        (ErrorKind.READ_TIMEOUT, False, True),
        (ErrorKind.OVERLOADED, False, True),
        (ErrorKind.SERVER_ERROR, False, True),
        (ErrorKind.BAD_REQUEST, False, False),
        (ErrorKind.AUTH, False, False),
        (ErrorKind.NOT_FOUND, False, False),
        (ErrorKind.HTTP_ERROR, False, False),
        (ErrorKind.MALFORMED, False, False),
    ],
)
def test_kind_properties(kind: ErrorKind, server_gone: bool, retryable: bool) -> None:
    """Whether a failure means a dead server, and whether resending may help."""
    assert kind.server_gone is server_gone
    assert kind.retryable is retryable


def test_status_error_names_server_status_and_hint() -> None:
    """The exception for a 404 says where, what, and how to fix it."""
    error = status_error(
        404,
        b'{"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError"}}',
        "http://127.0.0.1:1/v1",
    )
    text = str(error)
    assert text.startswith("http://127.0.0.1:1/v1: HTTP 404: NotFoundError: The model `nope`")
    assert "model=None" in text
    assert error.kind is ErrorKind.NOT_FOUND
    assert error.status_code == 404


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "bad", "type": "BadRequestError"}}', "BadRequestError: bad"),
        (b'{"object": "error", "message": "old style", "type": "x"}', "x: old style"),
        (b'{"error": "plain"}', "plain"),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"", "<empty body>"),
        (b"\xff\xfe not utf8", "\ufffd\ufffd not utf8"),
    ],
)
def test_error_message_reads_every_shape(body: bytes, message: str) -> None:
    """Error bodies of vLLM, FastAPI and proxies all yield a readable message."""
    assert error_message(body) == message


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"choices": []}',
        b'{"choices": [{"text": "completion, not chat"}]}',
        b'{"choices": [{"message": {"content": 5}}]}',
        b'{"choices": [{"message": null}]}',
    ],
)
def test_malformed_completion_is_classified(body: bytes) -> None:
    """A 2xx body that is not a chat completion raises MalformedResponseError."""
    with pytest.raises(MalformedResponseError) as info:
        parse_completion(body, server="http://s/v1", provider="p")
    assert info.value.kind is ErrorKind.MALFORMED
    assert info.value.server == "http://s/v1"


def test_completion_fields_are_read() -> None:
    """Text, finish and stop reasons, tokens and reasoning come from the body."""
    body = (
        b'{"model": "m", "choices": [{"message": {"content": "hi", "reasoning_content": "hmm"},'
        b' "finish_reason": "length", "stop_reason": 7}],'
        b' "usage": {"prompt_tokens": 3, "completion_tokens": 9}}'
    )
    response = parse_completion(body, server="http://s/v1", provider="p")
    assert (response.text, response.finish_reason, response.stop_reason) == ("hi", "length", 7)
    assert (response.num_prompt_tokens, response.num_output_tokens) == (3, 9)
    assert (response.reasoning, response.model, response.server) == ("hmm", "m", "http://s/v1")
    assert response.ok


@pytest.mark.parametrize(
    ("attempt", "jitter", "delay"),
    [(0, 0.0, 0.5), (1, 0.0, 1.0), (3, 0.0, 4.0), (4, 0.0, 8.0), (9, 0.0, 8.0), (0, 0.5, 0.4375)],
)
def test_retry_delay_doubles_to_a_cap_with_jitter(
    attempt: int, jitter: float, delay: float
) -> None:
    """Backoff: 0.5 s doubling to 8 s, less up to a quarter at random."""
    assert retry_delay(attempt, jitter=jitter) == pytest.approx(delay)


def test_retry_delay_random_jitter_stays_in_range() -> None:
    """Without a given jitter, the delay lies within [75%, 100%] of the base."""
    delays = [retry_delay(2) for _ in range(200)]
    assert all(1.5 <= d <= 2.0 for d in delays)
    assert len(set(delays)) > 1


@pytest.mark.parametrize(
    ("kind", "attempt", "max_retries", "expected"),
    [
        (ErrorKind.CONNECT, 0, 2, True),
        (ErrorKind.CONNECT, 1, 2, True),
        (ErrorKind.CONNECT, 2, 2, False),
        (ErrorKind.OVERLOADED, 0, 0, False),
        (ErrorKind.BAD_REQUEST, 0, 5, False),
        (ErrorKind.MALFORMED, 0, 5, False),
        (ErrorKind.SERVER_ERROR, 4, 5, True),
    ],
)
def test_should_retry(kind: ErrorKind, attempt: int, max_retries: int, expected: bool) -> None:
    """Only transient kinds are retried, and only up to max_retries times."""
    assert should_retry(kind, attempt, max_retries) is expected
