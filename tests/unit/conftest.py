"""An in-process OpenAI-compatible server on loopback: the fake transport of the unit tests.

It speaks real HTTP, so the client's whole path (connection pool, timeouts, decoding,
exception mapping) runs; only the model is fake. Each test scripts the answers with a
``handler`` that gets the decoded request body.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from tests.misbehaving import completion_body
from tests.threaded_loop import threaded_loop

Handler = Callable[[dict[str, Any]], Awaitable[web.StreamResponse]]


def completion(content: str, *, prompt_tokens: int = 5, completion_tokens: int = 2) -> web.Response:
    """A chat-completion answer with the given content."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    return web.Response(body=completion_body(content, usage=usage), content_type="application/json")


def within_limit(response: web.StreamResponse, request: dict[str, Any]) -> web.StreamResponse:
    """The answer with no more completion tokens than the request allows, as from
    vLLM (the client refuses more as a lying server): a test completion asks for 1."""
    limit = request.get("max_completion_tokens") or request.get("max_tokens")
    if not isinstance(response, web.Response) or not isinstance(limit, int):
        return response
    if response.status != 200 or not isinstance(response.body, bytes):
        return response
    try:
        answer = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        return response  # garbage, as a test asked
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return response
    tokens = usage.get("completion_tokens")
    if not isinstance(tokens, int) or tokens <= limit:
        return response
    usage["completion_tokens"] = limit
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


def error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    """A vLLM-style error answer."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def echo(request: dict[str, Any]) -> web.StreamResponse:
    """Answer with the last message's content, so order can be checked."""
    return completion(request["messages"][-1]["content"])


@dataclass
class FakeServer:
    """A running fake server and what it has seen."""

    base_url: str
    handler: Handler = echo
    raw_handler: Callable[[dict[str, Any], web.Request], Awaitable[web.StreamResponse]] | None = (
        None
    )
    requests: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    health_status: int = 200
    health_delay: float = 0.0
    models: list[str] = field(default_factory=lambda: ["fake-model"])
    models_failures: list[int] = field(default_factory=list)
    """Statuses that ``/v1/models`` answers first, one a request, before the list."""
    models_asked: int = 0


@contextlib.contextmanager
def running_fake_server(host: str = "127.0.0.1", port: int = 0) -> Iterator[FakeServer]:
    """Start a fake server on a loopback address (a free port unless ``port`` is given),
    in its own thread and event loop.

    Its own loop lets both the async API (on the test's loop) and the sync API (on the
    package's background loop) talk to it without blocking it.
    """
    server = FakeServer(base_url="")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        server.requests.append(body)
        server.in_flight += 1
        server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            if server.raw_handler is not None:
                return within_limit(await server.raw_handler(body, request), body)
            return within_limit(await server.handler(body), body)
        finally:
            server.in_flight -= 1

    async def models(_: web.Request) -> web.Response:
        server.models_asked += 1
        if server.models_failures:
            return error(server.models_failures.pop(0), "not now", "ServiceUnavailableError")
        data = {"object": "list", "data": [{"id": m, "object": "model"} for m in server.models]}
        return web.Response(body=orjson.dumps(data), content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        if server.health_delay:
            await asyncio.sleep(server.health_delay)
        return web.Response(status=server.health_status)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)

    async def start() -> str:
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        return f"http://{host}:{runner.addresses[0][1]}/v1"

    with threaded_loop("fake-server", runner.cleanup) as loop:
        server.base_url = loop.call(start())
        yield server


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    """One fake server for one test."""
    with running_fake_server() as server:
        yield server


@pytest.fixture
def fake_servers() -> Iterator[Callable[[int], list[FakeServer]]]:
    """A factory of fake servers, all stopped at the end of the test."""
    with contextlib.ExitStack() as stack:

        def start(count: int) -> list[FakeServer]:
            return [stack.enter_context(running_fake_server()) for _ in range(count)]

        yield start


@pytest.fixture
def refused_url() -> str:
    """A loopback URL where nothing listens: connections are refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


async def sleep_forever(_: dict[str, Any]) -> web.StreamResponse:
    """A handler that never answers (until the test ends)."""
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")
