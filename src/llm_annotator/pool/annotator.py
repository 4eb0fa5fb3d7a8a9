"""VLLMQueueAnnotator: one work queue over many vLLM servers that survives their failures."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

import structlog

from llm_annotator import _constants as default
from llm_annotator.clients.base import Client, Messages
from llm_annotator.clients.tls import Verify
from llm_annotator.clients.vllm_online_client import VLLMOnlineClient, VLLMOnlineRuntimeOptions
from llm_annotator.errors import ConfigurationError
from llm_annotator.pool.calls import Calls
from llm_annotator.pool.clock import SYSTEM_CLOCK, Clock
from llm_annotator.pool.config import FromConfig, PoolConfig
from llm_annotator.pool.discovery import ServerDiscovery
from llm_annotator.pool.dispatch import Dispatcher
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.health import HealthMonitor
from llm_annotator.pool.member import MemberChange, MemberState
from llm_annotator.pool.membership import Membership
from llm_annotator.pool.stall import StallWatch
from llm_annotator.pool.state import ClientFactory, PoolState
from llm_annotator.pool.statistics import PoolStatistics
from llm_annotator.response import OnError, Response

if TYPE_CHECKING:
    from llm_annotator.jobs.annotate import AnnotationResult, Annotator, JobArgs

log = structlog.get_logger(__name__)


K = TypeVar("K")


class VLLMQueueAnnotator(Client[VLLMOnlineRuntimeOptions]):
    """Feed one work queue of conversations to many vLLM servers, surviving their failures.

    The conversations of a call are cut into batches of ``batch_size``. Every member
    (one per server) runs up to ``max_concurrent_batches_per_client`` batches at once,
    each batch with all its requests in flight, and takes the next batch as soon as one
    finishes, so fast servers get more work than slow ones.

    Members are probed on ``/health`` before and during a call. A member is evicted at
    once when a connection is refused or times out or its engine dies, and after
    ``max_failed_health_checks`` failed probes in a row (a hung server). Its requests in
    flight are cancelled and every sample without an answer goes back to the front of
    the queue: an eviction never turns a sample into an error row. Evicted members, and
    members down at the start, are probed in the background and rejoin when healthy.

    A sample at fault (a prompt too long, a bad parameter) keeps its error Response and
    never evicts a server; an overloaded server (429, 503) is backed off; a transient
    5xx is retried ``max_sample_retries`` times. A sample in flight on
    ``max_sample_evictions`` members that were each evicted is a poison sample and ends
    as an error Response. When every member is down for ``all_down_timeout`` seconds,
    the call raises :class:`PoolExhaustedError`, which holds every Response completed.

    Args:
        base_urls: The servers' base URLs (``http://host:port/v1``).
        clients: Ready :class:`VLLMOnlineClient` objects instead of (or besides)
            ``base_urls``. Give them ``max_retries=0``: the pool is the retry layer.
        model: Model name for the clients built from ``base_urls``; None asks each
            server.
        batch_size: Samples per batch: the most requests one batch slot of a member
            holds. A slot keeps its batch full, taking a sample whenever one of its
            answers arrives, so a member never waits for its slowest request.
        max_concurrent_batches_per_client: Batch slots per member. A member holds at
            most ``batch_size`` times this many requests: its window, which starts at
            64 at each call and grows by one with each answer (a round of answers
            doubles it), so that every server gets its first requests at once. Once
            the input is read, a member holds no more than its part of what is left,
            in proportion to how fast it answers, so that all finish together.
        timeout: Read timeout of one request, for clients built here.
        connect_timeout: Connect timeout, for clients built here.
        health_check_interval: Seconds between the starts of two probes of a member.
        health_check_timeout: Seconds a probe may take. Kept under 5 s, where aiohttp
            starts rounding timeouts up to whole seconds.
        max_failed_health_checks: Failed probes in a row that evict a healthy member.
            With the defaults a hung server is evicted within about 15 s of hanging.
        max_sample_evictions: Evictions a sample may live through before it is poison.
        max_sample_retries: Retries of a sample after transient server errors.
        all_down_timeout: Seconds to wait for a member when all are down.
        on_error: What error rows do: ``"warn"`` logs a summary, ``"ignore"`` nothing,
            ``"raise"`` raises the first one as ProviderError after the call.
        discovery: Sources of servers re-read during every call (a file, a directory
            of ``*.url`` files, a DNS name): servers that appear join once healthy,
            servers that disappear are drained and removed. With a discovery the pool
            may start empty and wait (``all_down_timeout``) for its first server.
        hedge_tail: Near the end of a call, when the queue is empty, let idle members
            also send samples still in flight on slower members; the first answer is
            kept, the other discarded. Shortens the tail on servers of unequal speed
            at the cost of some duplicate requests (counted in ``statistics()``).
        api_key: For servers started with ``--api-key``: one key for every server, or
            a mapping from base URL to key. A server the mapping does not name (a
            discovered one, say) gets the default of :class:`VLLMOnlineClient`: the
            ``VLLM_API_KEY`` environment variable, if set. Keys are never logged.
        verify: How to check the servers' TLS certificates (``https://`` URLs): True,
            a CA bundle path, an ``ssl.SSLContext`` or False (one warning is logged).
            A server whose certificate fails is disabled at once with a ``tls`` error
            that says so.
        max_response_bytes: The largest answer read from a server, for clients built
            here (16 MiB by default; see :class:`VLLMOnlineClient`).
        max_server_faults: Answers in a row that are the server's fault (not JSON or not
            a chat completion, over ``max_response_bytes``, cut off, a 5xx, a request
            timed out on a member that answers nothing) that evict a member. Each such
            sample is sent again to another member; it becomes an error row only after
            ``max_sample_retries`` such resends while other samples succeed.
        stall_window: The least time a member may hold requests and answer none before
            it is taken for hung, whatever its ``/health`` says: three times the
            longest gap between its answers so far, never less than this. Before
            evicting, the server's ``/metrics`` are read twice: an engine whose token
            counters grow is busy, not hung, and keeps its work. A hung member's
            requests are cancelled (their connections closed) and sent elsewhere.
        adaptive: Size each member's window (what it may hold, at most ``batch_size x
            max_concurrent_batches_per_client``) from its server's ``/metrics``, read
            every second: grown while the server queues nothing, shrunk to what it
            runs plus a few waiting when it queues more, and after preemptions. So no
            server holds a queue of work another could start sooner, and the end of a
            call does not wait for one. A server whose ``/metrics`` cannot be read gets
            the whole window. False (the default): the window grows with each answer
            up to the whole bound. Measured: on simulated servers of unequal speed
            both come within 1% of the work-conserving bound; on real CPU vLLM
            servers ``adaptive=True`` costs rows per second (their gauges read few
            requests running, and a smaller window leaves their API server short of
            work), so it is off until it is proven on GPU servers.
        clock: Where the pool reads the time and sleeps: the system's by default; a
            test gives a fake one so that health intervals, backoff and deadlines pass
            without waiting.

    Raises:
        ConfigurationError: If no server is given, one is given twice, or a setting is
            out of range (a ``ValueError``).
        TypeError: If one of ``clients`` is not a :class:`VLLMOnlineClient`.

    Examples:
        >>> pool = VLLMQueueAnnotator(["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1"])
        >>> pool
        <VLLMQueueAnnotator joining=2 in_flight=0 queued=0>
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

    def __init__(
        self,
        base_urls: Sequence[str] | None = None,
        *,
        clients: Sequence[VLLMOnlineClient] | None = None,
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
        self._membership = Membership(state, dispatcher)
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

        Raises:
            PoolExhaustedError: Every server stayed down for ``all_down_timeout``
                (after everything completed before was yielded).
        """
        return self._calls.astream(samples, options, gen_kwargs, stop)

    # -- annotation jobs ------------------------------------------------------------------

    def annotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        progress: bool | None = None,
        stop_grace: float = default.STOP_GRACE,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        timeline: bool = True,
        **job: Unpack[JobArgs],
    ) -> AnnotationResult:
        """Annotate a dataset over the pool into ``output_dir``, resumably.

        The same as ``Annotator(pool, progress=..., stop_grace=..., metrics_port=...,
        metrics_host=..., timeline=...).annotate(...)``;
        see :meth:`llm_annotator.Annotator.annotate` for every argument (the keywords
        of :class:`~llm_annotator.jobs.annotate.JobArgs`).
        """
        runner = self._runner(progress, stop_grace, metrics_port, metrics_host, timeline)
        return runner.annotate(data, prompt_template, output_dir, **job)

    async def aannotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        progress: bool | None = None,
        stop_grace: float = default.STOP_GRACE,
        metrics_port: int | None = None,
        metrics_host: str = "127.0.0.1",
        timeline: bool = True,
        stop: asyncio.Event | None = None,
        **job: Unpack[JobArgs],
    ) -> AnnotationResult:
        """Async twin of :meth:`annotate`; set ``stop`` for a clean stop."""
        runner = self._runner(progress, stop_grace, metrics_port, metrics_host, timeline)
        return await runner.aannotate(data, prompt_template, output_dir, stop=stop, **job)

    def _runner(
        self,
        progress: bool | None,
        stop_grace: float,
        metrics_port: int | None,
        metrics_host: str,
        timeline: bool,
    ) -> Annotator:
        # The one call up the layers (pool -> jobs), allowed by name in the import
        # contract: the documented shortcut hands the pool to the job runner.
        from llm_annotator.jobs.annotate import Annotator

        return Annotator(
            self,
            progress=progress,
            stop_grace=stop_grace,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            timeline=timeline,
        )

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
            >>> pool = VLLMQueueAnnotator(["http://127.0.0.1:9/v1"], model="m")
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
        return f"<VLLMQueueAnnotator {parts} in_flight={stats.in_flight} queued={stats.queued}>"
