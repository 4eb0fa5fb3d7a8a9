"""The chat-completions wire format: decode answers, classify error statuses."""

from __future__ import annotations

from typing import Any

import orjson

from llm_annotator.errors import ErrorKind, MalformedResponseError, StatusError
from llm_annotator.response import Response

_ENGINE_DEAD_MARKERS = (
    "EngineCore encountered",
    "EngineDeadError",
    "engine is dead",
    "Engine loop is not running",
    "EngineGenerateError",
)


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
        if isinstance(inner, dict) and "message" in inner:
            kind = inner.get("type")
            prefix = f"{kind}: " if isinstance(kind, str) and kind else ""
            return f"{prefix}{inner['message']}"
        if isinstance(inner, str):
            return inner
        if "detail" in data:
            return str(data["detail"])
    return _snippet(body)


def status_error(status: int, body: bytes, server: str) -> StatusError:
    """The exception for an HTTP error answer."""
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
    ErrorKind.AUTH: " (check the api_key)",
}


def parse_completion(body: bytes, *, server: str, provider: str) -> Response:
    """Decode a 2xx chat-completion body into a Response.

    Raises:
        MalformedResponseError: If the body is not a chat completion.
    """
    try:
        data: dict[str, Any] = orjson.loads(body)
        choice = data["choices"][0]
        message = choice["message"]
        text = message.get("content")
        if text is not None and not isinstance(text, str):
            raise TypeError("content is not a string")
        usage = data.get("usage") or {}
        return Response(
            text=text,
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            model=data.get("model"),
            provider=provider,
            server=server,
            num_prompt_tokens=usage.get("prompt_tokens"),
            num_output_tokens=usage.get("completion_tokens"),
            reasoning=message.get("reasoning_content") or message.get("reasoning"),
            raw=data,
        )
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise MalformedResponseError(
            f"answered 2xx with a body that is not a chat completion ({exc!r}): {_snippet(body)}",
            kind=ErrorKind.MALFORMED,
            server=server,
        ) from exc


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body[:limit].decode("utf-8", errors="replace").strip()
    return text + ("..." if len(body) > limit else "") if text else "<empty body>"
