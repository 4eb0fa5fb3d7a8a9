"""Runtime options: payload building, splitting, and rejecting bad values by name."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from llm_annotator import (
    ProviderRuntimeOptions,
    VLLMBaseRuntimeOptions,
    VLLMOnlineRuntimeOptions,
)


def test_base_payload_spells_max_tokens_and_omits_unset_fields() -> None:
    """Unset options are left to the server; max_completion_tokens is vLLM's max_tokens."""
    opts = VLLMBaseRuntimeOptions(max_completion_tokens=8, top_k=20, stop=["\n"], seed=3)
    assert opts.to_payload() == {"max_tokens": 8, "top_k": 20, "stop": ["\n"], "seed": 3}


def test_base_payload_excludes_client_specific_fields() -> None:
    """chat_template_kwargs, extra_body and output_schema are placed by each subclass."""
    opts = VLLMBaseRuntimeOptions(
        chat_template_kwargs={"enable_thinking": True},
        extra_body={"min_p": 0.1},
        output_schema={"type": "object"},
    )
    assert opts.to_payload() == {}


def test_online_payload_holds_every_field() -> None:
    """Every online option lands in the flat body, with extra_body merged last."""
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    opts = VLLMOnlineRuntimeOptions(
        max_completion_tokens=16,
        output_schema=schema,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        stop=["END"],
        seed=7,
        chat_template_kwargs={"enable_thinking": False},
        extra_body={"min_p": 0.05, "temperature": 0.1},
        add_generation_prompt=False,
        chat_template="{{ messages }}",
        mm_processor_kwargs={"num_crops": 4},
    )
    assert opts.to_payload() == {
        "max_tokens": 16,
        "temperature": 0.1,  # extra_body wins
        "top_p": 0.9,
        "top_k": 5,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "stop": ["END"],
        "seed": 7,
        "add_generation_prompt": False,
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"enable_thinking": False},
        "mm_processor_kwargs": {"num_crops": 4},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": schema},
        },
        "min_p": 0.05,
    }


def test_split_payload_puts_vllm_extensions_in_extra_body() -> None:
    """Only the SDK's typed parameters stay as kwargs; the rest go to extra_body."""
    opts = VLLMOnlineRuntimeOptions(
        max_completion_tokens=4,
        temperature=0.0,
        top_k=3,
        seed=1,
        output_schema={"type": "object"},
        chat_template_kwargs={"x": 1},
        extra_body={"min_p": 0.1},
    )
    standard, extra = opts.split_payload()
    assert sorted(standard) == ["max_tokens", "response_format", "seed", "temperature"]
    assert sorted(extra) == ["add_generation_prompt", "chat_template_kwargs", "min_p", "top_k"]
    assert {**standard, **extra} == opts.to_payload()


def test_options_are_frozen_and_replaceable() -> None:
    """Options are immutable; per-call changes go through dataclasses.replace."""
    opts = VLLMOnlineRuntimeOptions(temperature=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.temperature = 1.0  # type: ignore[misc]
    assert dataclasses.replace(opts, seed=4).to_payload()["seed"] == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"extra_body": {"n": 2}}, "n=2"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"stop": "END"}, "stop"),
        ({"seed": "7"}, "seed"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
        ({"extra_body": "min_p=0.1"}, "extra_body"),
        ({"output_schema": "schema"}, "output_schema"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"mm_processor_kwargs": 4}, "mm_processor_kwargs"),
    ],
)
def test_invalid_option_raises_value_error_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    """A value out of range is refused at construction, and the message names it."""
    with pytest.raises(ValueError, match=field):
        VLLMOnlineRuntimeOptions(**kwargs)


def test_extra_body_with_n_of_one_is_accepted() -> None:
    """n=1 asks for one response, which is what the clients read."""
    assert VLLMBaseRuntimeOptions(extra_body={"n": 1}).extra_body == {"n": 1}


def test_provider_options_payload_uses_openai_names() -> None:
    """The provider-neutral options speak the OpenAI API's own parameter names."""
    opts = ProviderRuntimeOptions(max_completion_tokens=3, output_schema={"type": "object"})
    assert opts.to_payload() == {
        "max_completion_tokens": 3,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "response", "schema": {"type": "object"}},
        },
    }
