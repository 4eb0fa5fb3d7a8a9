"""The contract every client meets, and the options every provider understands."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

from llm_annotator._constants import HEALTH_TIMEOUT
from llm_annotator._sync import run_sync
from llm_annotator.errors import ConfigurationError, ProviderError
from llm_annotator.response import OnError, Response

Messages = list[dict[str, str]]
"""One conversation: a list of ``{"role": ..., "content": ...}`` dicts."""


@dataclass(frozen=True, slots=True)
class ProviderRuntimeOptions:
    """Generation options every provider understands.

    Attributes:
        max_completion_tokens: Upper bound on generated tokens. ``None`` leaves it to
            the server.
        output_schema: A JSON schema the output must follow, or ``None`` for free text.

    Examples:
        >>> ProviderRuntimeOptions(max_completion_tokens=16).to_payload()
        {'max_completion_tokens': 16}
        >>> ProviderRuntimeOptions(max_completion_tokens=-1)
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: max_completion_tokens must be a positive ...
    """

    max_completion_tokens: int | None = None
    output_schema: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        mct = self.max_completion_tokens
        if mct is not None and (isinstance(mct, bool) or not isinstance(mct, int) or mct < 1):
            raise ConfigurationError(
                f"max_completion_tokens must be a positive integer or None, got {mct!r}"
            )
        if self.output_schema is not None and not isinstance(self.output_schema, dict):
            raise ConfigurationError(
                "output_schema must be a JSON schema as a dict or None, "
                f"got {type(self.output_schema).__name__}"
            )

    def to_payload(self) -> dict[str, Any]:
        """Build the OpenAI chat-completions parameters these options stand for.

        Returns:
            A dict of request parameters; options left at None are omitted.
        """
        payload: dict[str, Any] = {}
        if self.max_completion_tokens is not None:
            payload["max_completion_tokens"] = self.max_completion_tokens
        if self.output_schema is not None:
            payload["response_format"] = json_schema_format(self.output_schema)
        return payload


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    """The ``response_format`` that asks for output following ``schema``.

    Examples:
        >>> json_schema_format({"type": "object"})["json_schema"]["name"]
        'response'
    """
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


OptionsT = TypeVar("OptionsT", bound=ProviderRuntimeOptions)


def settle_failures(
    results: list[Response | ProviderError],
    *,
    on_error: OnError,
    logger: Any,
    server: str | None,
    model: str | None,
    provider: str,
) -> list[Response]:
    """Apply ``on_error`` to the failures among one call's results.

    ``"raise"`` raises the first failure; ``"warn"`` logs one ``requests_failed`` line
    for the call (how many, of which kinds, the first message) on ``logger``; both
    ``"warn"`` and ``"ignore"`` return every result in place, each failure as an error
    :class:`Response`.

    Raises:
        ProviderError: The first failure, with ``on_error="raise"``.

    Examples:
        >>> from llm_annotator.errors import ErrorKind
        >>> failed = ProviderError("boom", kind=ErrorKind.SERVER_ERROR, server="s")
        >>> [r.error_type for r in settle_failures(
        ...     [Response(text="ok"), failed], on_error="ignore", logger=None,
        ...     server="s", model="m", provider="p")]
        [None, 'server_error']
    """
    errors = [r for r in results if isinstance(r, ProviderError)]
    if not errors:
        return results  # type: ignore[return-value]  # no ProviderError left
    if on_error == "raise":
        raise errors[0]
    if on_error == "warn":
        logger.warning(
            "requests_failed",
            server=server,
            failed=len(errors),
            total=len(results),
            kinds=dict(Counter(e.kind.value for e in errors)),
            first_error=str(errors[0]),
        )
    return [
        Response(
            error=str(r),
            error_type=r.kind.value,
            server=server,
            model=model,
            provider=provider,
        )
        if isinstance(r, ProviderError)
        else r
        for r in results
    ]


class Client(ABC, Generic[OptionsT]):
    """What every client offers: one or many generations, health, and cleanup.

    The async methods (``agenerate``, ``abatch_generate``, ``ais_healthy``, ``aclose``)
    are the core. The sync ones run them on a shared background event loop, so they
    also work where a loop is already running, as in a notebook. A client is a context
    manager, sync and async.
    """

    provider: str = "client"

    @abstractmethod
    async def agenerate(
        self,
        *,
        messages: Messages,
        options: OptionsT | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> Response:
        """Async twin of :meth:`generate`."""

    @abstractmethod
    async def abatch_generate(
        self,
        *,
        messages: list[Messages],
        options: OptionsT | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> list[Response]:
        """Async twin of :meth:`batch_generate`."""

    @abstractmethod
    async def ais_healthy(self, timeout: float = HEALTH_TIMEOUT) -> bool:
        """Async twin of :meth:`is_healthy`."""

    async def aclose(self) -> None:
        """Release connections and other resources. Safe to call twice."""

    def generate(
        self,
        *,
        messages: Messages,
        options: OptionsT | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> Response:
        """Generate one response for one conversation."""
        return run_sync(self.agenerate(messages=messages, options=options, gen_kwargs=gen_kwargs))

    def batch_generate(
        self,
        *,
        messages: list[Messages],
        options: OptionsT | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> list[Response]:
        """Generate one response per conversation, in input order."""
        return run_sync(
            self.abatch_generate(messages=messages, options=options, gen_kwargs=gen_kwargs)
        )

    def is_healthy(self, timeout: float = HEALTH_TIMEOUT) -> bool:
        """Whether the backend can take requests now."""
        return run_sync(self.ais_healthy(timeout))

    def close(self) -> None:
        """Release connections and other resources. Safe to call twice."""
        run_sync(self.aclose())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
