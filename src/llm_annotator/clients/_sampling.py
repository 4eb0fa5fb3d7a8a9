"""The engine's sampling parameters for an in-process request, built the server's way.

vLLM's OpenAI-compatible server turns a chat-completion body into the engine's
``SamplingParams`` by one rule: a field the request sets wins; else the model's own
default (its ``generation_config.json``, which vLLM reads); else the OpenAI default.
:func:`sampling_kwargs` applies that same rule to :class:`VLLMBaseRuntimeOptions`, so
that a step moved from a server to the in-process engine decodes the same. It is pure
(no vLLM import): the caller passes the model's defaults and builds the parameters.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from llm_annotator.errors import ConfigurationError

if TYPE_CHECKING:
    from llm_annotator.clients.vllm_online_client import VLLMBaseRuntimeOptions

OPENAI_DEFAULTS: Mapping[str, float] = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
}
"""What vLLM's chat route uses for these fields when neither the request nor the model
sets them (``ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS``)."""

CHAT_KEYS = frozenset(
    {"add_generation_prompt", "continue_final_message", "chat_template", "mm_processor_kwargs"}
)
"""``extra_body`` keys that shape the prompt rather than the sampling; the offline
client passes them to the chat renderer, as the server does."""

_NOT_SAMPLING = frozenset(
    {"max_completion_tokens", "response_format", "structured_outputs", "chat_template_kwargs"}
)
ENGINE_ONLY = frozenset(
    {"detokenize", "output_kind", "extra_args", "skip_clone", "output_text_buffer_length"}
)
"""``SamplingParams`` fields that belong to the engine's own bookkeeping: no server
request sets them, and some would quietly empty the answer (``detokenize``)."""


def sampling_kwargs(
    options: VLLMBaseRuntimeOptions,
    model_defaults: Mapping[str, Any],
    *,
    gen_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``SamplingParams.from_optional`` for one request.

    Args:
        options: The request's options.
        model_defaults: The model's sampling defaults, as vLLM reads them
            (``ModelConfig.get_diff_sampling_param()``).
        gen_kwargs: Raw parameters merged last, as ``extra_body`` is.

    Returns:
        The arguments. ``max_tokens`` is None when no limit is asked for: the engine
        then fills in what the context leaves after the prompt, as the server does.
        ``structured_outputs`` is a dict of ``StructuredOutputsParams`` fields, or
        absent; the caller builds the object.

    Examples:
        >>> from llm_annotator.clients.vllm_online_client import VLLMBaseRuntimeOptions
        >>> kw = sampling_kwargs(VLLMBaseRuntimeOptions(temperature=0.0), {"top_p": 0.9})
        >>> kw["temperature"], kw["top_p"], kw["top_k"], kw["max_tokens"]
        (0.0, 0.9, 0, None)
        >>> sampling_kwargs(
        ...     VLLMBaseRuntimeOptions(output_schema={"type": "object"}), {}
        ... )["structured_outputs"]
        {'json': {'type': 'object'}}
    """
    extra: dict[str, Any] = dict(options.extra_body or {})
    extra.update(gen_kwargs or {})
    chosen: dict[str, Any] = {
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "repetition_penalty": options.repetition_penalty,
        "presence_penalty": options.presence_penalty,
        "frequency_penalty": options.frequency_penalty,
    }
    for key in OPENAI_DEFAULTS:
        if extra.get(key) is not None:
            chosen[key] = extra[key]
    kwargs: dict[str, Any] = {
        key: value if (value := chosen.get(key)) is not None else model_defaults.get(key, fallback)
        for key, fallback in OPENAI_DEFAULTS.items()
    }
    kwargs["n"] = 1
    kwargs["seed"] = extra.get("seed", options.seed)
    kwargs["stop"] = extra.get("stop", options.stop)
    # The server reads max_completion_tokens before max_tokens, and falls back to the
    # model's own limit (max_new_tokens in its generation_config.json).
    kwargs["max_tokens"] = next(
        (
            value
            for value in (
                extra.get("max_completion_tokens"),
                extra.get("max_tokens"),
                options.max_completion_tokens,
                model_defaults.get("max_tokens"),
            )
            if value is not None
        ),
        None,
    )
    stop_ids = _merged_ids(extra.get("stop_token_ids"), model_defaults.get("stop_token_ids"))
    kwargs["stop_token_ids"] = stop_ids
    structured = _structured(options.output_schema, extra)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    for key, value in extra.items():
        if key in kwargs or key in OPENAI_DEFAULTS or key in CHAT_KEYS or key in _NOT_SAMPLING:
            continue
        if key in ENGINE_ONLY:
            raise ConfigurationError(
                f"extra_body sets {key}, which a server request cannot set: the in-process "
                "client refuses it too, so a step decodes the same in both places"
            )
        kwargs[key] = value
    return kwargs


def _merged_ids(asked: Iterable[int] | None, default: Iterable[int] | None) -> list[int] | None:
    """The request's stop token ids followed by the model's, each once (the server's
    merge)."""
    asked_list = list(asked) if asked else []
    default_list = list(default) if default else []
    if not default_list:
        return asked_list or None
    return list(dict.fromkeys([*asked_list, *default_list]))


def _structured(schema: dict[str, Any] | None, extra: Mapping[str, Any]) -> dict[str, Any] | None:
    """The structured-output constraint: a ``structured_outputs`` block from
    ``extra_body``, with a schema (from ``output_schema`` or a ``response_format`` of
    type json_schema) written over it, as the server does."""
    block = extra.get("structured_outputs")
    if block is not None and not isinstance(block, dict):
        raise ConfigurationError(
            f"extra_body structured_outputs must be a dict, got {type(block).__name__}"
        )
    result = dict(block) if block else None
    fmt = extra.get("response_format")
    if fmt is not None:
        # extra_body's response_format replaces the one output_schema stands for, as
        # it replaces it in a server request's body.
        if not isinstance(fmt, dict):
            raise ConfigurationError(
                f"extra_body response_format must be a dict, got {type(fmt).__name__}"
            )
        kind = fmt.get("type")
        inner = fmt.get("json_schema")
        if kind == "json_schema" and isinstance(inner, dict) and "schema" in inner:
            schema = inner["schema"]
        elif kind == "json_object":
            return {**(result or {}), "json_object": True}
        elif kind in ("structural_tag", "structural_tags"):
            return {**(result or {}), "structural_tag": json.dumps(fmt)}
        elif kind == "text":
            return result
        else:
            raise ConfigurationError(
                f"extra_body response_format: type {kind!r} is not one vLLM takes (text, "
                "json_object, json_schema with a schema, structural_tag)"
            )
    if schema is not None:
        return {**(result or {}), "json": schema}
    return result


def chat_kwargs(
    extra_body: Mapping[str, Any] | None, gen_kwargs: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The prompt-shaping keys of ``extra_body`` and ``gen_kwargs`` (see ``CHAT_KEYS``).

    Examples:
        >>> chat_kwargs({"add_generation_prompt": False, "min_p": 0.1}, None)
        {'add_generation_prompt': False}
    """
    merged = {**(extra_body or {}), **(gen_kwargs or {})}
    return {key: value for key, value in merged.items() if key in CHAT_KEYS}


__all__ = ["CHAT_KEYS", "ENGINE_ONLY", "OPENAI_DEFAULTS", "chat_kwargs", "sampling_kwargs"]
