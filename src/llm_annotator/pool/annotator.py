"""VLLMQueueAnnotator: one work queue over many vLLM servers that survives their failures."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack

import structlog

from llm_annotator import _constants as default
from llm_annotator.clients._transport import Verify, normalize_base_url, ssl_setting
from llm_annotator.clients._transport import unverified_context as _unverified_context
from llm_annotator.clients.base import Client
from llm_annotator.clients.openai_client import check_api_key
from llm_annotator.clients.vllm_online_client import VLLMOnlineClient, VLLMOnlineRuntimeOptions
from llm_annotator.errors import (
    ConfigurationError,
    PoolExhaustedError,
    ProviderError,
    ServersUnusableError,
)
from llm_annotator.pool._calls import PoolCalls
from llm_annotator.pool.clock import SYSTEM_CLOCK, Clock
from llm_annotator.pool.config import FromConfig, PoolConfig
from llm_annotator.pool.discovery import ServerDiscovery
from llm_annotator.pool.member import Member, MemberState
from llm_annotator.pool.policy import CONFIGURATION_KINDS
from llm_annotator.pool.run import Run
from llm_annotator.pool.statistics import PoolStatistics
from llm_annotator.response import OnError

if TYPE_CHECKING:
    from llm_annotator.jobs.annotate import AnnotationResult, JobArgs

log = structlog.get_logger(__name__)


class VLLMQueueAnnotator(PoolCalls, Client[VLLMOnlineRuntimeOptions]):
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
        batch_size: Samples per batch.
        max_concurrent_batches_per_client: Batches in flight per member.
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

    # The settings, read-only (they live in ``self.config``, a frozen PoolConfig).
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
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if isinstance(base_urls, str):
            raise ConfigurationError("base_urls must be a list of URLs, not one string")
        self.config = PoolConfig(
            model=model,
            batch_size=batch_size,
            max_concurrent_batches_per_client=max_concurrent_batches_per_client,
            timeout=timeout,
            connect_timeout=connect_timeout,
            health_check_interval=health_check_interval,
            health_check_timeout=health_check_timeout,
            max_failed_health_checks=max_failed_health_checks,
            max_sample_evictions=max_sample_evictions,
            max_sample_retries=max_sample_retries,
            all_down_timeout=all_down_timeout,
            on_error=on_error,
            hedge_tail=hedge_tail,
            max_response_bytes=max_response_bytes,
            max_server_faults=max_server_faults,
            stall_window=stall_window,
        )
        self._api_key, self._api_keys = _api_keys(api_key)
        tls = ssl_setting(verify)  # a bad CA bundle fails here, once, naming the setting
        if tls is False:
            log.warning(
                "tls_verification_disabled",
                detail="verify=False: no server's certificate is checked",
            )
            tls = _unverified_context()  # the same, without a warning per client
        self._tls_verify = tls
        self._clock = clock
        self._members: dict[str, Member] = {}
        for url in base_urls or ():
            self._add_member(Member(self._new_client(url)))
        for client in clients or ():
            if not isinstance(client, VLLMOnlineClient):
                raise TypeError(
                    "clients must be VLLMOnlineClient instances (the pool needs their "
                    f"health checks and metrics), got {type(client).__name__}"
                )
            self._add_member(Member(client))
        self._discovery = discovery
        unknown = [url for url in self._api_keys if url not in self._members]
        if unknown and discovery is None:
            log.warning(
                "api_key_for_unknown_server",
                servers=unknown,
                detail="api_key names servers that are not in the pool; their keys are unused",
            )
        if discovery is not None:
            for url in discovery.initial_urls():
                if normalize_base_url(url) not in self._members:
                    self._add_member(Member(self._new_client(url)))
        elif not self._members:
            raise ConfigurationError(
                "VLLMQueueAnnotator needs at least one server: give base_urls, clients "
                "or a discovery"
            )
        self._run: Run | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._params: dict[str, bytes] = {}
        self._options: tuple[VLLMOnlineRuntimeOptions | None, dict[str, Any] | None] = (None, None)
        self._verifying: dict[str, asyncio.Task[bool]] = {}
        self._removed: list[Member] = []
        self._closed = False

    # -- membership --------------------------------------------------------------------

    def _add_member(self, member: Member) -> None:
        if member.url in self._members:
            raise ConfigurationError(f"server {member.url} is in the pool twice")
        self._members[member.url] = member

    @property
    def base_urls(self) -> list[str]:
        """The members' base URLs, in the order they joined."""
        return list(self._members)

    def add_server(self, base_url: str) -> None:
        """Add a server; during a call it is probed and takes work once healthy.

        Safe to call from another thread while a call runs.

        Raises:
            ValueError: If the server is already in the pool.
            ConfigurationError: If the URL is not an http(s) URL.
            RuntimeError: If the pool is closed.
        """
        if self._closed:
            raise RuntimeError(f"cannot add {base_url}: the pool is closed")
        member = Member(self._new_client(base_url))
        self._in_loop(lambda: self._join(member))

    def remove_server(self, base_url: str) -> None:
        """Remove a server; during a call it takes no new work and leaves once its
        requests in flight have finished.

        Safe to call from another thread while a call runs.

        Raises:
            KeyError: If the server is not in the pool.
        """
        url = normalize_base_url(base_url)
        if url not in self._members:
            raise KeyError(f"server {url} is not in the pool")
        self._in_loop(lambda: self._drain(url))

    def _in_loop(self, action: Callable[[], None]) -> None:
        loop = self._loop
        if self._run is not None and loop is not None and loop.is_running():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                done = threading.Event()
                failure: list[BaseException] = []

                def call() -> None:
                    try:
                        action()
                    except BaseException as exc:  # handed to the caller's thread
                        failure.append(exc)
                    finally:
                        done.set()

                loop.call_soon_threadsafe(call)
                done.wait(timeout=10)
                if failure:
                    raise failure[0]
                return
        action()

    def _join(self, member: Member) -> None:
        self._add_member(member)
        log.info("member_added", server=member.url)
        if self._run is not None:
            self._attach(self._run, member)

    def _drain(self, url: str) -> None:
        member = self._members[url]
        log.info("member_removed", server=url, in_flight=len(member.in_flight))
        if self._run is None or not member.in_flight:
            self._forget(member)
        else:
            member.drain()
            self._run.notify()

    # -- annotation jobs ------------------------------------------------------------------

    def annotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        progress: bool | None = None,
        stop_grace: float = default.STOP_GRACE,
        **job: Unpack[JobArgs],
    ) -> AnnotationResult:
        """Annotate a dataset over the pool into ``output_dir``, resumably.

        The same as ``Annotator(pool, progress=..., stop_grace=...).annotate(...)``;
        see :meth:`llm_annotator.Annotator.annotate` for every argument (the keywords
        of :class:`~llm_annotator.jobs.annotate.JobArgs`).
        """
        # The one call up the layers (pool -> jobs), allowed by name in the import
        # contract: the documented shortcut hands the pool to the job runner.
        from llm_annotator.jobs.annotate import Annotator

        runner = Annotator(self, progress=progress, stop_grace=stop_grace)
        return runner.annotate(data, prompt_template, output_dir, **job)

    async def aannotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        progress: bool | None = None,
        stop_grace: float = default.STOP_GRACE,
        stop: asyncio.Event | None = None,
        **job: Unpack[JobArgs],
    ) -> AnnotationResult:
        """Async twin of :meth:`annotate`; set ``stop`` for a clean stop."""
        from llm_annotator.jobs.annotate import Annotator

        runner = Annotator(self, progress=progress, stop_grace=stop_grace)
        return await runner.aannotate(data, prompt_template, output_dir, stop=stop, **job)

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
        config = self.config
        if config.model is not None:
            return config.model
        deadline = self._clock.now() + (config.all_down_timeout if timeout is None else timeout)
        said: dict[str, str] = {}
        while True:
            if self._discovery is not None:
                await self._discovery.refresh(self)
            members = list(self._members.values())
            answers = await asyncio.gather(
                *(m.client.alist_models() for m in members), return_exceptions=True
            )
            for member, answer in zip(members, answers, strict=True):
                if isinstance(answer, list) and answer:
                    return str(answer[0])
                if isinstance(answer, ProviderError):
                    said[member.url] = answer.message
                else:
                    said[member.url] = (
                        str(answer) if isinstance(answer, BaseException) else "no model"
                    )
            broken = [
                a for a in answers if isinstance(a, ProviderError) and a.kind in CONFIGURATION_KINDS
            ]
            if members and len(broken) == len(members):
                listing = "; ".join(str(error) for error in broken)
                raise ServersUnusableError(
                    f"no server of the pool can be used, and waiting will not help: {listing}",
                    servers=said,
                )
            left = deadline - self._clock.now()
            if left <= 0:
                listing = "; ".join(f"{url}: {text}" for url, text in said.items())
                raise PoolExhaustedError(
                    f"no server of the pool listed a model on /v1/models in time: {listing}",
                    servers=said,
                )
            await self._clock.sleep(min(2.0, left))

    async def ais_healthy(self, timeout: float = default.HEALTH_TIMEOUT) -> bool:
        """Whether at least one member answers /health."""
        checks = [m.client.ais_healthy(timeout) for m in self._members.values()]
        return any(await asyncio.gather(*checks))

    async def aclose(self) -> None:
        """Close every member's connections; no server can be added after this."""
        self._closed = True
        members = [*self._members.values(), *self._removed]
        await asyncio.gather(*(m.client.aclose() for m in members))

    def statistics(self) -> PoolStatistics:
        """A frozen snapshot of the pool's counters."""
        members = tuple(m.statistics() for m in list(self._members.values()))
        run = self._run
        return PoolStatistics(
            members=members,
            healthy=sum(m.state == MemberState.HEALTHY.value for m in members),
            queued=run.queued if run is not None else 0,
            in_flight=sum(m.in_flight for m in members),
        )

    def __repr__(self) -> str:
        states = Counter(m.state.value for m in list(self._members.values()))
        parts = " ".join(
            f"{state.value}={states[state.value]}" for state in MemberState if states[state.value]
        )
        stats = self.statistics()
        return f"<VLLMQueueAnnotator {parts} in_flight={stats.in_flight} queued={stats.queued}>"


def _api_keys(api_key: str | Mapping[str, str] | None) -> tuple[str | None, dict[str, str]]:
    """The default key and the per-server keys (by normalised base URL) of ``api_key``."""
    if api_key is None or isinstance(api_key, str):
        check_api_key(api_key)
        return api_key, {}
    if not isinstance(api_key, Mapping):
        raise ConfigurationError(
            "api_key must be a string, a mapping from base URL to key, or None, "
            f"got {type(api_key).__name__}"
        )
    keys: dict[str, str] = {}
    for url, key in api_key.items():
        check_api_key(key, where=f"api_key[{url!r}]")
        keys[normalize_base_url(url)] = key
    return None, keys
