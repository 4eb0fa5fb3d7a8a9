"""VLLMOnlineClient against real vLLM servers (CPU build, tiny model, random weights).

The servers are shared by the whole session (the ``vllm_servers`` fixture); tests that
kill a server start their own.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from llm_annotator import VLLMOnlineClient, VLLMOnlineRuntimeOptions, server_is_healthy
from llm_annotator.local import LocalServers

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(vllm_servers: LocalServers) -> Iterator[VLLMOnlineClient]:
    """A client of the first shared server, model discovered from the server."""
    with VLLMOnlineClient(base_url=vllm_servers.base_urls[0], on_error="ignore") as c:
        yield c


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


GREEDY = VLLMOnlineRuntimeOptions(max_completion_tokens=12, temperature=0.0)


def test_model_is_discovered_from_the_server(
    client: VLLMOnlineClient, vllm_servers: LocalServers
) -> None:
    """With model=None the client asks the server and uses the served name."""
    response = client.generate(messages=user("hello"), options=GREEDY)
    assert response.ok, response.error
    assert client.model == vllm_servers.model
    assert response.model == vllm_servers.model


def test_generate_fills_text_and_usage(client: VLLMOnlineClient) -> None:
    """One request: text, finish_reason and token counts come from the server."""
    response = client.generate(messages=user("classify this sentence"), options=GREEDY)
    assert response.ok, response.error
    assert isinstance(response.text, str)
    assert response.finish_reason in ("stop", "length")
    assert response.num_prompt_tokens is not None and response.num_prompt_tokens > 3
    assert response.num_output_tokens is not None and 1 <= response.num_output_tokens <= 12


def test_batch_of_250_returns_one_response_per_input_in_order(client: VLLMOnlineClient) -> None:
    """Conversation i has (i mod 50) + 1 words. Each response's prompt token count must be
    the one its own length gives (measured one by one first), which only holds if the
    results stay in input order."""
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=2, temperature=0.0)

    def words(i: int) -> list[dict[str, str]]:
        return user(" ".join(["word"] * (i % 50 + 1)))

    reference = [client.generate(messages=words(i), options=options) for i in range(50)]
    expected = [r.num_prompt_tokens for r in reference]
    assert all(b > a for a, b in itertools.pairwise(expected)), expected  # type: ignore[operator]
    responses = client.batch_generate(messages=[words(i) for i in range(250)], options=options)
    assert len(responses) == 250
    assert all(r.ok for r in responses), next(r.error for r in responses if not r.ok)
    assert [r.num_prompt_tokens for r in responses] == [expected[i % 50] for i in range(250)]
    assert all(r.num_output_tokens is not None and r.num_output_tokens <= 2 for r in responses)


def test_seed_makes_sampling_reproducible(client: VLLMOnlineClient) -> None:
    """Same seed at temperature 1 gives the same text; another seed gives another."""

    def sample(seed: int) -> str | None:
        options = VLLMOnlineRuntimeOptions(max_completion_tokens=24, temperature=1.0, seed=seed)
        response = client.generate(messages=user("tell me a story"), options=options)
        assert response.ok, response.error
        return response.text

    first, again, other = sample(11), sample(11), sample(12)
    assert first == again
    assert first != other


def test_max_completion_tokens_caps_the_output(client: VLLMOnlineClient) -> None:
    """The engine stops at max_completion_tokens and says why."""
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=3, temperature=1.0, seed=1)
    responses = client.batch_generate(messages=[user(f"go {i}") for i in range(8)], options=options)
    assert all(r.ok for r in responses)
    assert all(r.num_output_tokens is not None and r.num_output_tokens <= 3 for r in responses)
    assert any(r.finish_reason == "length" for r in responses)


def test_stop_string_ends_the_output(client: VLLMOnlineClient) -> None:
    """A stop string taken from a seeded output cuts that same output just before it."""
    prompt = user("repeat after me")

    def sample(seed: int, stop: list[str] | None = None) -> Any:
        options = VLLMOnlineRuntimeOptions(
            max_completion_tokens=40, temperature=1.0, seed=seed, stop=stop
        )
        response = client.generate(messages=prompt, options=options)
        assert response.ok, response.error
        return response

    def stop_index(text: str) -> int | None:
        # Two ASCII letters or digits at their first occurrence, not at the very start.
        for i in range(1, len(text) - 1):
            pair = text[i : i + 2]
            if pair.isascii() and pair.isalnum() and text.find(pair) == i:
                return i
        return None

    for seed in range(1, 30):  # bounded search for a seed whose output has a stop string
        full = sample(seed)
        index = stop_index(full.text or "")
        if index is not None:
            break
    assert index is not None, "no seed gave an output with a usable stop string"
    text = full.text or ""
    cut = sample(seed, stop=[text[index : index + 2]])
    assert cut.finish_reason == "stop"
    assert cut.text == text[:index]


@pytest.mark.parametrize(
    "options",
    [
        VLLMOnlineRuntimeOptions(max_completion_tokens=4, top_k=5),
        VLLMOnlineRuntimeOptions(max_completion_tokens=4, top_k=-1, top_p=0.9),
        VLLMOnlineRuntimeOptions(max_completion_tokens=4, repetition_penalty=1.3),
        VLLMOnlineRuntimeOptions(max_completion_tokens=4, presence_penalty=0.5),
        VLLMOnlineRuntimeOptions(max_completion_tokens=4, frequency_penalty=0.5),
        VLLMOnlineRuntimeOptions(max_completion_tokens=4, extra_body={"min_p": 0.05}),
        VLLMOnlineRuntimeOptions(max_completion_tokens=4, extra_body={"stop_token_ids": [0]}),
        VLLMOnlineRuntimeOptions(
            max_completion_tokens=4, chat_template_kwargs={"enable_thinking": True}
        ),
    ],
    ids=[
        "top_k",
        "top_k_all_top_p",
        "rep_penalty",
        "presence",
        "frequency",
        "min_p",
        "stop_ids",
        "template_kwargs",
    ],
)
def test_engine_accepts_the_option(
    client: VLLMOnlineClient, options: VLLMOnlineRuntimeOptions
) -> None:
    """Each option reaches vLLM in a form it accepts (a rejected one would be a 400)."""
    response = client.generate(messages=user("hello"), options=options)
    assert response.ok, response.error


def test_chat_template_kwargs_reach_the_template(client: VLLMOnlineClient) -> None:
    """The tiny model's template adds a line when enable_thinking is set, so the prompt
    grows: proof the kwargs were rendered, not just accepted."""

    def prompt_tokens(thinking: bool) -> int | None:
        options = VLLMOnlineRuntimeOptions(
            max_completion_tokens=1, chat_template_kwargs={"enable_thinking": thinking}
        )
        response = client.generate(messages=user("hello"), options=options)
        assert response.ok, response.error
        return response.num_prompt_tokens

    off, on = prompt_tokens(False), prompt_tokens(True)
    assert off is not None and on is not None
    assert on > off


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["positive", "negative"]}},
    "required": ["label"],
    "additionalProperties": False,
}


def test_output_schema_constrains_the_output(client: VLLMOnlineClient) -> None:
    """Every answer that finished is JSON following the schema; a truncated one is cut
    at max tokens (finish_reason 'length'), the case a caller must handle."""
    options = VLLMOnlineRuntimeOptions(
        max_completion_tokens=32,
        temperature=1.0,
        output_schema=SCHEMA,
    )
    responses = client.batch_generate(
        messages=[user(f"review {i}: great film") for i in range(12)], options=options
    )
    assert all(r.ok for r in responses), next(r.error for r in responses if not r.ok)
    finished = [r for r in responses if r.finish_reason == "stop"]
    assert finished, [r.text for r in responses]
    for response in finished:
        assert response.text is not None
        parsed = json.loads(response.text)
        assert set(parsed) == {"label"}
        assert parsed["label"] in ("positive", "negative")
    for response in responses:
        if response.finish_reason == "length":
            assert response.num_output_tokens == 32


def test_unconstrained_output_is_not_json(client: VLLMOnlineClient) -> None:
    """Control for the schema test: random weights without a schema give no such JSON."""
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=32, temperature=1.0, seed=3)
    responses = client.batch_generate(
        messages=[user(f"review {i}: great film") for i in range(12)], options=options
    )

    def follows_schema(text: str | None) -> bool:
        try:
            parsed = json.loads(text or "")
        except ValueError:
            return False
        return isinstance(parsed, dict) and parsed.get("label") in ("positive", "negative")

    assert not any(follows_schema(r.text) for r in responses)


def test_prompt_longer_than_context_fails_alone(client: VLLMOnlineClient) -> None:
    """An over-long prompt is a bad_request error for that sample; the rest succeed."""
    batch = [user("short one"), user("word " * 2000), user("short two"), user("x " * 3000)]
    responses = client.batch_generate(messages=batch, options=GREEDY)
    assert [r.ok for r in responses] == [True, False, True, False]
    for failed in (responses[1], responses[3]):
        assert failed.error_type == "bad_request"
        assert "context length" in (failed.error or "")
        assert client.base_url in (failed.error or "")


def test_wrong_model_name_is_a_clear_error(vllm_servers: LocalServers) -> None:
    """A model the server does not serve gives not_found, naming the model and the fix."""
    with VLLMOnlineClient(
        model="no-such-model", base_url=vllm_servers.base_urls[0], on_error="ignore"
    ) as wrong:
        response = wrong.generate(messages=user("hi"), options=GREEDY)
    assert response.error_type == "not_found"
    assert "no-such-model" in (response.error or "")
    assert "model=None" in (response.error or "")


def test_health_of_live_servers(vllm_servers: LocalServers) -> None:
    """A live server is healthy, through the client and the module function, with or
    without /v1."""
    for url in vllm_servers.base_urls:
        assert server_is_healthy(url, timeout=5)
        assert server_is_healthy(url.removesuffix("/v1"), timeout=5)
        with VLLMOnlineClient(base_url=url) as c:
            assert c.is_healthy()


def test_health_of_a_port_that_never_accepts(blackhole_url: str) -> None:
    """A listener whose backlog is full and that never accepts is unhealthy within the
    timeout."""
    started = time.monotonic()
    assert not server_is_healthy(blackhole_url, timeout=2.0)
    assert time.monotonic() - started < 4.0


@pytest.mark.faults
def test_health_of_a_killed_server(start_vllm: Any) -> None:
    """After SIGKILL the server is unhealthy within the timeout, and requests to it fail
    with a connect error rather than hanging."""
    servers = start_vllm(1)
    url = servers.base_urls[0]
    assert server_is_healthy(url, timeout=5)
    servers[0].kill()
    started = time.monotonic()
    assert not server_is_healthy(url, timeout=3.0)
    assert time.monotonic() - started < 5.0
    with VLLMOnlineClient(model=servers.model, base_url=url, max_retries=0) as c:
        response = c.generate(messages=user("hi"), options=GREEDY)
        assert response.error_type == "connect"
        assert not c.is_healthy(timeout=3.0)
