"""Branches of the pool that no other test reaches: the overload cap, admission that
fails, timeouts on a member that answers nothing, and membership changes from another
thread that fail.

The first run on the fake clock (minutes of pool time in milliseconds); the last runs
against fake HTTP servers, because threads and a fake clock do not mix.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import structlog

from llm_annotator import (
    ConfigurationError,
    DuplicateServerError,
    ErrorKind,
    ProviderError,
    Response,
    VLLMQueueAnnotator,
)
from llm_annotator.errors import ReadTimeoutError, StatusError
from tests.unit.conftest import FakeServer
from tests.unit.fake_clock import ClockedClient, FakeClock, overloaded
from tests.unit.helpers import FAST, assert_all_answered_in_order, conversations, delayed_echo

FakeServers = Callable[[int], list[FakeServer]]


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"sample {i}"}] for i in range(n)]


def run(coro: Any) -> Any:
    started = time.process_time()
    result = asyncio.run(coro)
    assert time.process_time() - started < 20, "fake time should cost next to no real time"
    return result


class ModelsClient(ClockedClient):
    """A clocked client whose ``/v1/models`` answers ``models(now)`` (a list or an error)."""

    def __init__(
        self, url: str, clock: FakeClock, models: Callable[[float], list[str] | ProviderError]
    ) -> None:
        super().__init__(url, clock)
        self.models = models

    async def alist_models(self) -> list[str]:
        await self.clock.sleep(0.01)
        answer = self.models(self.clock.now())
        if isinstance(answer, ProviderError):
            raise answer
        return answer


def test_a_sample_every_member_calls_overloaded_ends_after_50_requeues() -> None:
    """A member that answers every request 503 is backed off, not evicted; each sample
    is sent 51 times (its 51st overload ends it) and becomes an ``overloaded`` error
    row naming the server, so a pool that is only ever busy still ends."""
    clock = FakeClock()
    busy = ClockedClient(
        "http://busy:1/v1", clock, answer=lambda prompt, now: overloaded("http://busy:1/v1")
    )

    async def scenario() -> tuple[list[Response], Any]:
        async with VLLMQueueAnnotator(clients=[busy], batch_size=1, clock=clock) as pool:
            responses = await pool.abatch_generate(messages=prompts(3))
            return responses, pool.statistics()

    responses, stats = run(scenario())
    assert [r.error_type for r in responses] == ["overloaded"] * 3
    assert all(r.server == busy.base_url for r in responses)
    assert len(busy.sent) == 3 * 51
    assert stats.evictions == 0 and stats.members[0].state == "healthy"


@pytest.mark.parametrize(
    ("models", "state", "said"),
    [
        # A refused key on /v1/models: settings to fix, disabled at once.
        (
            lambda now: StatusError("HTTP 401: bad key", kind=ErrorKind.AUTH, status_code=401),
            "disabled",
            "GET /v1/models: HTTP 401: bad key",
        ),
        # Serving another model: disabled, naming both.
        (lambda now: ["other-model"], "disabled", "does not serve model 'fake'"),
        # Listing none: disabled.
        (lambda now: [], "disabled", None),
        # A 500 on /v1/models for the first 20 s: not disabled; it joins once it answers.
        (
            lambda now: (
                StatusError("HTTP 500: boom", kind=ErrorKind.SERVER_ERROR, status_code=500)
                if now < 20
                else ["fake"]
            ),
            "healthy",
            None,
        ),
    ],
)
def test_admission_checks_the_model_and_disables_only_for_settings(
    models: Callable[[float], list[str] | ProviderError], state: str, said: str | None
) -> None:
    """A member that answers /health is admitted only once /v1/models lists the pool's
    model; the other member does all the work meanwhile and no sample is lost."""
    clock = FakeClock()
    good = ClockedClient("http://good:1/v1", clock, latency=1.0)
    odd = ModelsClient("http://odd:1/v1", clock, models)
    if models(0.0) == []:
        odd.model = None  # it must name a model itself

    async def scenario() -> tuple[list[Response], Any]:
        async with VLLMQueueAnnotator(
            clients=[good, odd], batch_size=4, max_concurrent_batches_per_client=1, clock=clock
        ) as pool:
            responses = await pool.abatch_generate(messages=prompts(200))
            return responses, pool.statistics()

    responses, stats = run(scenario())
    assert [r.text for r in responses] == [f"sample {i}" for i in range(200)]
    member = stats.member(odd.base_url)
    assert member.state == state
    if said is not None:
        assert member.last_error is not None and said in member.last_error
    if state == "healthy":
        assert member.completed > 0 and member.readmissions == 0
        assert min(odd.sent) >= 20  # no work before it listed the model
    else:
        assert member.completed == 0 and not odd.sent


def test_timeouts_on_a_member_that_answers_nothing_evict_it_and_lose_nothing() -> None:
    """Every request to a member times out (it answers nothing, its /health is fine):
    each timeout is the member's fault, the third evicts it, and every sample it held
    is answered elsewhere with no error row."""
    clock = FakeClock()
    good = ClockedClient("http://good:1/v1", clock, latency=0.5)

    def never(prompt: str, now: float) -> ProviderError:
        return ReadTimeoutError("no answer in 5 s", kind=ErrorKind.READ_TIMEOUT, server="s")

    silent = ClockedClient("http://silent:1/v1", clock, answer=never, latency=5.0)
    with structlog.testing.capture_logs() as logs:

        async def scenario() -> tuple[list[Response], Any]:
            async with VLLMQueueAnnotator(
                clients=[good, silent], batch_size=4, health_check_interval=3600, clock=clock
            ) as pool:
                responses = await pool.abatch_generate(messages=prompts(400))
                return responses, pool.statistics()

        responses, stats = run(scenario())
    assert [r.text for r in responses] == [f"sample {i}" for i in range(400)]
    assert stats.member(silent.base_url).evictions >= 1
    reasons = [e["reason"] for e in logs if e["event"] == "member_evicted"]
    assert reasons and "answers in a row were the server's fault" in reasons[0]
    assert "read_timeout" not in Counter(r.error_type for r in responses)


def test_membership_changes_from_another_thread_raise_there(fake_servers: FakeServers) -> None:
    """During a call, ``add_server`` from another thread raises in that thread: a server
    already in the pool is a DuplicateServerError, a URL that is not http(s) a
    ConfigurationError, an unknown one to remove a KeyError; a good new server joins
    and the call loses nothing."""
    first, late = fake_servers(2)
    first.handler = late.handler = delayed_echo(0.02)
    raised: dict[str, BaseException | None] = {}

    with VLLMQueueAnnotator(
        [first.base_url], batch_size=5, max_concurrent_batches_per_client=1, **FAST
    ) as pool:

        def changes() -> None:
            deadline = time.monotonic() + 10
            while not first.requests and time.monotonic() < deadline:
                time.sleep(0.01)  # bounded: until the call runs
            changes: tuple[tuple[str, Callable[[], None]], ...] = (
                ("duplicate", lambda: pool.add_server(first.base_url)),
                ("scheme", lambda: pool.add_server("ftp://127.0.0.1:1/v1")),
                ("unknown", lambda: pool.remove_server("http://127.0.0.1:9/v1")),
                ("late", lambda: pool.add_server(late.base_url)),
            )
            for name, change in changes:
                try:
                    change()
                    raised[name] = None
                except BaseException as exc:  # checked below, in the test's thread
                    raised[name] = exc

        thread = threading.Thread(target=changes, daemon=True)
        thread.start()
        responses = pool.batch_generate(messages=conversations(300))
        thread.join(10)
        urls = pool.base_urls
    assert_all_answered_in_order(responses, 300)
    assert isinstance(raised["duplicate"], DuplicateServerError)
    assert isinstance(raised["scheme"], ConfigurationError)
    assert not isinstance(raised["scheme"], DuplicateServerError)
    assert isinstance(raised["unknown"], KeyError)
    assert raised["late"] is None and urls == [first.base_url, late.base_url]
