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
from llm_annotator.clients.metrics import engine_progress
from llm_annotator.clients.retry import retry_delay, should_retry
from llm_annotator.errors import MalformedResponseError
from llm_annotator.pool.failures import (
    Action,
    action_for,
    evicts,
    fault_once_healthy,
    gives_up_on_sample,
    timeout_action,
)
from llm_annotator.pool.health import probation
from llm_annotator.pool.stall import hung, stall_window


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


# -- the pool's policy: whose fault, when to evict, when a member is hung --------------------

POOL_ACTIONS = {
    ErrorKind.CONNECT: Action.EVICT,
    ErrorKind.ENGINE_DEAD: Action.EVICT,
    ErrorKind.CONNECT_TIMEOUT: Action.VERIFY,
    ErrorKind.OVERLOADED: Action.BACKOFF,
    ErrorKind.DISCONNECTED: Action.VERIFY,
    ErrorKind.SERVER_ERROR: Action.SERVER_FAULT,
    ErrorKind.MALFORMED: Action.SERVER_FAULT,
    ErrorKind.OVERSIZED: Action.SERVER_FAULT,
    ErrorKind.READ_TIMEOUT: Action.TIMED_OUT,
    ErrorKind.AUTH: Action.DISABLE,
    ErrorKind.NOT_FOUND: Action.DISABLE,
    ErrorKind.TLS: Action.DISABLE,
    ErrorKind.REDIRECT: Action.DISABLE,
    ErrorKind.BAD_REQUEST: Action.ERROR_ROW,
    ErrorKind.HTTP_ERROR: Action.ERROR_ROW,
    ErrorKind.POISON: Action.ERROR_ROW,
}
"""The failure taxonomy of the pool guide's table (docs/pool.md): the server's faults are re-sent
elsewhere, the sample's stay error rows."""


@pytest.mark.parametrize(("kind", "action"), POOL_ACTIONS.items(), ids=lambda x: str(x))
def test_failure_taxonomy(kind: ErrorKind, action: Action) -> None:
    """Each kind of failure leads to the action the taxonomy names."""
    assert action_for(kind) is action


def test_every_kind_a_request_can_fail_with_has_an_action() -> None:
    """No kind a client returns is left out of the table (job-level kinds aside)."""
    job_kinds = {ErrorKind.INPUT, ErrorKind.INVALID_OUTPUT, ErrorKind.TRUNCATED}
    assert set(POOL_ACTIONS) == set(ErrorKind) - job_kinds


def test_a_cut_off_answer_on_a_healthy_server_is_its_fault() -> None:
    assert fault_once_healthy(ErrorKind.DISCONNECTED)
    assert not fault_once_healthy(ErrorKind.CONNECT_TIMEOUT)


@pytest.mark.parametrize(
    ("answering", "action"), [(True, Action.ERROR_ROW), (False, Action.SERVER_FAULT)]
)
def test_a_timeout_is_the_servers_fault_only_if_it_answers_nothing(
    answering: bool, action: Action
) -> None:
    assert timeout_action(member_answering=answering) is action


@pytest.mark.parametrize(
    ("streak", "limit", "evicted"), [(1, 3, False), (2, 3, False), (3, 3, True), (1, 1, True)]
)
def test_eviction_after_a_few_server_faults_in_a_row(
    streak: int, limit: int, evicted: bool
) -> None:
    assert evicts(streak, limit) is evicted


@pytest.mark.parametrize(
    ("faults", "answered_since", "error_row"),
    [
        (1, True, False),  # sent again elsewhere
        (2, True, False),
        (3, True, True),  # failed on every try while others succeed: the sample's fault
        (3, False, False),  # nothing succeeds anywhere: a storm, not a result
        (50, False, False),
    ],
)
def test_a_sample_ends_only_when_it_breaks_servers_that_serve_others(
    faults: int, answered_since: bool, error_row: bool
) -> None:
    """With max_sample_retries=2."""
    assert gives_up_on_sample(faults, 2, pool_answered_since=answered_since) is error_row


@pytest.mark.parametrize(
    ("own", "pool", "window", "timing"),
    [
        (None, None, 30.0, False),  # no evidence yet: only /metrics may say hung
        (1.0, None, 30.0, True),
        (None, 2.0, 30.0, True),  # the pool's answers are the evidence
        (20.0, 2.0, 60.0, True),  # its own gaps count first
        (None, 40.0, 120.0, True),
    ],
)
def test_the_stall_window_grows_with_the_gaps_seen(
    own: float | None, pool: float | None, window: float, timing: bool
) -> None:
    assert stall_window(30.0, own_gap=own, pool_gap=pool, factor=3.0) == (window, timing)


@pytest.mark.parametrize(
    ("quiet", "timing", "before", "now", "verdict"),
    [
        (10.0, True, None, None, None),  # within the window
        (10.0, True, 5.0, 5.0, None),
        (31.0, True, 5.0, 5.0, True),  # counters stood still
        (31.0, False, 5.0, 5.0, True),  # the counters alone suffice
        (31.0, True, 5.0, 9.0, False),  # busy, slow for us: never evicted
        (31.0, False, 5.0, 9.0, False),
        (31.0, True, None, 9.0, True),  # counters unreadable before: timing decides
        (31.0, True, None, None, True),
        (31.0, False, None, None, False),  # nothing can tell: leave it to the deadline
    ],
)
def test_hung_verdicts(
    quiet: float, timing: bool, before: float | None, now: float | None, verdict: bool | None
) -> None:
    result = hung(quiet, 30.0, timing_decides=timing, progress_before=before, progress_now=now)
    assert result is verdict


@pytest.mark.parametrize(
    ("evictions", "failed", "seconds"),
    [(1, 0, 3.0), (2, 0, 6.0), (3, 0, 12.0), (1, 2, 12.0), (5, 5, 300.0), (1000, 0, 300.0)],
)
def test_probation_doubles_and_is_capped(evictions: int, failed: int, seconds: float) -> None:
    assert probation(evictions, failed, 3.0, 300.0) == seconds


def test_engine_progress_sums_the_counters_of_a_real_vllm_metrics_page() -> None:
    """The three counters, every label set, a timestamp after a value; other lines and
    look-alike names (``_created``) ignored."""
    body = b"""# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 120.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e9
vllm:prompt_tokens_total{engine="0",model_name="m"} 30.0 1700000000000
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
"""
    assert engine_progress(body) == 155.0
    assert engine_progress(b"") is None
    assert engine_progress(b"vllm:prompt_tokens_total nan\n") is None
