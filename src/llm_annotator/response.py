"""The result of one generation request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

OnError = Literal["raise", "warn", "ignore"]
"""What a client does when a request fails.

``"raise"`` raises :class:`~llm_annotator.errors.ProviderError`; ``"warn"`` logs a
warning and returns an error :class:`Response`; ``"ignore"`` returns the error Response
silently.
"""

ON_ERROR_VALUES: tuple[OnError, ...] = ("raise", "warn", "ignore")


@dataclass(frozen=True, slots=True)
class Response:
    """One model answer, or the error that took its place.

    A successful Response has ``error`` None; a failed one has ``text`` None, ``error``
    saying what went wrong and where, and ``error_type`` one of the
    :class:`~llm_annotator.errors.ErrorKind` values.

    Attributes:
        text: The generated text (the message content), or None on error.
        finish_reason: Why generation stopped: ``"stop"``, ``"length"``, ...
        stop_reason: The stop string or token id that ended it, when the server says.
        model: The model that answered.
        provider: Which client produced it (e.g. ``"vllm_online"``).
        server: Base URL of the server that answered (or failed).
        num_prompt_tokens: Prompt tokens, from the server's usage.
        num_output_tokens: Generated tokens, from the server's usage.
        reasoning: The reasoning text of a thinking model, when the server splits it out.
        raw: The decoded response body, for anything the fields above do not carry.
        error: What went wrong, naming the server; None on success.
        error_type: The failure's kind; None on success.

    Examples:
        >>> Response(text="positive").ok
        True
        >>> Response(error="boom", error_type="server_error").ok
        False
    """

    text: str | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    model: str | None = None
    provider: str | None = None
    server: str | None = None
    num_prompt_tokens: int | None = None
    num_output_tokens: int | None = None
    reasoning: str | None = None
    raw: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        """Whether this Response holds an answer rather than an error."""
        return self.error is None
