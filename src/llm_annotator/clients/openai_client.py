"""A client for any OpenAI-compatible chat-completions endpoint."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar, Generic

import orjson
import structlog
import tenacity

from llm_annotator._constants import (
    CONNECT_TIMEOUT,
    HEALTH_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_RESPONSE_BYTES,
    MAX_RETRIES,
    OPENAI_TIMEOUT,
)
from llm_annotator._gc import fewer_full_collections
from llm_annotator._validate import (
    check_api_key,
    non_negative_int,
    one_of,
    positive_int,
    positive_seconds,
)
from llm_annotator.clients._protocol import (
    parse_completion,
    parse_model_list,
    status_error,
    token_limit,
)
from llm_annotator.clients._transport import HttpTransport, Verify
from llm_annotator.clients.base import Client, Messages, OptionsT, settle_failures
from llm_annotator.clients.retry import retry_delay, should_retry
from llm_annotator.errors import (
    ConfigurationError,
    ErrorKind,
    MalformedResponseError,
    ProviderError,
)
from llm_annotator.response import ON_ERROR_VALUES, OnError, Response

log = structlog.get_logger(__name__)

_CHAT_PATH = "/chat/completions"


def check_client_settings(
    *,
    timeout: float,
    max_retries: int,
    on_error: str,
    max_workers: int | None,
    max_response_bytes: int = MAX_RESPONSE_BYTES,
    connect_timeout: float = CONNECT_TIMEOUT,
) -> None:
    """Reject client settings that cannot work, naming the setting.

    Raises:
        ConfigurationError: For the first setting out of range (a ``ValueError``).
    """
    one_of("on_error", on_error, ON_ERROR_VALUES)
    positive_seconds("timeout", timeout)
    positive_seconds("connect_timeout", connect_timeout)
    non_negative_int("max_retries", max_retries)
    if max_workers is not None:
        positive_int("max_workers", max_workers)
    positive_int("max_response_bytes", max_response_bytes)


def check_single_choice(params: dict[str, Any], where: str) -> None:
    """Reject request parameters that ask for more than one response per sample."""
    n = params.get("n", 1)
    if n != 1:
        raise ConfigurationError(
            f"{where} sets n={n!r}; only one response per sample is read, so n must be 1"
        )


def _key_from_env(name: str) -> str | None:
    """The key in environment variable ``name``, without surrounding whitespace."""
    return os.environ.get(name, "").strip() or None


def _unexpected(exc: Exception, body: bytes, server: str) -> ProviderError:
    """A server answer that made the parser itself fail: malformed, never a crash."""
    return MalformedResponseError(
        f"answered with a body the parser could not handle ({type(exc).__name__}): "
        f"{body[:120].decode('utf-8', errors='replace')!r}",
        kind=ErrorKind.MALFORMED,
        server=server,
    )


class OpenAIClient(Client[OptionsT], Generic[OptionsT]):
    """Client for an OpenAI-compatible ``/chat/completions`` endpoint.

    Requests go out over one aiohttp connection pool per event loop, with a short
    connect timeout and a long read timeout. Every conversation is its own request, and
    a request that fails becomes an error :class:`Response` for that conversation only
    (or a :class:`ProviderError`, with ``on_error="raise"``).

    Args:
        model: Model name. When omitted, the server is asked which model it serves.
        base_url: Base URL of the API, ending in ``/v1``.
        api_key: Bearer token; defaults to the ``OPENAI_API_KEY`` environment variable.
            It is never logged, and cut out of error messages that quote it.
        max_workers: Most requests ``batch_generate`` keeps in flight; None for all.
        timeout: Seconds one request may take from sending it to the last byte of its
            answer: one deadline for the whole request, so a server that trickles its
            answer cannot hold it past this.
        max_retries: How often a request that failed for a transient reason is resent.
        on_error: What a failed request does: ``"raise"``, ``"warn"`` or ``"ignore"``.
        connect_timeout: Seconds to establish a connection.
        max_connections: Sockets the client may hold open at once.
        verify: How to check the server's TLS certificate for ``https://`` URLs:
            ``True`` (the system's trusted authorities), the path of a CA bundle, an
            ``ssl.SSLContext``, or ``False`` (no check; logs a warning).
        max_response_bytes: The largest answer read (16 MiB by default, far above any
            chat completion); a larger one is an ``oversized`` error, cut off while
            reading, so a broken server cannot fill the memory.

    Raises:
        ConfigurationError: If a setting is out of range or ``base_url`` is not an
            http(s) URL (a ``ValueError``).
    """

    provider = "openai"
    api_key_env: ClassVar[str] = "OPENAI_API_KEY"
    """The environment variable the key is read from when none is given."""

    def __init__(
        self,
        model: str | None = None,
        base_url: str = "http://localhost:8000/v1",
        *,
        api_key: str | None = None,
        max_workers: int | None = None,
        timeout: float = OPENAI_TIMEOUT,
        max_retries: int = MAX_RETRIES,
        on_error: OnError = "warn",
        connect_timeout: float = CONNECT_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        verify: Verify = True,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        check_client_settings(
            timeout=timeout,
            max_retries=max_retries,
            on_error=on_error,
            max_workers=max_workers,
            max_response_bytes=max_response_bytes,
            connect_timeout=connect_timeout,
        )
        check_api_key(api_key)
        if model is not None and (not isinstance(model, str) or not model):
            raise ConfigurationError(f"model must be a non-empty string or None, got {model!r}")
        self.model = model
        self.max_workers = max_workers
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.on_error: OnError = on_error
        self.max_response_bytes = max_response_bytes
        self._max_connections = max_connections
        self._transport = HttpTransport(
            base_url,
            connect_timeout=connect_timeout,
            read_timeout=timeout,
            max_connections=max_connections,
            api_key=api_key if api_key is not None else _key_from_env(self.api_key_env),
            verify=verify,
            max_response_bytes=max_response_bytes,
        )
        self.base_url = self._transport.base_url
        if verify is False:
            log.warning(
                "tls_verification_disabled",
                server=self.base_url,
                detail="verify=False: server certificates are not checked",
            )
        self._sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        self._last_limit: tuple[bytes, int | None] | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} base_url={self.base_url!r} model={self.model!r}>"

    def redact(self, error: ProviderError) -> ProviderError:
        """``error`` with this client's API key cut out of its message (for errors made
        outside the client, such as a pool's report of an unexpected failure)."""
        return self._transport.scrub(error)

    # -- payload ---------------------------------------------------------------------

    def encode_params(
        self, options: OptionsT | None = None, gen_kwargs: dict[str, Any] | None = None
    ) -> bytes:
        """The request parameters shared by every conversation of a call, as JSON.

        Encoded once per call and spliced into each request by :meth:`asend`.

        Raises:
            ValueError: If ``gen_kwargs`` asks for more than one response.
        """
        params = options.to_payload() if options is not None else self._default_payload()
        if gen_kwargs:
            check_single_choice(gen_kwargs, "gen_kwargs")
            params = {**params, **gen_kwargs}
        params.pop("messages", None)
        params.pop("model", None)
        return orjson.dumps(params)

    def _default_payload(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def _body(model: str, messages: Messages, params: bytes) -> bytes:
        # Splice the shared parameters in as bytes: they are encoded once per call.
        head = b'{"model":' + orjson.dumps(model) + b',"messages":' + orjson.dumps(messages)
        if params == b"{}":
            return head + b"}"
        return head + b"," + params[1:]

    # -- model discovery -------------------------------------------------------------

    async def alist_models(self) -> list[str]:
        """The model names the server lists on ``/models``.

        Raises:
            ProviderError: If the server cannot be asked or answers something else.
        """
        transport = self._transport
        status, body, location = await transport.get(
            self.base_url + "/models", timeout=self._transport_timeout()
        )
        try:
            if status != 200:
                raise status_error(status, body, self.base_url, location)
            return parse_model_list(body, server=self.base_url)
        except ProviderError as error:
            raise transport.scrub(error) from None
        except Exception as exc:  # a parser bug must not become a crash of the caller
            raise transport.scrub(_unexpected(exc, body, self.base_url)) from None

    async def aresolve_model(self) -> str:
        """The model to ask for: the configured one, or the first the server lists.

        ``/v1/models`` is asked again after a transient failure (a server still
        starting, a dropped connection, a 503), as often and as patiently as a request
        would be (``max_retries``, the same backoff).

        Raises:
            ProviderError: If the server cannot be asked, or serves no model.
        """
        if self.model is not None:
            return self.model
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.max_retries + 1),
            wait=lambda state: retry_delay(state.attempt_number - 1),
            retry=tenacity.retry_if_exception(_transient),
            sleep=self._sleep,
            before_sleep=self._note_model_retry,
            reraise=True,
        )
        models: list[str] = await retrying(self.alist_models)
        if not models:
            raise ProviderError(
                "/models lists no model; pass model= explicitly",
                kind=ErrorKind.NOT_FOUND,
                server=self.base_url,
            )
        self.model = models[0]
        log.info("model_discovered", server=self.base_url, model=self.model)
        return self.model

    def _note_model_retry(self, state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        log.info(
            "model_discovery_retry",
            server=self.base_url,
            attempt=state.attempt_number,
            error=str(error),
        )

    def _transport_timeout(self) -> float:
        return min(self.timeout, 30.0)

    # -- requests ----------------------------------------------------------------------

    async def _send(self, body: bytes, limit: int | None) -> Response | ProviderError:
        """Send one request, retrying transient failures; never raises ProviderError.

        ``limit`` is the request's token limit: an answer longer than it allows is
        malformed."""
        attempt = 0
        transport = self._transport
        while True:
            raw = b""
            try:
                status, raw, location = await transport.post(_CHAT_PATH, body)
                if 200 <= status < 300:
                    return parse_completion(
                        raw, server=self.base_url, provider=self.provider, token_limit=limit
                    )
                error: ProviderError = status_error(status, raw, self.base_url, location)
            except ProviderError as exc:
                error = exc
            except Exception as exc:  # a parser bug must not become a crash of the caller
                error = _unexpected(exc, raw, self.base_url)
            transport.scrub(error)
            if not should_retry(error.kind, attempt, self.max_retries):
                error.attempts = attempt + 1
                return error
            await self._sleep(retry_delay(attempt))
            attempt += 1

    async def agenerate(
        self,
        *,
        messages: Messages,
        options: OptionsT | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> Response:
        """Async twin of :meth:`generate`."""
        params = self.encode_params(options, gen_kwargs)
        result = await self.asend(messages, params)
        if isinstance(result, ProviderError):
            return self._finish([result])[0]
        return result

    async def asend(self, messages: Messages, params: bytes) -> Response | ProviderError:
        """Send one conversation with pre-encoded parameters; the building block of a pool.

        Retries as configured, never applies ``on_error`` and never raises
        ProviderError: a failure is returned, so the caller can decide by its kind.

        Args:
            messages: The conversation.
            params: From :meth:`encode_params`.

        Returns:
            The Response, or the ProviderError that took its place.
        """
        try:
            model = await self.aresolve_model()
        except ProviderError as exc:
            return exc
        try:
            body = self._body(model, messages, params)
        except TypeError as exc:
            return ProviderError(
                f"conversation cannot be encoded as JSON ({exc}); messages must be a list "
                'of {"role": ..., "content": ...} dicts of strings',
                kind=ErrorKind.BAD_REQUEST,
                server=self.base_url,
            )
        return await self._send(body, self._token_limit(params))

    def _token_limit(self, params: bytes) -> int | None:
        # The parameters of a call are one bytes object shared by all its requests:
        # decode them once per call, not once per request.
        last = self._last_limit
        if last is not None and last[0] is params:
            return last[1]
        limit = token_limit(orjson.loads(params))
        self._last_limit = (params, limit)
        return limit

    async def abatch_generate(
        self,
        *,
        messages: list[Messages],
        options: OptionsT | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> list[Response]:
        """Async twin of :meth:`batch_generate`."""
        if not messages:
            return []
        params = self.encode_params(options, gen_kwargs)
        try:
            await self.aresolve_model()
        except ProviderError as exc:
            errors: list[Response | ProviderError] = [exc] * len(messages)
            return self._finish(errors)
        # Never more in flight than there are sockets: a request queued for a socket
        # would spend its deadline before it is even sent.
        limit = min(self.max_workers or len(messages), self._max_connections)
        with fewer_full_collections():
            if limit >= len(messages):
                results = await asyncio.gather(*(self.asend(m, params) for m in messages))
            else:
                gate = asyncio.Semaphore(limit)

                async def gated(conversation: Messages) -> Response | ProviderError:
                    async with gate:
                        return await self.asend(conversation, params)

                results = await asyncio.gather(*(gated(m) for m in messages))
        return self._finish(results)

    def _finish(self, results: list[Response | ProviderError]) -> list[Response]:
        """Apply ``on_error`` to the failures of one call."""
        return settle_failures(
            results,
            on_error=self.on_error,
            logger=log,
            server=self.base_url,
            model=self.model,
            provider=self.provider,
        )

    async def ais_healthy(self, timeout: float = HEALTH_TIMEOUT) -> bool:
        """Whether the server answers ``GET /health`` with 200 within ``timeout`` seconds."""
        return await self.acheck_health(timeout) is None

    async def acheck_health(self, timeout: float = HEALTH_TIMEOUT) -> ProviderError | None:
        """Ask ``GET /health`` and say what went wrong, if anything.

        Uses the client's own connections, TLS settings and size cap.

        Returns:
            None when the server answers 200 within ``timeout`` seconds; else the
            ProviderError that says why not (its kind tells a TLS failure from a
            refused connection or an error status).
        """
        transport = self._transport
        try:
            status, body, location = await transport.get(
                transport.root + "/health", timeout=timeout
            )
        except ProviderError as error:
            return error
        if status == 200:
            return None
        return transport.scrub(status_error(status, body, self.base_url, location))

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self._transport.aclose()


__all__ = ["OpenAIClient", "check_api_key", "check_client_settings", "check_single_choice"]


def _transient(error: BaseException) -> bool:
    """A failure that asking again may cure (see ``ErrorKind.retryable``)."""
    return isinstance(error, ProviderError) and error.kind.retryable
