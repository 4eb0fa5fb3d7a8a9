"""QueuePool: one work queue over many vLLM servers that survives their failures."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Callable,
    Hashable,
    Iterable,
    Mapping,
    Sequence,
)
from typing import Any, TypeVar

import structlog

from llm_annotator import _constants as default
from llm_annotator.clients.base import Client, Messages
from llm_annotator.clients.tls import Verify
from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions
from llm_annotator.errors import ConfigurationError
from llm_annotator.pool.backend import MemberClient
from llm_annotator.pool.calls import Calls
from llm_annotator.pool.clock import SYSTEM_CLOCK, Clock
from llm_annotator.pool.config import FromConfig, PoolConfig
from llm_annotator.pool.discovery import ServerDiscovery
from llm_annotator.pool.dispatch import Dispatcher
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.health import HealthMonitor
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import MemberChange
from llm_annotator.pool.membership import Membership
from llm_annotator.pool.stall import StallWatch
from llm_annotator.pool.state import ClientFactory, PoolState
from llm_annotator.pool.statistics import PoolStatistics
from llm_annotator.response import OnError, Response

log = structlog.get_logger(__name__)


K = TypeVar("K")


class QueuePool(Client[VLLMOnlineRuntimeOptions]):
    """The pool alone: one work queue over many vLLM servers, surviving their failures,
    with no annotation jobs (:class:`~llm_annotator.VLLMQueueAnnotator` is this pool
    with ``annotate``; its docstring describes every argument).

    The pool layer imports nothing of the job layer: the job layer takes a pool as
    any client (:class:`~llm_annotator.jobs.protocols.Streamer`), and the class that
    joins them sits above both.

    Examples:
        >>> pool = QueuePool(["http://127.0.0.1:8001/v1"], model="m")
        >>> pool
        <QueuePool joining=1 in_flight=0 queued=0>
        >>> pool.close()
    """

    provider = "vllm_pool"

    # The settings, read-only (they live in ``self.config``, a frozen PoolConfig):
    # assigning one raises AttributeError saying to build a new pool.
    model = FromConfig()
    batch_size = FromConfig()
    max_concurrent_batches_per_client = FromConfig()
    timeout = FromConfig()
    connect_timeout = FromConfig()
    health_check_interval = FromConfig()
    health_check_timeout = FromConfig()
    max_failed_health_checks = FromConfig()
    max_sample_evictions = FromConfig()
    max_sample_retries = FromConfig()
    all_down_timeout = FromConfig()
    on_error = FromConfig()
    hedge_tail = FromConfig()
    max_response_bytes = FromConfig()
    max_server_faults = FromConfig()
    stall_window = FromConfig()
    adaptive = FromConfig()
    prefix_affinity = FromConfig()

    def __init__(
        self,
        base_urls: Sequence[str] | None = None,
        *,
        clients: Sequence[MemberClient] | None = None,
        model: str | None = None,
        batch_size: int = default.BATCH_SIZE,
        max_concurrent_batches_per_client: int = default.MAX_CONCURRENT_BATCHES,
        timeout: float = default.TIMEOUT,
        connect_timeout: float = default.CONNECT_TIMEOUT,
        health_check_interval: float = default.HEALTH_CHECK_INTERVAL,
        health_check_timeout: float = default.HEALTH_CHECK_TIMEOUT,
        max_failed_health_checks: int = default.MAX_FAILED_HEALTH_CHECKS,
        max_sample_evictions: int = default.MAX_SAMPLE_EVICTIONS,
        max_sample_retries: int = default.MAX_SAMPLE_RETRIES,
        all_down_timeout: float = default.ALL_DOWN_TIMEOUT,
        on_error: OnError = "warn",
        discovery: ServerDiscovery | None = None,
        hedge_tail: bool = True,
        api_key: str | Mapping[str, str] | None = None,
        verify: Verify = True,
        max_response_bytes: int = default.MAX_RESPONSE_BYTES,
        max_server_faults: int = default.MAX_SERVER_FAULTS,
        stall_window: float = default.STALL_WINDOW,
        adaptive: bool = False,
        prefix_affinity: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        given = locals()  # the arguments, before anything else is named here
        if isinstance(base_urls, str):
            raise ConfigurationError("base_urls must be a list of URLs, not one string")
        config = PoolConfig(**{name: given[name] for name in PoolConfig.names()})
        clients_built = ClientFactory.build(config, api_key, verify)
        state = PoolState(config, clock, clients_built, discovery)
        self._state = state
        effects = Effects(state)
        self._health = HealthMonitor(state, effects)
        dispatcher = Dispatcher(state, effects, self._health, StallWatch(state, effects))
        self._membership = Membership(state, dispatcher, effects)
        self._membership.populate(base_urls or (), clients or ())
        self._calls = Calls(state, dispatcher, self._health, self._membership)

    @property
    def config(self) -> PoolConfig:
        """The pool's settings, fixed when it was made (one holder: every part of the
        pool reads this one)."""
        return self._state.config

    # -- membership --------------------------------------------------------------------

    @property
    def base_urls(self) -> list[str]:
        """The members' base URLs, in the order they joined."""
        return self._membership.base_urls

    def add_server(self, base_url: str) -> None:
        """Add a server; during a call it is probed and takes work once healthy.

        Safe to call from another thread while a call runs.

        Raises:
            ValueError: If the server is already in the pool (a ConfigurationError).
            ConfigurationError: If the URL is not an http(s) URL.
            RuntimeError: If the pool is closed.
        """
        self._membership.add_server(base_url)

    def remove_server(self, base_url: str) -> None:
        """Remove a server; during a call it takes no new work and leaves once its
        requests in flight have finished.

        Safe to call from another thread while a call runs.

        Raises:
            KeyError: If the server is not in the pool.
        """
        self._membership.remove_server(base_url)

    def share_servers(self, workers: int) -> None:
        """Share each server with ``workers`` processes in all, this one included: from
        now on a member holds at most ``batch_size x max_concurrent_batches_per_client /
        workers`` requests (rounded down, at least one), so that the servers carry their
        budget once however many independent processes send to them. Windows above the
        new share shrink at once (requests in flight finish); with more room they grow
        back as answers come. ``1`` (the default) gives the whole budget.

        The workers of a corpus job run by claims call it themselves as they count each
        other (:mod:`llm_annotator.jobs.rundir.fleet`).

        Safe to call from another thread while a call runs.

        Raises:
            ConfigurationError: If ``workers`` is not an int >= 1.
        """
        self._membership.share(workers)

    def suspect_server(self, base_url: str, reason: str) -> bool:
        """Take a server out of rotation that another process sending to it found dead
        (the workers of one job tell each other: :mod:`llm_annotator.jobs.rundir.fleet`),
        before this pool's own requests find it so: its requests in flight go back on
        the queue, and it rejoins once it answers a probe and a test completion here,
        with no probation to wait out (if it answers this process, it was not dead to
        it). A server that is not a healthy member now (unknown, evicted already,
        joining) is left as it is, as is any server outside a call; so is one told
        again with the same ``reason`` (one eviction is acted on once).

        Safe to call from another thread while a call runs.

        Returns:
            True if the server was evicted.

        Raises:
            ConfigurationError: If the URL is not an http(s) URL.
        """
        return self._membership.suspect(base_url, reason)

    @property
    def sharing(self) -> int:
        """How many processes this pool shares its servers' budget with, itself
        included (:meth:`share_servers`)."""
        return self._state.sharing

    # -- calls -------------------------------------------------------------------------

    async def agenerate(
        self,
        *,
        messages: Messages,
        options: VLLMOnlineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> Response:
        """Async twin of :meth:`generate`: a batch of one."""
        responses = await self.abatch_generate(
            messages=[messages], options=options, gen_kwargs=gen_kwargs
        )
        return responses[0]

    async def abatch_generate(
        self,
        *,
        messages: list[Messages],
        options: VLLMOnlineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
    ) -> list[Response]:
        """Async twin of :meth:`batch_generate`."""
        return await self._calls.abatch_generate(messages, options, gen_kwargs)

    def astream(
        self,
        samples: Iterable[tuple[K, Messages]] | AsyncIterable[tuple[K, Messages]],
        *,
        options: VLLMOnlineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
        stop: asyncio.Event | None = None,
        group: Callable[[K], Hashable | None] | None = None,
        warmup: Messages | None = None,
    ) -> AsyncGenerator[tuple[K, Response], None]:
        """Generate for a stream of ``(key, conversation)`` pairs, yielding
        ``(key, Response)`` as each completes, in completion order.

        Samples are read from ``samples`` only as fast as the pool works through them
        (a bounded window of open samples), so a stream of any length runs in bounded
        memory. Every key comes back exactly once, unless the stream is stopped.
        A consumer that may stop reading early should close the stream
        (``async with contextlib.aclosing(pool.astream(...)) as stream``), which
        cancels the work in flight and frees the pool for its next call at once.

        Args:
            samples: The work, as a sync or async iterable of pairs. Keys are the
                caller's; they are handed back untouched.
            options: Generation options for every sample.
            gen_kwargs: Raw request parameters that override ``options``.
            stop: When set, no new work is taken: the requests in flight finish and
                are yielded, then the stream ends. Samples not yet sent are dropped.
            group: With ``prefix_affinity``, the group of a sample's key (samples of
                one group share a long prefix: they go to one member while it has
                room); None for a sample of no group. Ignored otherwise.
            warmup: With ``prefix_affinity``, a conversation each member answers once
                (one token) before its first sample: the prompts' shared prefix, so
                that every server holds it in its cache. Ignored otherwise.

        Raises:
            PoolExhaustedError: Every server stayed down for ``all_down_timeout``
                (after everything completed before was yielded).
        """
        return self._calls.astream(samples, options, gen_kwargs, stop, group, warmup)

    # -- the rest of the Client contract -------------------------------------------------

    async def aresolve_model(self, timeout: float | None = None) -> str:
        """The model the pool runs: the configured one, or the first a server lists.

        Waits for a server to answer ``/v1/models``, up to ``timeout`` seconds
        (``all_down_timeout`` by default), asking every member every 2 s.

        Raises:
            PoolExhaustedError: No server listed a model in time.
            ServersUnusableError: Every server refused for a reason waiting cannot fix
                (a wrong or missing API key, a TLS failure, a redirect, no such route).
        """
        return await self._health.resolve_model(self._membership, timeout)

    async def ais_healthy(self, timeout: float = default.HEALTH_TIMEOUT) -> bool:
        """Whether at least one member answers /health."""
        checks = [m.client.ais_healthy(timeout) for m in self._state.members.values()]
        return any(await asyncio.gather(*checks))

    async def aclose(self) -> None:
        """Close every member's connections; no server can be added after this."""
        state = self._state
        state.closed = True
        members = [*state.members.values(), *state.removed]
        await asyncio.gather(*(m.client.aclose() for m in members))

    def statistics(self) -> PoolStatistics:
        """A frozen snapshot of the pool's counters."""
        return self._state.statistics()

    def watch_members(self, watcher: Callable[[MemberChange], None]) -> Callable[[], None]:
        """Call ``watcher`` with every change of a member's state (joined, evicted,
        re-admitted, disabled, draining), as it happens, in the pool's event loop.

        The watcher must be quick and must not block: it runs inside the pool's
        decisions. An exception it raises is logged and otherwise ignored.

        Returns:
            A function that stops the watching.

        Examples:
            >>> pool = QueuePool(["http://127.0.0.1:9/v1"], model="m")
            >>> seen = []
            >>> stop_watching = pool.watch_members(seen.append)
            >>> stop_watching()
        """
        watchers = self._state.watchers
        watchers.append(watcher)

        def stop() -> None:
            if watcher in watchers:
                watchers.remove(watcher)

        return stop

    def __repr__(self) -> str:
        states = Counter(m.state.value for m in list(self._state.members.values()))
        parts = " ".join(
            f"{state.value}={states[state.value]}" for state in MemberState if states[state.value]
        )
        stats = self.statistics()
        return f"<{type(self).__name__} {parts} in_flight={stats.in_flight} queued={stats.queued}>"
