"""Servers that misbehave on purpose, written at the socket level.

Each :class:`RawServer` listens on a loopback port in a thread of its own and answers
``GET /health`` with 200 and ``GET /v1/models`` with one model, like a live vLLM server,
while ``POST /v1/chat/completions`` gets whatever the test's ``answer`` coroutine writes
on the raw socket: a body that trickles, never ends, is huge, is cut off, is not JSON,
is a redirect. Nothing here trusts aiohttp's server to write what a broken server
writes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import orjson

from tests.threaded_loop import threaded_loop

Answer = Callable[[asyncio.StreamWriter, "Request"], Awaitable[None]]


@dataclass
class Request:
    """One request as the server read it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class RawServer:
    """A running misbehaving server and what it has seen."""

    base_url: str = ""
    port: int = 0
    answer: Answer | None = None
    requests: list[Request] = field(default_factory=list)
    model: str = "fake-model"
    routes: dict[str, Answer] = field(default_factory=dict)
    """Answers for exact paths, before the defaults (``{"/v1/models": whole(...)}``)."""
    api_key: str | None = None
    """When set, /v1 routes answer 401 unless ``Authorization: Bearer <api_key>``, as
    vLLM started with ``--api-key`` does (``/health`` stays open)."""

    @property
    def chat_requests(self) -> list[Request]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]


def completion_body(content: object = "ok", **fields: object) -> bytes:
    """A chat completion, with any top-level field replaced."""
    body: dict[str, object] = {
        "id": "cmpl-1",
        "object": "chat.completion",
        "model": "fake-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    body.update(fields)
    return orjson.dumps(body)


def head(status: int = 200, *, length: int | None = None, **headers: str) -> bytes:
    """A response head; ``length=None`` with no Transfer-Encoding means read to close."""
    lines = [f"HTTP/1.1 {status} X", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def whole(body: bytes, status: int = 200, **headers: str) -> Answer:
    """An answer that sends ``body`` at once with its Content-Length."""

    async def answer(writer: asyncio.StreamWriter, request: Request) -> None:
        writer.write(head(status, length=len(body), **headers) + body)
        await writer.drain()

    return answer


async def _serve(
    server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        while True:
            try:
                raw = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            lines = raw.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    name, value = line.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            request = Request(method, path, headers, body)
            server.requests.append(request)
            wanted = f"Bearer {server.api_key}"
            if path.startswith("/v1") and server.api_key and headers.get("authorization") != wanted:
                data = orjson.dumps({"error": "Unauthorized"})
                writer.write(head(401, length=len(data)) + data)
            elif path in server.routes:
                await server.routes[path](writer, request)
            elif path == "/health":
                writer.write(head(200, length=0))
            elif path.endswith("/models"):
                data = orjson.dumps({"object": "list", "data": [{"id": server.model}]})
                writer.write(head(200, length=len(data)) + data)
            elif server.answer is not None:
                await server.answer(writer, request)
                if writer.is_closing():
                    return
            else:
                writer.write(head(404, length=0))
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


@contextlib.contextmanager
def raw_server(answer: Answer | None = None) -> Iterator[RawServer]:
    """Start a :class:`RawServer` on a free loopback port; stop it at the end."""
    server = RawServer(answer=answer)
    listeners: list[asyncio.Server] = []

    async def close() -> None:
        for listener in listeners:
            listener.close()

    with threaded_loop("raw-server", close) as loop:

        async def start() -> asyncio.Server:
            return await asyncio.start_server(
                lambda r, w: _serve(server, r, w), "127.0.0.1", 0, limit=2**20
            )

        listeners.append(loop.call(start()))
        server.port = listeners[0].sockets[0].getsockname()[1]
        server.base_url = f"http://127.0.0.1:{server.port}/v1"
        yield server
