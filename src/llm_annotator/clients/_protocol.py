"""The chat-completions wire format: decode answers, classify error statuses."""

from __future__ import annotations

from typing import Any

import orjson

from llm_annotator.errors import ErrorKind, MalformedResponseError, ProviderError, StatusError
from llm_annotator.response import Response

_ENGINE_DEAD_MARKERS = (
    "EngineCore encountered",
    "EngineDeadError",
    "engine is dead",
    "Engine loop is not running",
    "EngineGenerateError",
)

#: The most characters one generated token may decode to, with room to spare: the
#: longest tokens of common vocabularies (runs of spaces, of ``=``) are far shorter.
#: An answer longer than this times its token limit cannot have come from the engine.
MAX_CHARS_PER_TOKEN = 1024
#: Characters an answer may hold beyond its tokens' share (a short limit's slack).
ANSWER_SLACK_CHARS = 4096


def classify_status(status: int, message: str = "") -> ErrorKind:
    """The kind of failure an HTTP error status stands for.

    Examples:
        >>> classify_status(400, "maximum context length is 512 tokens")
        <ErrorKind.BAD_REQUEST: 'bad_request'>
        >>> classify_status(500, "EngineCore encountered an issue. See stack trace")
        <ErrorKind.ENGINE_DEAD: 'engine_dead'>
        >>> classify_status(503, "The engine is currently busy")
        <ErrorKind.OVERLOADED: 'overloaded'>
    """
    if 300 <= status < 400:
        return ErrorKind.REDIRECT
    if status in (400, 413, 422):
        return ErrorKind.BAD_REQUEST
    if status in (401, 403):
        return ErrorKind.AUTH
    if status == 404:
        return ErrorKind.NOT_FOUND
    if status in (429, 503):
        return ErrorKind.OVERLOADED
    if status == 500 and any(marker in message for marker in _ENGINE_DEAD_MARKERS):
        return ErrorKind.ENGINE_DEAD
    if status >= 500 or status in (408, 409):
        return ErrorKind.SERVER_ERROR
    return ErrorKind.HTTP_ERROR


def error_message(body: bytes) -> str:
    """The human message inside an error body, whatever shape the server used.

    Examples:
        >>> error_message(b'{"error": {"message": "bad", "type": "BadRequestError"}}')
        'BadRequestError: bad'
        >>> error_message(b'{"detail": "Not Found"}')
        'Not Found'
        >>> error_message(b'<html>502 Bad Gateway</html>')
        '<html>502 Bad Gateway</html>'
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _snippet(body)
    if isinstance(data, dict):
        inner = data.get("error", data)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            kind = inner.get("type")
            prefix = f"{_clip(kind, 80)}: " if isinstance(kind, str) and kind else ""
            return _clip(f"{prefix}{inner['message']}")
        if isinstance(inner, str):
            return _clip(inner)
        if isinstance(data.get("detail"), str):
            return _clip(data["detail"])
    # Only strings are quoted from the body, never a repr of its values: a value
    # nested a thousand deep would make repr() raise RecursionError.
    return _snippet(body)


def status_error(status: int, body: bytes, server: str, location: str | None = None) -> StatusError:
    """The exception for an HTTP error answer (or a redirect, which is never followed).

    Examples:
        >>> str(status_error(307, b"", "http://a:1/v1", location="http://b:2/v1/chat"))
        "http://a:1/v1: HTTP 307 redirect to 'http://b:2/v1/chat', not followed: ..."
    """
    if 300 <= status < 400:
        return StatusError(
            f"HTTP {status} redirect to {location or '<no Location>'!r}, not followed: the "
            "prompt would go to another address; if that is the server, give its URL as "
            "the base URL",
            kind=ErrorKind.REDIRECT,
            server=server,
            status_code=status,
        )
    message = error_message(body)
    kind = classify_status(status, message)
    hint = _HINTS.get(kind, "")
    return StatusError(
        f"HTTP {status}: {message}{hint}", kind=kind, server=server, status_code=status
    )


_HINTS = {
    ErrorKind.NOT_FOUND: (
        " (check the base URL and the model name; leave model=None to use the model "
        "the server serves)"
    ),
    ErrorKind.AUTH: (
        " (check the API key: api_key=, the VLLM_API_KEY environment variable, or "
        "--api-key-file/--api-key-env on the command line)"
    ),
}


def parse_completion(
    body: bytes, *, server: str, provider: str, token_limit: int | None = None
) -> Response:
    """Decode a 2xx chat-completion body into a Response, checking it first.

    The body must be a JSON object with a non-empty list of ``choices``; the first
    choice needs a ``message`` object whose ``content`` is a string, or null together
    with a reasoning text or tool calls, and a string ``finish_reason``. ``usage`` may
    be missing, but token counts that are there must be integers >= 0. A 2xx that
    carries an ``error`` object instead is malformed too.

    With the request's ``token_limit``, an answer the engine could not have produced
    under it is malformed as well (a lying server): more completion tokens than the
    limit, or more text and reasoning than :data:`MAX_CHARS_PER_TOKEN` characters a
    token plus :data:`ANSWER_SLACK_CHARS`.

    Raises:
        MalformedResponseError: If the body is not such a chat completion; the message
            names the defect.

    Examples:
        >>> parse_completion(b'{"choices": []}', server="s", provider="p")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.MalformedResponseError: s: answered 2xx with a body that is not a chat completion: 'choices' is empty: {"choices": []}
        >>> long = b'{"choices": [{"message": {"content": "%s"}, "finish_reason": "length"}]}'
        >>> parse_completion(long % (b"x" * 12_289), server="s", provider="p", token_limit=8)
        Traceback (most recent call last):
        ...
        llm_annotator.errors.MalformedResponseError: s: answered 2xx with a body that is not a chat completion: 12289 characters of text and reasoning, more than 8 tokens can hold (at most 12288): ...
    """  # noqa: E501
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _malformed(f"not JSON ({exc})", body, server) from exc
    response = _completion(data, body, server, provider)
    if token_limit is not None:
        defect = beyond_token_limit(response, token_limit)
        if defect is not None:
            raise _malformed(defect, body, server)
    return response


def beyond_token_limit(response: Response, token_limit: int) -> str | None:
    """Why ``response`` cannot be an engine's answer under ``token_limit``, or None.

    Examples:
        >>> ok = Response(text="a" * 5000, finish_reason="length", num_output_tokens=8)
        >>> beyond_token_limit(ok, 8) is None
        True
        >>> beyond_token_limit(Response(text="", finish_reason="stop", num_output_tokens=9), 8)
        'usage.completion_tokens is 9, more than the limit of 8 tokens asked for'
    """
    tokens = response.num_output_tokens
    if tokens is not None and tokens > token_limit:
        return (
            f"usage.completion_tokens is {tokens}, more than the limit of {token_limit} "
            "tokens asked for"
        )
    chars = len(response.text or "") + len(response.reasoning or "")
    most = token_limit * MAX_CHARS_PER_TOKEN + ANSWER_SLACK_CHARS
    if chars > most:
        return (
            f"{chars} characters of text and reasoning, more than {token_limit} tokens "
            f"can hold (at most {most})"
        )
    return None


def token_limit(params: dict[str, Any]) -> int | None:
    """The most tokens a request with ``params`` may be answered with, as the server
    reads it: ``max_completion_tokens`` first, then ``max_tokens``; None for none (or
    a value the server will refuse anyway), and None with vLLM's ``echo``, whose
    answer starts with the conversation's last message.

    Examples:
        >>> token_limit({"max_tokens": 8}), token_limit({"max_completion_tokens": 4, "max_tokens": 8})
        (8, 4)
        >>> token_limit({}), token_limit({"max_tokens": "8"}), token_limit({"max_tokens": True})
        (None, None, None)
        >>> token_limit({"max_tokens": 8, "echo": True}) is None
        True
    """  # noqa: E501
    if params.get("echo"):
        return None
    for key in ("max_completion_tokens", "max_tokens"):
        value = params.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None
        limit: int = value
        return limit
    return None


def _completion(data: Any, body: bytes, server: str, provider: str) -> Response:
    if not isinstance(data, dict):
        raise _malformed(f"the body is {_type(data)}, not an object", body, server)
    if "choices" not in data and "error" in data:
        raise _malformed(f"it is an error: {error_message(body)}", body, server)
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise _malformed(f"'choices' is {_type(choices)}, not a list", body, server)
    if not choices:
        raise _malformed("'choices' is empty", body, server)
    choice = choices[0]
    if not isinstance(choice, dict):
        raise _malformed(f"choices[0] is {_type(choice)}, not an object", body, server)
    message = choice.get("message")
    if not isinstance(message, dict):
        raise _malformed(f"choices[0].message is {_type(message)}, not an object", body, server)
    text = message.get("content")
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if text is not None and not isinstance(text, str):
        raise _malformed(f"message.content is {_type(text)}, not a string", body, server)
    if reasoning is not None and not isinstance(reasoning, str):
        raise _malformed(f"message reasoning is {_type(reasoning)}, not a string", body, server)
    tool_calls = message.get("tool_calls")
    if text is None and not reasoning and not (isinstance(tool_calls, list) and tool_calls):
        raise _malformed("message.content is null, with no reasoning or tool call", body, server)
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise _malformed(f"finish_reason is {_type(finish_reason)}, not a string", body, server)
    usage = data.get("usage")
    if usage is None:
        usage = {}
    elif not isinstance(usage, dict):
        raise _malformed(f"'usage' is {_type(usage)}, not an object", body, server)
    prompt_tokens = _count(usage, "prompt_tokens", body, server)
    output_tokens = _count(usage, "completion_tokens", body, server)
    stop_reason = choice.get("stop_reason")
    model = data.get("model")
    return Response(
        text=text,
        finish_reason=finish_reason,
        stop_reason=(
            stop_reason
            if isinstance(stop_reason, str | int) and not isinstance(stop_reason, bool)
            else None
        ),
        model=model if isinstance(model, str) else None,
        provider=provider,
        server=server,
        num_prompt_tokens=prompt_tokens,
        num_output_tokens=output_tokens,
        reasoning=reasoning,
        raw=data,
    )


def _count(usage: dict[str, Any], name: str, body: bytes, server: str) -> int | None:
    value = usage.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _malformed(f"usage.{name} is {_shown(value)}, not an integer >= 0", body, server)
    count: int = value
    return count


def parse_model_list(body: bytes, *, server: str) -> list[str]:
    """The model names of a ``/models`` answer.

    Raises:
        MalformedResponseError: If the body is not a model list.

    Examples:
        >>> parse_model_list(b'{"data": [{"id": "tiny"}]}', server="s")
        ['tiny']
    """
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise _malformed(f"not JSON ({exc})", body, server, what="a model list") from exc
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise _malformed("no 'data' list", body, server, what="a model list")
    names: list[str] = []
    for entry in entries:
        name = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not name:
            raise _malformed(
                f"an entry ({_type(entry)}) has no string 'id'", body, server, what="a model list"
            )
        names.append(name)
    return names


def _malformed(
    defect: str, body: bytes, server: str, *, what: str = "a chat completion"
) -> ProviderError:
    return MalformedResponseError(
        f"answered 2xx with a body that is not {what}: {defect}: {_snippet(body)}",
        kind=ErrorKind.MALFORMED,
        server=server,
    )


def _type(value: object) -> str:
    if value is None:
        return "null"
    names = {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }
    return names.get(type(value), f"a {type(value).__name__}")


def _shown(value: object) -> str:
    """A short description of a JSON value: scalars as they are, containers by type.

    Examples:
        >>> _shown("5"), _shown(-1), _shown([[1]]), _shown("x" * 100)[-4:]
        ("'5'", '-1', 'a list', "...'")
    """
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:40])[:-1] + "...'"
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    return _type(value)


def _clip(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body[:limit].decode("utf-8", errors="replace").strip()
    return text + ("..." if len(body) > limit else "") if text else "<empty body>"
