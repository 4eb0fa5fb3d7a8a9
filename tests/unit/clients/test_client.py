"""VLLMOnlineClient over real HTTP to an in-process fake server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import pytest
import structlog
from aiohttp import web

from llm_annotator import (
    ErrorKind,
    ProviderError,
    ReadTimeoutError,
    ServerConnectError,
    StatusError,
    VLLMOnlineClient,
    VLLMOnlineRuntimeOptions,
    server_is_healthy,
)
from tests.unit.conftest import FakeServer, completion, error, sleep_forever
from tests.unit.helpers import conversations


def test_batch_returns_one_response_per_conversation_in_order(fake_server: FakeServer) -> None:
    """Results come back in input order with usage, model and server filled in."""
    with VLLMOnlineClient(model="fake-model", base_url=fake_server.base_url) as client:
        responses = client.batch_generate(messages=conversations(300))
    assert [r.text for r in responses] == [f"sample {i}" for i in range(300)]
    assert all(r.ok and r.num_prompt_tokens == 5 and r.num_output_tokens == 2 for r in responses)
    assert {r.server for r in responses} == {fake_server.base_url}
    assert {r.provider for r in responses} == {"vllm_online"}
    assert len(fake_server.requests) == 300


def test_whole_batch_is_in_flight_at_once(fake_server: FakeServer) -> None:
    """Without max_workers every conversation is sent before any answer arrives."""
    release = asyncio.Event()

    async def hold(request: dict[str, Any]) -> web.StreamResponse:
        if fake_server.in_flight >= 64:
            release.set()
        await asyncio.wait_for(release.wait(), timeout=10)
        return completion("ok")

    fake_server.handler = hold
    with VLLMOnlineClient(model="m", base_url=fake_server.base_url) as client:
        responses = client.batch_generate(messages=conversations(64))
    assert all(r.ok for r in responses)
    assert fake_server.max_in_flight == 64


def test_max_workers_caps_requests_in_flight(fake_server: FakeServer) -> None:
    """max_workers bounds how many requests one batch_generate keeps open."""

    async def slow(request: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(0.01)
        return completion("ok")

    fake_server.handler = slow
    with VLLMOnlineClient(model="m", base_url=fake_server.base_url, max_workers=3) as client:
        responses = client.batch_generate(messages=conversations(30))
    assert len(responses) == 30
    assert all(r.ok for r in responses)
    assert fake_server.max_in_flight == 3


def test_options_and_gen_kwargs_reach_the_request(fake_server: FakeServer) -> None:
    """The body holds model, messages, options and gen_kwargs (which win)."""
    opts = VLLMOnlineRuntimeOptions(
        max_completion_tokens=4, temperature=0.5, top_k=7, extra_body={"min_p": 0.1}
    )
    with VLLMOnlineClient(model="m", base_url=fake_server.base_url) as client:
        client.generate(
            messages=[{"role": "user", "content": "hi"}],
            options=opts,
            gen_kwargs={"temperature": 0.0, "logprobs": True},
        )
    assert fake_server.requests == [
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0.0,
            "top_k": 7,
            "add_generation_prompt": True,
            "min_p": 0.1,
            "logprobs": True,
        }
    ]


def test_default_options_ask_for_the_generation_prompt(fake_server: FakeServer) -> None:
    """With no options the request still asks vLLM to append the generation prompt."""
    with VLLMOnlineClient(model="m", base_url=fake_server.base_url) as client:
        client.generate(messages=[{"role": "user", "content": "hi"}])
    assert fake_server.requests[0]["add_generation_prompt"] is True


def test_gen_kwargs_asking_for_several_responses_is_refused(fake_server: FakeServer) -> None:
    """n=2 in gen_kwargs raises ValueError before anything is sent."""
    with (
        VLLMOnlineClient(model="m", base_url=fake_server.base_url) as client,
        pytest.raises(ValueError, match="n=2"),
    ):
        client.batch_generate(messages=conversations(2), gen_kwargs={"n": 2})
    assert fake_server.requests == []


def test_model_is_discovered_when_not_given(fake_server: FakeServer) -> None:
    """model=None asks /v1/models once and uses the first model listed."""
    fake_server.models = ["served-name", "other"]
    with VLLMOnlineClient(base_url=fake_server.base_url) as client:
        responses = client.batch_generate(messages=conversations(5))
        assert client.model == "served-name"
    assert all(r.ok for r in responses)
    assert {req["model"] for req in fake_server.requests} == {"served-name"}


def test_bad_samples_fail_alone(fake_server: FakeServer) -> None:
    """A 400 for some conversations leaves the rest of the batch successful."""

    async def reject_odd(request: dict[str, Any]) -> web.StreamResponse:
        index = int(request["messages"][0]["content"].split()[1])
        if index % 2:
            return error(400, "This model's maximum context length is 512 tokens.")
        return completion("ok")

    fake_server.handler = reject_odd
    with VLLMOnlineClient(model="m", base_url=fake_server.base_url, on_error="ignore") as client:
        responses = client.batch_generate(messages=conversations(10))
    assert [r.ok for r in responses] == [i % 2 == 0 for i in range(10)]
    failed = responses[1]
    assert failed.error_type == "bad_request"
    assert failed.error is not None
    assert fake_server.base_url in failed.error
    assert "maximum context length" in failed.error
    assert len(fake_server.requests) == 10  # a 400 is never retried


def test_non_json_answer_is_a_malformed_error_naming_the_server(fake_server: FakeServer) -> None:
    """A 200 with an HTML body becomes an error Response that says where and what."""

    async def html(request: dict[str, Any]) -> web.StreamResponse:
        return web.Response(text="<html>proxy page</html>", content_type="text/html")

    fake_server.handler = html
    with VLLMOnlineClient(model="m", base_url=fake_server.base_url) as client:
        response = client.generate(messages=[{"role": "user", "content": "x"}])
    assert response.error_type == "malformed_response"
    assert response.error is not None
    assert fake_server.base_url in response.error
    assert "proxy page" in response.error


def test_error_body_raises_with_on_error_raise(fake_server: FakeServer) -> None:
    """With on_error='raise', an OpenAI error body becomes a StatusError."""

    async def not_found(request: dict[str, Any]) -> web.StreamResponse:
        return error(404, "The model `m` does not exist.", "NotFoundError")

    fake_server.handler = not_found
    with (
        VLLMOnlineClient(model="m", base_url=fake_server.base_url, on_error="raise") as client,
        pytest.raises(StatusError, match="does not exist") as info,
    ):
        client.batch_generate(messages=conversations(3))
    assert info.value.kind is ErrorKind.NOT_FOUND
    assert info.value.status_code == 404
    assert info.value.server == fake_server.base_url


def test_transient_failures_are_retried_with_backoff(fake_server: FakeServer) -> None:
    """503 twice then 200: the sample succeeds on the third try, after two backoffs."""
    answers = [error(503, "busy", "ServiceUnavailableError"), error(503, "busy", "x")]

    async def flaky(request: dict[str, Any]) -> web.StreamResponse:
        return answers.pop(0) if answers else completion("finally")

    fake_server.handler = flaky
    waits: list[float] = []

    async def no_sleep(seconds: float) -> None:
        waits.append(seconds)

    with VLLMOnlineClient(model="m", base_url=fake_server.base_url, max_retries=2) as client:
        client._sleep = no_sleep
        response = client.generate(messages=[{"role": "user", "content": "x"}])
    assert response.text == "finally"
    assert len(fake_server.requests) == 3
    assert len(waits) == 2
    assert 0.375 <= waits[0] <= 0.5
    assert 0.75 <= waits[1] <= 1.0


def test_retries_give_up_after_max_retries(fake_server: FakeServer) -> None:
    """A server that keeps failing costs max_retries + 1 tries, then an error."""

    async def broken(request: dict[str, Any]) -> web.StreamResponse:
        return error(500, "oops", "InternalServerError")

    fake_server.handler = broken

    async def no_sleep(seconds: float) -> None:
        return None

    with VLLMOnlineClient(
        model="m", base_url=fake_server.base_url, max_retries=3, on_error="raise"
    ) as client:
        client._sleep = no_sleep
        with pytest.raises(StatusError, match="after 4 attempts") as info:
            client.generate(messages=[{"role": "user", "content": "x"}])
    assert info.value.kind is ErrorKind.SERVER_ERROR
    assert len(fake_server.requests) == 4


def test_refused_connection_is_a_connect_error(refused_url: str) -> None:
    """Nothing listening: each sample is a 'connect' error Response naming the server."""
    with VLLMOnlineClient(
        model="m", base_url=refused_url, max_retries=0, on_error="ignore"
    ) as client:
        responses = client.batch_generate(messages=conversations(4))
    assert [r.error_type for r in responses] == ["connect"] * 4
    assert all(refused_url in (r.error or "") for r in responses)


def test_refused_connection_raises_with_on_error_raise(refused_url: str) -> None:
    """on_error='raise' turns the refused connection into ServerConnectError."""
    with (
        VLLMOnlineClient(model="m", base_url=refused_url, max_retries=0, on_error="raise") as c,
        pytest.raises(ServerConnectError, match="cannot connect"),
    ):
        c.generate(messages=[{"role": "user", "content": "x"}])


def test_listener_that_never_accepts_fails_within_the_connect_timeout(
    blackhole_url: str,
) -> None:
    """A connect that never completes fails after connect_timeout, not the read timeout."""
    client = VLLMOnlineClient(
        model="m", base_url=blackhole_url, max_retries=0, on_error="ignore", connect_timeout=0.5
    )
    started = time.monotonic()
    with client:
        response = client.generate(messages=[{"role": "user", "content": "x"}])
    elapsed = time.monotonic() - started
    assert response.error_type == "connect_timeout"
    assert "connect timeout" in (response.error or "")
    assert elapsed < 5.0  # the read timeout is an hour


def test_slow_answer_is_a_read_timeout(fake_server: FakeServer) -> None:
    """An answer slower than timeout= is a read_timeout error."""
    fake_server.handler = sleep_forever
    with (
        VLLMOnlineClient(
            model="m", base_url=fake_server.base_url, timeout=0.3, max_retries=0, on_error="raise"
        ) as client,
        pytest.raises(ReadTimeoutError),
    ):
        client.generate(messages=[{"role": "user", "content": "x"}])


def test_unencodable_conversation_is_an_error_for_that_sample_only(
    fake_server: FakeServer,
) -> None:
    """A conversation that is not JSON fails alone with a message on the expected shape."""
    batch: list[Any] = [[{"role": "user", "content": "fine"}], [{"role": "user", "content": {1}}]]
    with VLLMOnlineClient(model="m", base_url=fake_server.base_url, on_error="ignore") as client:
        responses = client.batch_generate(messages=batch)
    assert responses[0].ok
    assert responses[1].error_type == "bad_request"
    assert "role" in (responses[1].error or "")


def test_warn_logs_one_summary_per_batch(fake_server: FakeServer) -> None:
    """on_error='warn' logs the failures of a batch once, with counts by kind."""

    async def reject(request: dict[str, Any]) -> web.StreamResponse:
        return error(400, "bad")

    fake_server.handler = reject
    with (
        structlog.testing.capture_logs() as logs,
        VLLMOnlineClient(model="m", base_url=fake_server.base_url) as client,
    ):
        responses = client.batch_generate(messages=conversations(5))
    assert not any(r.ok for r in responses)
    warnings = [entry for entry in logs if entry["event"] == "requests_failed"]
    assert len(warnings) == 1
    assert warnings[0]["failed"] == 5
    assert warnings[0]["kinds"] == {"bad_request": 5}


async def test_async_twins_run_on_the_callers_loop(fake_server: FakeServer) -> None:
    """abatch_generate and agenerate work inside the caller's event loop."""
    async with VLLMOnlineClient(model="m", base_url=fake_server.base_url) as client:
        batch = await client.abatch_generate(messages=conversations(20))
        one = await client.agenerate(messages=[{"role": "user", "content": "solo"}])
        assert await client.ais_healthy()
    assert [r.text for r in batch] == [f"sample {i}" for i in range(20)]
    assert one.text == "solo"


async def test_sync_api_works_inside_a_running_loop(fake_server: FakeServer) -> None:
    """The sync facade works where a loop already runs, as in a notebook."""
    client = VLLMOnlineClient(model="m", base_url=fake_server.base_url)
    try:
        assert client.generate(messages=[{"role": "user", "content": "nb"}]).text == "nb"
    finally:
        client.close()


def test_close_is_idempotent_and_client_reopens(fake_server: FakeServer) -> None:
    """close() twice is fine; a closed client opens new connections if used again."""
    client = VLLMOnlineClient(model="m", base_url=fake_server.base_url)
    client.generate(messages=[{"role": "user", "content": "a"}])
    client.close()
    client.close()
    assert client.generate(messages=[{"role": "user", "content": "b"}]).text == "b"
    client.close()


def test_health_checks(fake_server: FakeServer, refused_url: str) -> None:
    """Health is /health == 200, with or without /v1 in the URL, and False when down."""
    root = fake_server.base_url.removesuffix("/v1")
    assert server_is_healthy(fake_server.base_url, timeout=2)
    assert server_is_healthy(root, timeout=2)
    assert server_is_healthy(root + "/", timeout=2)
    assert not server_is_healthy(refused_url, timeout=2)
    fake_server.health_status = 503
    assert not server_is_healthy(fake_server.base_url, timeout=2)
    with VLLMOnlineClient(model="m", base_url=fake_server.base_url) as client:
        assert not client.is_healthy()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"on_error": "explode"}, "on_error"),
        ({"timeout": 0}, "timeout"),
        ({"max_retries": -1}, "max_retries"),
        ({"max_workers": 0}, "max_workers"),
        ({"model": ""}, "model"),
        ({"base_url": "localhost:8000"}, "base_url"),
        ({"base_url": "ftp://host/v1"}, "base_url"),
    ],
)
def test_bad_client_settings_raise_value_error(kwargs: dict[str, Any], field: str) -> None:
    """A client setting that cannot work is refused at construction, naming it."""
    with pytest.raises(ValueError, match=field):
        VLLMOnlineClient(**kwargs)


def test_provider_error_survives_pickling() -> None:
    """ProviderError keeps its fields across pickling (process pools, multiprocessing)."""
    import pickle

    error = StatusError("HTTP 400: bad", kind=ErrorKind.BAD_REQUEST, server="s", status_code=400)
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, ProviderError)
    assert (copy.kind, copy.server, copy.status_code, str(copy)) == (
        ErrorKind.BAD_REQUEST,
        "s",
        400,
        "s: HTTP 400: bad",
    )


@pytest.mark.parametrize(
    ("failures", "max_retries", "found"),
    [
        ([503, 503], 2, True),  # a server still starting: asked again, found
        ([503, 503, 503], 2, False),  # past max_retries: the last error is raised
        ([401], 5, False),  # a refused key is not asked again
    ],
)
def test_model_discovery_retries_what_may_heal(
    fake_server: FakeServer, failures: list[int], max_retries: int, found: bool
) -> None:
    """``/v1/models`` is asked again after a transient failure, as a request would be
    (``max_retries`` times, with backoff), and not after one that waiting cannot fix."""
    fake_server.models_failures = list(failures)

    async def resolve() -> str:
        async with VLLMOnlineClient(
            base_url=fake_server.base_url, max_retries=max_retries
        ) as client:
            client._sleep = _no_wait
            return await client.aresolve_model()

    if found:
        assert asyncio.run(resolve()) == "fake-model"
        assert fake_server.models_asked == len(failures) + 1
    else:
        with pytest.raises(ProviderError) as raised:
            asyncio.run(resolve())
        assert raised.value.status_code == failures[-1]
        assert fake_server.models_asked == min(len(failures), max_retries + 1)


async def _no_wait(seconds: float) -> None:
    return None


def test_connections_a_client_left_open_are_closed_at_exit(fake_server: FakeServer) -> None:
    """A script that makes a sync call and never closes its client exits cleanly: the
    transport's closer, registered with ``_sync.on_shutdown``, closes its session on the
    background loop (else aiohttp warns of an unclosed session at teardown)."""
    code = "\n".join(
        [
            "from llm_annotator import VLLMOnlineClient",
            f"client = VLLMOnlineClient(model='m', base_url={fake_server.base_url!r})",
            "print(client.generate(messages=[{'role': 'user', 'content': 'hi'}]).text)",
            "from llm_annotator.clients._transport import live_transports",
            "assert live_transports(), 'the session should still be open here'",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == "hi"
    assert "Unclosed" not in done.stderr, done.stderr
