"""Online vLLM provider: a running OpenAI-compatible vLLM server.

The counterpart that loads the weights in-process instead of talking to a server is
vllm_offline_client. Both share VLLMBaseRuntimeOptions, which lives here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from llm_annotator._constants import (
    CONNECT_TIMEOUT,
    HEALTH_TIMEOUT,
    MAX_RESPONSE_BYTES,
    MAX_RETRIES,
    TIMEOUT,
)
from llm_annotator._constants import MAX_CONNECTIONS as _MAX_CONNECTIONS
from llm_annotator._sync import run_sync
from llm_annotator.clients._transport import HttpTransport, Verify, server_root, unverified_context
from llm_annotator.clients.base import Messages, ProviderRuntimeOptions, json_schema_format
from llm_annotator.clients.metrics import EngineLoad, engine_load, engine_progress
from llm_annotator.clients.openai_client import OpenAIClient, check_single_choice
from llm_annotator.errors import ConfigurationError, ProviderError
from llm_annotator.response import OnError, Response

MAX_CONNECTIONS = _MAX_CONNECTIONS
"""How many sockets one client may hold open to its server at once.

The OpenAI SDK caps its HTTP client at 1000 connections (DEFAULT_CONNECTION_LIMITS in
openai/_constants.py), and a pooled run can ask for more: a batch_size of 1024 times the
default max_concurrent_batches_per_client of 4 is 4096 requests in flight through one
client. Above the cap httpx queues the rest, which would keep part of a batch from
reaching the server that is supposed to schedule it.
"""

# The keyword arguments the OpenAI SDK's chat.completions.create() types itself; every
# other parameter is a vLLM extension and travels under extra_body there.
_OPENAI_CHAT_PARAMS = frozenset(
    {
        "audio",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "max_completion_tokens",
        "max_tokens",
        "metadata",
        "modalities",
        "n",
        "parallel_tool_calls",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "service_tier",
        "stop",
        "store",
        "stream",
        "stream_options",
        "temperature",
        "tool_choice",
        "tools",
        "top_logprobs",
        "top_p",
        "user",
        "verbosity",
        "web_search_options",
    }
)


def server_is_healthy(base_url: str, timeout: float, *, verify: Verify = True) -> bool:
    """Check whether a vLLM server answers its /health endpoint.

    Args:
        base_url: Base URL of the server, with or without the ``/v1`` suffix.
        timeout: Maximum number of seconds to wait for an answer.
        verify: How to check an ``https://`` server's certificate, as for
            :class:`VLLMOnlineClient`.

    Returns:
        Whether the server answers with status 200.
    """
    transport = HttpTransport(
        server_root(base_url),
        connect_timeout=min(timeout, CONNECT_TIMEOUT),
        read_timeout=timeout,
        max_connections=1,
        verify=unverified_context() if verify is False else verify,
        max_response_bytes=_HEALTH_BODY_BYTES,
    )

    async def check() -> bool:
        try:
            status, _, _ = await transport.get(transport.root + "/health", timeout=timeout)
        except ProviderError:
            return False
        finally:
            await transport.aclose()
        return status == 200

    return run_sync(check())


_HEALTH_BODY_BYTES = 64 * 1024
"""A /health answer is empty; more than this is not a vLLM server."""


def _check_number(
    name: str, value: float | None, *, low: float, high: float = math.inf, low_open: bool = False
) -> None:
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        upper = "" if high == math.inf else f" and <= {high:g}"
        raise ConfigurationError(f"{name} must be a number {bound}{upper} or None, got {value!r}")


def _check_dict(name: str, value: object) -> None:
    if value is not None and not isinstance(value, dict):
        raise ConfigurationError(f"{name} must be a dict or None, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class VLLMBaseRuntimeOptions(ProviderRuntimeOptions):
    """Shared generation options for both vLLM server and offline clients.

    Every field here means the same thing to both vLLM clients, so a step can be moved
    between vllm_online and vllm_offline without its decoding quietly changing. Fields
    that only one of the two accepts live on that subclass instead.

    Attributes:
        temperature: Sampling temperature. ``None`` uses the model default; ``0.0``
            gives greedy, reproducible decoding.
        top_p: Nucleus-sampling probability mass. ``None`` uses the model default.
        top_k: Controls the number of top tokens to consider. Set to -1 to consider
            all tokens.
        repetition_penalty: Penalizes new tokens based on whether they appear in the
            prompt and the generated text so far. Values > 1 encourage the model to use
            new tokens; values < 1 encourage repetition.
        presence_penalty: Penalty applied to tokens already present in the output.
        frequency_penalty: Penalty applied proportional to token frequency in the output.
        stop: Optional list of strings that halt generation when produced.
        seed: Optional fixed random seed for reproducible generation.
        chat_template_kwargs: Additional kwargs forwarded to the chat template. Pass
            ``{"enable_thinking": True}`` here to enable thinking mode.
        extra_body: Any other parameter the backend accepts, merged into the request
            last. This is the escape hatch for everything the fields above do not name,
            such as ``min_p`` or ``stop_token_ids``. It cannot ask for more than one
            response per sample: the clients read the first one and drop the rest, so
            an ``n`` above 1 is rejected.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    extra_body: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        """Reject an extra_body that asks for more than one response.

        Other fields out of range are rejected here too, each naming the field.

        Raises:
            ValueError: If ``extra_body`` sets ``n`` to anything but 1.

        Examples:
            >>> VLLMBaseRuntimeOptions(extra_body={"n": 2})
            Traceback (most recent call last):
            ...
            llm_annotator.errors.ConfigurationError: extra_body sets n=2; only one response ...
        """
        ProviderRuntimeOptions.__post_init__(self)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1
        ):
            raise ConfigurationError(f"top_k must be an integer >= -1 or None, got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ConfigurationError(f"seed must be an integer or None, got {self.seed!r}")
        if self.stop is not None and (
            not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop)
        ):
            raise ConfigurationError(f"stop must be a list of strings or None, got {self.stop!r}")
        _check_dict("chat_template_kwargs", self.chat_template_kwargs)
        _check_dict("extra_body", self.extra_body)
        if self.extra_body is not None:
            check_single_choice(self.extra_body, "extra_body")

    def to_payload(self) -> dict[str, Any]:
        """Build the request payload shared by both vLLM clients.

        chat_template_kwargs and extra_body are deliberately excluded: the two clients
        place them differently, so each subclass adds them.

        Returns:
            A dict of the parameters both vLLM backends spell identically.

        Examples:
            >>> VLLMBaseRuntimeOptions(max_completion_tokens=8, temperature=0.0).to_payload()
            {'max_tokens': 8, 'temperature': 0.0}
        """
        fields = (
            ("max_tokens", self.max_completion_tokens),
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("top_k", self.top_k),
            ("repetition_penalty", self.repetition_penalty),
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("stop", self.stop),
            ("seed", self.seed),
        )
        return {name: value for name, value in fields if value is not None}


@dataclass(frozen=True, slots=True)
class VLLMOnlineRuntimeOptions(VLLMBaseRuntimeOptions):
    """Generation options for the vLLM OpenAI-compatible server.

    Extends VLLMBaseRuntimeOptions with server-specific parameters from the
    /v1/chat/completions extra-params API.

    Attributes:
        add_generation_prompt: If ``True``, appends a generation prompt to each
            message. Defaults to ``True``.
        chat_template: Optional chat template string. When omitted the model's default
            template is used.
        mm_processor_kwargs: Arguments forwarded to the model's multi-modal processor
            (e.g. ``{"num_crops": 4}`` for Phi-3-Vision).
    """

    add_generation_prompt: bool = True
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        VLLMBaseRuntimeOptions.__post_init__(self)
        if not isinstance(self.add_generation_prompt, bool):
            raise ConfigurationError(
                f"add_generation_prompt must be a bool, got {self.add_generation_prompt!r}"
            )
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ConfigurationError(
                f"chat_template must be a string or None, got {self.chat_template!r}"
            )
        _check_dict("mm_processor_kwargs", self.mm_processor_kwargs)

    def to_payload(self) -> dict[str, Any]:
        """Build the flat JSON body for vLLM's chat-completions route.

        An output_schema becomes a response_format of type json_schema, which is the
        form vLLM reads on /v1/chat/completions: it turns it into the engine's
        structured-output parameters, and it overrides a structured_outputs block in
        the same body. split_payload divides the result over the SDK's typed arguments
        and extra_body.

        Returns:
            A dict of vLLM server request parameters, including all shared base fields.

        Examples:
            >>> fmt = VLLMOnlineRuntimeOptions(
            ...     output_schema={"type": "object"}
            ... ).to_payload()["response_format"]
            >>> fmt["type"], fmt["json_schema"]["name"]
            ('json_schema', 'response')
        """
        payload = VLLMBaseRuntimeOptions.to_payload(self)
        payload["add_generation_prompt"] = self.add_generation_prompt
        if self.chat_template is not None:
            payload["chat_template"] = self.chat_template
        if self.chat_template_kwargs is not None:
            payload["chat_template_kwargs"] = self.chat_template_kwargs
        if self.mm_processor_kwargs is not None:
            payload["mm_processor_kwargs"] = self.mm_processor_kwargs
        if self.output_schema is not None:
            payload["response_format"] = json_schema_format(self.output_schema)
        if self.extra_body:
            payload.update(self.extra_body)
        return payload

    def split_payload(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """Split the payload into OpenAI-typed kwargs and an extra_body.

        The OpenAI SDK validates chat.completions.create against its own signature, so
        vLLM's extensions must be nested rather than passed as keyword arguments.

        Returns:
            ``(kwargs, extra_body)``, where ``kwargs`` goes to ``create()`` and
            ``extra_body`` is nested under its ``extra_body=`` parameter.

        Examples:
            >>> opts = VLLMOnlineRuntimeOptions(temperature=0.0, top_k=20)
            >>> standard, extra = opts.split_payload()
            >>> standard
            {'temperature': 0.0}
            >>> sorted(extra)
            ['add_generation_prompt', 'top_k']
        """
        standard: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in self.to_payload().items():
            (standard if key in _OPENAI_CHAT_PARAMS else extra)[key] = value
        return standard, extra


_DEFAULT_PAYLOAD = VLLMOnlineRuntimeOptions().to_payload()


class VLLMOnlineClient(OpenAIClient[VLLMOnlineRuntimeOptions]):
    """Client for a running vLLM OpenAI-compatible server.

    A batch is one /v1/chat/completions request per conversation, sent concurrently.
    The server batches the requests it holds continuously, so they are scheduled
    together on the GPU, every request carries its own usage (which fills
    num_output_tokens per sample), and a conversation that fails is a single error
    Response rather than a failure of the whole batch.

    Args:
        model: Model identifier. When omitted, the server is asked which model it serves.
        base_url: Base URL for the vLLM API endpoint.
        max_workers: Maximum number of requests ``batch_generate`` sends at once.
            ``None`` sends the whole batch, which is what lets the server schedule it as
            one workload. Lower it only to protect a server that is shared with other
            jobs.
        timeout: Seconds one request may spend reading its answer. It covers the wait
            in the server's queue as well as the generation itself, so a value below the
            time a full batch needs turns a healthy run into errors. The default of one
            hour fits a loaded server that holds thousands of prompts. Making the
            connection has its own, short limit, so a host that drops packets rather
            than refusing the connection gives ``VLLMQueueAnnotator`` the errors it
            evicts the server on within seconds.
        max_retries: How often a request is retried. Connection errors, request
            timeouts and the status codes 408, 409, 429 and 5xx are retried, with an
            exponential backoff of 0.5 to 8 seconds. Two retries cover a server that
            restarts without letting a broken pool member stall a batch for long.
        on_error: Error behavior when generation fails.
        api_key: Bearer token, for a server started with ``--api-key``. When omitted,
            the ``VLLM_API_KEY`` environment variable is used if set (the variable vLLM's
            own server reads), never ``OPENAI_API_KEY``. The key is never logged and is
            cut out of error messages that quote it.
        connect_timeout: Seconds to establish a connection.
        verify: How to check the server's TLS certificate for ``https://`` URLs:
            ``True`` (the system's trusted authorities), the path of a CA bundle (a
            PEM file, as in httpx and requests), an ``ssl.SSLContext``, or ``False``
            (no check; logs a warning). Health checks and model discovery use it too.
        max_response_bytes: The largest answer read. The default, 16 MiB, is far above
            any chat completion, and low enough that a broken server or proxy sending
            without end costs one request at most that much memory: a larger answer
            is cut off while it is read and becomes an ``oversized`` error.

    Examples:
        >>> client = VLLMOnlineClient(model="tiny", base_url="http://127.0.0.1:8000/v1")
        >>> client
        <VLLMOnlineClient base_url='http://127.0.0.1:8000/v1' model='tiny'>
        >>> client.max_response_bytes
        16777216
        >>> client.close()
    """

    provider = "vllm_online"
    api_key_env: ClassVar[str] = "VLLM_API_KEY"

    def __init__(
        self,
        model: str | None = None,
        base_url: str = "http://localhost:8000/v1",
        max_workers: int | None = None,
        timeout: float = TIMEOUT,
        max_retries: int = MAX_RETRIES,
        on_error: OnError = "warn",
        *,
        api_key: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        verify: Verify = True,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        super().__init__(
            model=model,
            base_url=base_url,
            api_key=api_key,
            max_workers=max_workers,
            timeout=timeout,
            max_retries=max_retries,
            on_error=on_error,
            connect_timeout=connect_timeout,
            max_connections=MAX_CONNECTIONS,
            verify=verify,
            max_response_bytes=max_response_bytes,
        )

    def _default_payload(self) -> dict[str, Any]:
        return dict(_DEFAULT_PAYLOAD)

    def is_healthy(self, timeout: float = HEALTH_TIMEOUT) -> bool:
        """Check whether the server answers its /health endpoint.

        Args:
            timeout: Maximum number of seconds to wait for an answer.

        Returns:
            Whether the server answers with status 200.
        """
        return run_sync(self.ais_healthy(timeout))

    async def aengine_progress(self, timeout: float = HEALTH_TIMEOUT) -> float | None:
        """How much work the server's engine has done so far, from its ``/metrics``.

        The sum of vLLM's counters of prompt tokens, generated tokens and finished
        requests: it grows while the engine works, and stands still when the engine is
        hung behind an API server that still answers ``/health``.

        Args:
            timeout: Maximum number of seconds to wait for the answer.

        Returns:
            The sum, or None if ``/metrics`` could not be read or has no such counter.
        """
        body = await self._metrics(timeout)
        return None if body is None else engine_progress(body)

    async def aengine_load(self, timeout: float = HEALTH_TIMEOUT) -> EngineLoad | None:
        """How loaded the server's engine is now, from its ``/metrics``: requests
        running and waiting, preemptions so far, KV cache in use.

        Args:
            timeout: Maximum number of seconds to wait for the answer.

        Returns:
            The load, or None if ``/metrics`` could not be read or lacks vLLM's gauges.
        """
        body = await self._metrics(timeout)
        return None if body is None else engine_load(body)

    async def _metrics(self, timeout: float) -> bytes | None:
        """The body of ``/metrics``, or None if it could not be read."""
        transport = self._transport
        try:
            status, body, _ = await transport.get(transport.root + "/metrics", timeout=timeout)
        except ProviderError:
            return None
        return body if status == 200 else None

    def generate(
        self,
        *,
        messages: Messages,
        options: VLLMOnlineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> Response:
        """Generate a single response from the vLLM server.

        Args:
            messages: List of message dicts with "role" and "content" keys.
            options: Optional generation configuration.
            gen_kwargs: Additional request parameters, merged last so they take
                precedence over ``options``.

        Returns:
            A Response object containing the generated response. A failed request is an
            error Response when ``on_error`` is ``"warn"`` or ``"ignore"``.

        Raises:
            ProviderError: If the request fails and ``on_error`` is ``"raise"``.
            ValueError: If the request asks for more than one response.
        """
        return super().generate(messages=messages, options=options, gen_kwargs=gen_kwargs)

    def batch_generate(
        self,
        *,
        messages: list[Messages],
        options: VLLMOnlineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> list[Response]:
        """Generate one response per conversation, all in flight at once.

        Each conversation is its own /v1/chat/completions request. vLLM schedules
        whatever requests it holds as one continuous batch, so the GPU sees the same
        workload as a single combined request would give it, while the result stays per
        sample: response, usage and error belong to one conversation and cannot be mixed
        up.

        Args:
            messages: List of message lists, where each list is a conversation.
            options: Optional generation configuration.
            gen_kwargs: Additional provider-specific generation kwargs that are not
                covered by the standard options. Has precedence over ``options``.

        Returns:
            A list of Response objects, one per input conversation, indexed in the same
            order as input.

        Raises:
            ProviderError: If a request fails and ``on_error`` is ``"raise"``.
            ValueError: If the request asks for more than one response.
        """
        return super().batch_generate(messages=messages, options=options, gen_kwargs=gen_kwargs)


__all__ = [
    "MAX_CONNECTIONS",
    "VLLMBaseRuntimeOptions",
    "VLLMOnlineClient",
    "VLLMOnlineRuntimeOptions",
    "server_is_healthy",
]
