"""Virtual time for the pool's unit tests, and clients that live on it.

:class:`FakeClock` implements the pool's ``Clock``: ``sleep`` and ``wait`` park the
caller on a heap of deadlines, and a driver task jumps the time to the earliest one
whenever the event loop has had a few turns with nothing else to do. Paired with
:class:`ClockedClient` (a member's client, as the pool's ``MemberClient`` protocol
asks, whose requests, health checks and model list take fake time and no network), a
test of health intervals, backoff or the all-down deadline runs minutes of pool time
in milliseconds. Time moves on only after the loop has had a few turns, so a test must
not mix in real waits (threads, sockets): they would see fake time jump past them.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
from collections.abc import Callable
from typing import Any

from llm_annotator import ErrorKind, ProviderError, Response
from llm_annotator.clients.metrics import EngineLoad
from llm_annotator.clients.urls import normalize_base_url
from llm_annotator.errors import ReadTimeoutError, StatusError

_IDLE_TURNS = 20
"""Loop turns the driver waits before it moves time on: enough for every task that
could run at the current time to run (they take a handful each)."""


class FakeClock:
    """Time that passes only when everyone waits for it."""

    def __init__(self) -> None:
        self.time = 0.0
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._driver: asyncio.Task[None] | None = None

    def now(self) -> float:
        return self.time

    async def sleep(self, seconds: float) -> None:
        self._start()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (self.time + max(seconds, 0.0), next(self._order), future))
        await future

    async def wait(self, event: asyncio.Event, timeout: float) -> None:
        if event.is_set():
            return
        sleeper = asyncio.ensure_future(self.sleep(timeout))
        setter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({sleeper, setter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            setter.cancel()

    def _start(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.ensure_future(self._drive())

    async def _drive(self) -> None:
        while True:
            for _ in range(_IDLE_TURNS):
                await asyncio.sleep(0)
            while self._heap and self._heap[0][2].done():  # cancelled sleepers
                heapq.heappop(self._heap)
            if not self._heap:
                return
            deadline = self._heap[0][0]
            self.time = max(self.time, deadline)
            while self._heap and self._heap[0][0] <= deadline:  # all who wake now
                future = heapq.heappop(self._heap)[2]
                if not future.done():
                    future.set_result(None)


Answer = Callable[[str, float], "Response | ProviderError | None"]
"""``answer(prompt, now)``: the Response, an error, or None to keep the request open."""


class ClockedClient:
    """A member's client without a network: it answers after ``latency`` fake seconds.

    It implements the pool's ``MemberClient`` protocol and nothing more (the pool
    accepts it as it accepts a ``VLLMOnlineClient``).

    Args:
        url: Its base URL (nothing listens there).
        clock: The fake clock it waits on.
        healthy: ``healthy(now)``: whether ``/health`` answers at fake time ``now``
            (a failing probe takes its whole timeout, as a hung server's does).
        answer: ``answer(prompt, now)``; by default the prompt echoed back.
        latency: Fake seconds each answer takes.
    """

    def __init__(
        self,
        url: str,
        clock: FakeClock,
        *,
        healthy: Callable[[float], bool] = lambda now: True,
        answer: Answer | None = None,
        latency: float = 0.05,
    ) -> None:
        self.base_url = normalize_base_url(url)
        self.model: str | None = "fake"
        self.provider = "vllm_online"
        self.clock = clock
        self.healthy = healthy
        self.answer = answer or (lambda prompt, now: _text(prompt, url))
        self.latency = latency
        self.sent: list[float] = []
        """The fake time of every request."""

    def encode_params(self, options: Any = None, gen_kwargs: dict[str, Any] | None = None) -> bytes:
        payload = options.to_payload() if options is not None else {}
        return json.dumps({**payload, **(gen_kwargs or {})}).encode()

    def redact(self, error: ProviderError) -> ProviderError:
        return error  # no API key to cut out

    async def ais_healthy(self, timeout: float = 5.0) -> bool:
        return await self.acheck_health(timeout) is None

    async def acheck_health(self, timeout: float = 5.0) -> ProviderError | None:
        if self.healthy(self.clock.now()):
            await self.clock.sleep(0.001)
            return None
        await self.clock.sleep(timeout)
        return ReadTimeoutError("no answer", kind=ErrorKind.READ_TIMEOUT, server=self.base_url)

    async def alist_models(self) -> list[str]:
        return ["fake"]

    async def aengine_load(self, timeout: float = 5.0) -> EngineLoad | None:
        await self.clock.sleep(0.001)
        return None  # no /metrics: the pool gives it the whole window

    async def aengine_progress(self, timeout: float = 5.0) -> float | None:
        await self.clock.sleep(0.001)
        return None  # no /metrics: the stall watch goes by timing alone

    async def asend(self, messages: Any, params: bytes) -> Response | ProviderError:
        self.sent.append(self.clock.now())
        await self.clock.sleep(self.latency)
        result = self.answer(messages[-1]["content"], self.clock.now())
        while result is None:  # a hung request: held until it is cancelled
            await self.clock.sleep(3600.0)
        return result

    async def aclose(self) -> None:
        return None


def _text(prompt: str, url: str) -> Response:
    return Response(text=prompt, finish_reason="stop", server=url, provider="vllm_online")


def overloaded(url: str) -> StatusError:
    return StatusError("HTTP 503: busy", kind=ErrorKind.OVERLOADED, server=url, status_code=503)
