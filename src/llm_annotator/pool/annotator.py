"""VLLMQueueAnnotator: one work queue over many vLLM servers that survives their failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections import Counter, deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Coroutine,
    Iterable,
    Sequence,
)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from llm_annotator._constants import CONNECT_TIMEOUT
from llm_annotator.clients._retry import retry_delay
from llm_annotator.clients._transport import normalize_base_url
from llm_annotator.clients.base import Client, Messages
from llm_annotator.clients.openai_client import check_client_settings
from llm_annotator.clients.vllm_online_client import VLLMOnlineClient, VLLMOnlineRuntimeOptions
from llm_annotator.errors import ErrorKind, PoolExhaustedError, ProviderError
from llm_annotator.pool.discovery import ServerDiscovery
from llm_annotator.pool.member import Member, MemberState, MemberStatistics
from llm_annotator.pool.policy import Action, action_for
from llm_annotator.pool.run import Deliver, Run
from llm_annotator.response import OnError, Response

if TYPE_CHECKING:
    from llm_annotator.jobs.annotate import AnnotationResult

log = structlog.get_logger(__name__)

K = TypeVar("K")

_MALFORMED_STREAK_TO_EVICT = 20
"""Malformed answers in a row, without a good one between, that evict a member."""
_MAX_OVERLOAD_REQUEUES = 50
"""Overload answers (429, 503) one sample may get before it becomes an error row."""


@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """A snapshot of the pool's counters, totals and per member (cumulative over calls).

    Attributes:
        members: One :class:`MemberStatistics` per server, in the order they joined.
        healthy: Members taking work now.
        queued: Samples waiting in the queue now.
        in_flight: Requests in flight now.
    """

    members: tuple[MemberStatistics, ...]
    healthy: int
    queued: int
    in_flight: int

    @property
    def completed(self) -> int:
        return sum(m.completed for m in self.members)

    @property
    def errors(self) -> int:
        return sum(m.errors for m in self.members)

    @property
    def evictions(self) -> int:
        return sum(m.evictions for m in self.members)

    @property
    def readmissions(self) -> int:
        return sum(m.readmissions for m in self.members)

    @property
    def requeued(self) -> int:
        return sum(m.requeued for m in self.members)

    @property
    def hedged(self) -> int:
        return sum(m.hedged for m in self.members)

    def member(self, server: str) -> MemberStatistics:
        """The statistics of the member with this base URL."""
        url = normalize_base_url(server)
        for stats in self.members:
            if stats.server == url:
                return stats
        raise KeyError(server)


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
        clients: Ready clients instead of (or besides) ``base_urls``. Give them
            ``max_retries=0``: the pool is the retry layer.
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

    Raises:
        ValueError: If no server is given, one is given twice, or a setting is out of
            range.

    Examples:
        >>> pool = VLLMQueueAnnotator(["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1"])
        >>> pool
        <VLLMQueueAnnotator joining=2 in_flight=0 queued=0>
        >>> pool.close()
    """

    provider = "vllm_pool"

    def __init__(
        self,
        base_urls: Sequence[str] | None = None,
        *,
        clients: Sequence[VLLMOnlineClient] | None = None,
        model: str | None = None,
        batch_size: int = 256,
        max_concurrent_batches_per_client: int = 4,
        timeout: float = 3600.0,
        connect_timeout: float = CONNECT_TIMEOUT,
        health_check_interval: float = 3.0,
        health_check_timeout: float = 4.0,
        max_failed_health_checks: int = 3,
        max_sample_evictions: int = 3,
        max_sample_retries: int = 2,
        all_down_timeout: float = 300.0,
        on_error: OnError = "warn",
        discovery: ServerDiscovery | None = None,
        hedge_tail: bool = True,
    ) -> None:
        if isinstance(base_urls, str):
            raise ValueError("base_urls must be a list of URLs, not one string")
        check_client_settings(timeout=timeout, max_retries=0, on_error=on_error, max_workers=None)
        for name, value in (
            ("batch_size", batch_size),
            ("max_concurrent_batches_per_client", max_concurrent_batches_per_client),
            ("max_failed_health_checks", max_failed_health_checks),
            ("max_sample_evictions", max_sample_evictions),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(max_sample_retries, int) or max_sample_retries < 0:
            raise ValueError(
                f"max_sample_retries must be an integer >= 0, got {max_sample_retries!r}"
            )
        for name, number in (
            ("health_check_interval", health_check_interval),
            ("health_check_timeout", health_check_timeout),
            ("all_down_timeout", all_down_timeout),
        ):
            if not isinstance(number, int | float) or number <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {number!r}")
        self.model = model
        self.batch_size = batch_size
        self.max_concurrent_batches_per_client = max_concurrent_batches_per_client
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.health_check_interval = float(health_check_interval)
        self.health_check_timeout = float(health_check_timeout)
        self.max_failed_health_checks = max_failed_health_checks
        self.max_sample_evictions = max_sample_evictions
        self.max_sample_retries = max_sample_retries
        self.all_down_timeout = float(all_down_timeout)
        self.on_error: OnError = on_error
        self.hedge_tail = hedge_tail
        self._members: dict[str, Member] = {}
        for url in base_urls or ():
            self._add_member(Member(self._new_client(url)))
        for client in clients or ():
            self._add_member(Member(client))
        self._discovery = discovery
        if discovery is not None:
            for url in discovery.initial_urls():
                if normalize_base_url(url) not in self._members:
                    self._add_member(Member(self._new_client(url)))
        elif not self._members:
            raise ValueError(
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

    # -- membership --------------------------------------------------------------------

    def _new_client(self, url: str) -> VLLMOnlineClient:
        return VLLMOnlineClient(
            model=self.model,
            base_url=url,
            timeout=self.timeout,
            max_retries=0,
            on_error="ignore",
            connect_timeout=self.connect_timeout,
        )

    def _prototype(self) -> VLLMOnlineClient:
        """A client to check options with (no connection is made)."""
        for member in self._members.values():
            return member.client
        return self._new_client("http://127.0.0.1:9/v1")

    def _add_member(self, member: Member) -> None:
        if member.url in self._members:
            raise ValueError(f"server {member.url} is in the pool twice")
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
        """
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
            member.state = MemberState.DRAINING
            self._run.notify()

    def _forget(self, member: Member) -> None:
        if self._members.get(member.url) is member:
            del self._members[member.url]
            self._removed.append(member)

    # -- the call ----------------------------------------------------------------------

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
        if not messages:
            return []
        results: list[Response | None] = [None] * len(messages)

        def deliver(index: int, response: Response) -> None:
            results[index] = response

        run = self._begin(deliver, options, gen_kwargs)
        for index, conversation in enumerate(messages):
            run.admit(index, conversation)
        run.close_source()
        started = time.monotonic()
        try:
            await self._drive(run)
        except PoolExhaustedError as exc:
            exc.responses = list(results)
            raise
        done: list[Response] = [r for r in results if r is not None]
        self._report(done, time.monotonic() - started)
        return done

    async def astream(
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
        outbox: deque[tuple[K, Response]] = deque()
        keys: dict[int, K] = {}
        arrived = asyncio.Event()
        room = asyncio.Event()

        def deliver(index: int, response: Response) -> None:
            outbox.append((keys.pop(index), response))
            arrived.set()

        def has_room(run: Run) -> bool:
            slots = self.max_concurrent_batches_per_client * max(1, len(self._members))
            return len(run.open) + len(outbox) < 2 * self.batch_size * slots

        run = self._begin(deliver, options, gen_kwargs)
        run.stop = stop
        extra = [self._feed(run, samples, keys, has_room, room)]
        if stop is not None:
            extra.append(self._watch_stop(run, stop))
        driver = asyncio.ensure_future(self._drive(run, extra))
        try:
            while True:
                while outbox:
                    yield outbox.popleft()
                room.set()
                if driver.done():
                    break
                arrived.clear()
                waiter = asyncio.ensure_future(arrived.wait())
                await asyncio.wait({driver, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            driver.result()  # PoolExhaustedError, or a failure of the source
        finally:
            if not driver.done():
                run.finish()  # every loop of the call ends on its own, then cancel
                driver.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await driver

    def _begin(
        self,
        deliver: Deliver,
        options: VLLMOnlineRuntimeOptions | None,
        gen_kwargs: dict[str, Any] | None,
    ) -> Run:
        """Check the options and claim the pool for one call."""
        if self._run is not None:
            raise RuntimeError("VLLMQueueAnnotator runs one call at a time")
        self._prototype().encode_params(options, gen_kwargs)  # ValueError before anything
        run = Run(self.batch_size, deliver)
        self._run, self._loop = run, asyncio.get_running_loop()
        self._params, self._options = {}, (options, gen_kwargs)
        return run

    async def _drive(self, run: Run, extra: Sequence[Coroutine[Any, Any, None]] = ()) -> None:
        """Run the members on ``run`` until it finishes; then release the pool."""
        log.info(
            "run_started",
            samples=run.admitted if run.source_done else None,
            servers=len(self._members),
            batch_size=self.batch_size,
            batches_per_server=self.max_concurrent_batches_per_client,
        )
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for member in list(self._members.values()):
                    self._attach(run, member)
                self._spawn(self._watch_all_down(run))
                if self._discovery is not None:
                    self._spawn(self._discovery.run(self, run.done))
                for coro in extra:
                    self._spawn(coro)
                await run.done.wait()
                for task in list(self._tasks):
                    task.cancel()
        finally:
            for coro in extra:
                coro.close()  # never started if the group failed early
            for task in list(self._tasks):
                task.cancel()
            self._tasks.clear()
            for check in self._verifying.values():
                check.cancel()
            self._verifying.clear()
            for member in list(self._members.values()):
                member.in_flight.clear()
                member.suspects.clear()
                if member.state is MemberState.DRAINING:
                    self._forget(member)
            self._run = None
        if run.failure is not None:
            raise run.failure
        if run.exhausted is not None:
            log.error("pool_exhausted", servers=run.exhausted.servers, done=run.delivered)
            raise run.exhausted

    async def _feed(
        self,
        run: Run,
        samples: Iterable[tuple[K, Messages]] | AsyncIterable[tuple[K, Messages]],
        keys: dict[int, K],
        has_room: Callable[[Run], bool],
        room: asyncio.Event,
    ) -> None:
        """Admit samples from the caller's stream while the window has room."""
        index = 0
        try:
            async for key, conversation in _aiterate(samples):
                while not has_room(run):
                    run.notify()
                    room.clear()
                    await room.wait()
                if run.finished or run.stopping:
                    return
                idle = not run.queue
                keys[index] = key
                run.admit(index, conversation)
                index += 1
                if idle:
                    run.notify()
        except Exception as exc:  # the source failed: end the call with its error
            run.finish(failure=exc)
            return
        run.close_source()

    async def _watch_stop(self, run: Run, stop: asyncio.Event) -> None:
        """Once ``stop`` is set, take no new work and end when nothing is in flight."""
        await stop.wait()
        in_flight = sum(len(m.in_flight) for m in self._members.values())
        log.info("run_stopping", in_flight=in_flight, open=len(run.open))
        run.notify()
        while not run.finished:
            if not any(m.in_flight or m.suspects for m in self._members.values()):
                run.finish()
                return
            await run.wait_for_change(0.1)

    def _report(self, results: list[Response], elapsed: float) -> None:
        failed = [r for r in results if not r.ok]
        log.info(
            "run_finished",
            samples=len(results),
            failed=len(failed),
            seconds=round(elapsed, 3),
            per_server=dict(Counter(r.server for r in results if r.ok)),
        )
        if not failed:
            return
        if self.on_error == "raise":
            first = failed[0]
            raise ProviderError(
                first.error or "request failed",
                kind=ErrorKind(first.error_type or ErrorKind.HTTP_ERROR.value),
            )
        if self.on_error == "warn":
            log.warning(
                "requests_failed",
                failed=len(failed),
                total=len(results),
                kinds=dict(Counter(r.error_type for r in failed)),
                first_error=failed[0].error,
            )

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = self._group.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _attach(self, run: Run, member: Member) -> None:
        """Start a member's probe loop and batch slots for this call."""
        if member.state is MemberState.DISABLED:
            return
        self._spawn(self._probe_loop(run, member))
        for _ in range(self.max_concurrent_batches_per_client):
            self._spawn(self._slot(run, member))

    def _params_for(self, member: Member) -> bytes:
        params = self._params.get(member.url)
        if params is None:
            params = member.client.encode_params(*self._options)
            self._params[member.url] = params
        return params

    # -- health ------------------------------------------------------------------------

    async def _probe_loop(self, run: Run, member: Member) -> None:
        while not run.finished and member.state not in (MemberState.DISABLED,):
            if self._members.get(member.url) is not member:
                return
            started = time.monotonic()
            evictions = member.evictions
            healthy = await member.client.ais_healthy(self.health_check_timeout)
            if member.evictions == evictions:  # else the answer predates the eviction
                await self._after_probe(run, member, healthy)
            pause = self.health_check_interval - (time.monotonic() - started)
            if pause > 0:
                await asyncio.sleep(pause)

    async def _after_probe(self, run: Run, member: Member, healthy: bool) -> None:
        state = member.state
        if state is MemberState.HEALTHY:
            if healthy:
                member.failed_probes = 0
                return
            member.failed_probes += 1
            if member.failed_probes >= self.max_failed_health_checks:
                self._evict(
                    run,
                    member,
                    f"no answer to {member.failed_probes} health checks in a row "
                    f"({self.health_check_timeout:g} s each)",
                )
        elif state in (MemberState.JOINING, MemberState.EVICTED):
            if healthy:
                await self._admit(run, member)
            elif state is MemberState.JOINING:
                member.state = MemberState.EVICTED
                member.was_down = True
                member.last_error = member.last_error or "no answer to GET /health"
                log.warning("member_down", server=member.url)
                run.notify()

    async def _admit(self, run: Run, member: Member) -> None:
        """Check the model of a member that answers /health, then let it take work."""
        try:
            models = await member.client.alist_models()
        except ProviderError as exc:
            member.last_error = str(exc)
            if exc.kind in (ErrorKind.AUTH, ErrorKind.NOT_FOUND):
                self._disable(run, member, str(exc))
            return
        wanted = member.client.model
        if wanted is None:
            if not models:
                self._disable(run, member, "lists no model on /v1/models")
                return
            member.client.model = models[0]
        elif wanted not in models:
            self._disable(
                run, member, f"does not serve model {wanted!r} (it serves {', '.join(models)})"
            )
            return
        rejoined = member.was_down or member.evictions > 0
        member.state = MemberState.HEALTHY
        member.failed_probes = 0
        member.backoff_until = 0.0
        member.overload_streak = 0
        member.malformed_streak = 0
        if rejoined:
            member.readmissions += 1
            log.info("member_readmitted", server=member.url, model=member.client.model)
        else:
            log.info("member_joined", server=member.url, model=member.client.model)
        member.was_down = False
        run.notify()

    async def _verify(self, member: Member) -> bool:
        """One shared health check for all the requests that doubt this member."""
        task = self._verifying.get(member.url)
        if task is None or task.done():
            task = asyncio.ensure_future(member.client.ais_healthy(self.health_check_timeout))
            self._verifying[member.url] = task
        return await asyncio.shield(task)

    async def _watch_all_down(self, run: Run) -> None:
        down_since: float | None = None
        while not run.finished:
            members = list(self._members.values())
            if any(m.state is MemberState.HEALTHY for m in members):
                down_since = None
            else:
                now = time.monotonic()
                if down_since is None:
                    down_since = now
                usable = [m for m in members if m.state is not MemberState.DISABLED]
                hopeless = not usable and self._discovery is None
                if hopeless or now - down_since >= self.all_down_timeout:
                    run.finish(self._exhausted(run, members, now - down_since))
                    return
            await run.wait_for_change(0.5)

    def _exhausted(self, run: Run, members: list[Member], waited: float) -> PoolExhaustedError:
        servers = {m.url: m.last_error or m.state.value for m in members}
        listing = "; ".join(f"{url}: {said}" for url, said in servers.items())
        return PoolExhaustedError(
            f"no server of the pool could take work for {waited:.0f} s "
            f"(all_down_timeout={self.all_down_timeout:g}); {run.delivered} of "
            f"{run.admitted} samples were done and are in .responses. Servers: {listing}",
            servers=servers,
        )

    # -- state changes -----------------------------------------------------------------

    def _evict(self, run: Run, member: Member, reason: str, cause: int | None = None) -> None:
        """Take a member out of rotation and cancel what it holds (requeued by its slots).

        ``cause`` is the sample whose request revealed the failure: it counts as in
        flight, and goes back on the queue unless that makes it poison.
        """
        evicting = member.state in (MemberState.HEALTHY, MemberState.DRAINING)
        if cause is not None and not (evicting and self._note_eviction(run, member, cause)):
            self._requeue_one(run, member, cause)
        if not evicting:
            return
        if member.state is MemberState.HEALTHY:
            member.state = MemberState.EVICTED  # a draining member just leaves
        member.evictions += 1
        member.failed_probes = 0
        member.last_error = reason
        poisoned = self._cancel_in_flight(run, member)
        log.warning(
            "member_evicted",
            server=member.url,
            reason=reason,
            in_flight=len(member.in_flight),
            poisoned=poisoned,
        )
        run.notify()

    def _disable(self, run: Run, member: Member, reason: str) -> None:
        member.state = MemberState.DISABLED
        member.last_error = reason
        self._cancel_in_flight(run, member)
        log.error("member_disabled", server=member.url, reason=reason)
        run.notify()

    def _cancel_in_flight(self, run: Run, member: Member) -> int:
        """Cancel the member's requests; count the eviction for every sample it held,
        including those whose request already failed and wait for a health check."""
        poisoned = 0
        for task, index in list(member.in_flight.items()):
            if task.done():
                continue  # its answer is being settled
            poisoned += self._note_eviction(run, member, index)
            task.cancel()
        for index in member.suspects:
            poisoned += self._note_eviction(run, member, index)
        member.suspects.clear()
        return poisoned

    def _note_eviction(self, run: Run, member: Member, index: int) -> bool:
        """Count that sample ``index`` was on ``member`` when it was evicted; True if that
        made it a poison sample (it then has its error Response)."""
        if not run.is_open(index):
            return False
        history = run.evicted_with.setdefault(index, [])
        history.append(member.url)
        if len(history) >= self.max_sample_evictions:
            return run.store(index, self._poison(member, history))
        return False

    def _poison(self, member: Member, history: list[str]) -> Response:
        return Response(
            error=(
                f"poison sample: it was in flight on {len(history)} servers that were each "
                f"evicted ({', '.join(history)}); it may be what brings servers down, so it "
                "was not sent again"
            ),
            error_type=ErrorKind.POISON.value,
            server=member.url,
            model=member.client.model,
            provider=member.client.provider,
        )

    # -- work --------------------------------------------------------------------------

    async def _slot(self, run: Run, member: Member) -> None:
        """One of a member's batch slots: take a batch whenever the member can work."""
        while not run.finished:
            if member.state is MemberState.DISABLED or self._members.get(member.url) is not member:
                return
            if member.state is MemberState.DRAINING:
                if not member.in_flight:
                    self._forget(member)
                    run.notify()
                    return
                await run.wait_for_change(1.0)
                continue
            if not member.takes_work:
                wait = member.backoff_until - time.monotonic()
                await run.wait_for_change(min(max(wait, 0.05), 1.0))
                continue
            batch = run.take(self._working_slots())
            tail = run.source_done and not run.queue and not run.stopping
            if batch is None and self.hedge_tail and tail:
                batch = self._hedge(run, member)
            if batch is None:
                await run.wait_for_change(1.0)
                continue
            await self._run_batch(run, member, batch)

    def _working_slots(self) -> int:
        healthy = sum(m.state is MemberState.HEALTHY for m in self._members.values())
        return max(1, healthy) * self.max_concurrent_batches_per_client

    def _hedge(self, run: Run, member: Member) -> list[int] | None:
        """Samples in flight on the members expected to finish last, not yet hedged."""
        elapsed = max(time.monotonic() - run.started, 1e-3)

        def expected_end(other: Member) -> float:
            rate = max(other.completed / elapsed, 1e-3)
            return len(other.in_flight) / rate

        others = [m for m in self._members.values() if m is not member and m.in_flight]
        suspects = run.evicted_with
        batch: list[int] = []
        for other in sorted(others, key=expected_end, reverse=True):
            for index in list(other.in_flight.values()):
                # A sample that was on an evicted member may be what kills servers.
                if index in run.open and index not in run.hedged and index not in suspects:
                    batch.append(index)
                    if len(batch) == self.batch_size:
                        break
            if len(batch) == self.batch_size:
                break
        if not batch:
            return None
        run.hedged.update(batch)
        member.hedged += len(batch)
        log.debug("samples_hedged", server=member.url, samples=len(batch))
        return batch

    async def _run_batch(self, run: Run, member: Member, batch: list[int]) -> None:
        """Send a batch at once; settle each answer as it arrives; requeue what is left."""
        params = self._params_for(member)
        client = member.client
        arrived: asyncio.Queue[asyncio.Task[Response | ProviderError]] = asyncio.Queue()
        tasks: dict[asyncio.Task[Response | ProviderError], int] = {}
        for index in batch:
            task = asyncio.ensure_future(client.asend(run.open[index], params))
            task.add_done_callback(arrived.put_nowait)  # one callback a task: O(batch)
            tasks[task] = index
            member.in_flight[task] = index
        try:
            for _ in range(len(tasks)):
                task = await arrived.get()
                member.in_flight.pop(task, None)
                if not task.cancelled():
                    self._settle(run, member, tasks[task], self._outcome(task, member))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
                member.in_flight.pop(task, None)
            leftovers = [i for t, i in tasks.items() if t.cancelled() or not t.done()]
            if leftovers and not run.finished:
                moved = run.requeue(leftovers)
                member.requeued += moved
                if moved:
                    log.info("samples_requeued", server=member.url, samples=moved)

    @staticmethod
    def _outcome(
        task: asyncio.Task[Response | ProviderError], member: Member
    ) -> Response | ProviderError:
        """The task's result; an unexpected exception becomes an error for the sample."""
        error = task.exception()
        if error is None:
            return task.result()
        return ProviderError(
            f"unexpected {type(error).__name__} in the client: {error}",
            kind=ErrorKind.HTTP_ERROR,
            server=member.url,
        )

    def _settle(
        self, run: Run, member: Member, index: int, result: Response | ProviderError
    ) -> None:
        """Decide what one answer means for its sample and its member."""
        if isinstance(result, Response):
            if run.store(index, result):
                member.completed += 1
            member.overload_streak = 0
            member.malformed_streak = 0
            return
        action = action_for(result.kind)
        reason = str(result)
        if action is Action.EVICT:
            self._evict(run, member, reason, cause=index)
        elif action is Action.VERIFY or action is Action.CHECK_HEALTH:
            if member.state not in (MemberState.HEALTHY, MemberState.DRAINING):
                self._requeue_one(run, member, index)  # already out; nothing to verify
            else:
                member.suspects.add(index)
                self._spawn(self._verify_then_settle(run, member, index, result, action))
        elif action is Action.BACKOFF:
            member.overload_streak += 1
            member.backoff_until = time.monotonic() + retry_delay(member.overload_streak - 1)
            member.last_error = reason
            run.overloads[index] += 1
            if run.overloads[index] > _MAX_OVERLOAD_REQUEUES:
                self._error_row(run, member, index, result)
            else:
                self._requeue_one(run, member, index)
        elif action is Action.RETRY:
            run.retries[index] += 1
            member.last_error = reason
            if run.retries[index] > self.max_sample_retries:
                self._error_row(run, member, index, result)
            else:
                self._spawn(self._requeue_later(run, index, retry_delay(run.retries[index] - 1)))
        elif action is Action.DISABLE:
            self._requeue_one(run, member, index)
            self._disable(run, member, reason)
        else:
            self._error_row(run, member, index, result)
            if result.kind is ErrorKind.MALFORMED:
                member.malformed_streak += 1
                if member.malformed_streak >= _MALFORMED_STREAK_TO_EVICT:
                    self._evict(
                        run, member, f"{member.malformed_streak} malformed answers in a row"
                    )

    async def _verify_then_settle(
        self, run: Run, member: Member, index: int, error: ProviderError, action: Action
    ) -> None:
        healthy = await self._verify(member)
        if not healthy:
            # Counts the eviction for every suspect of this member, this one included.
            self._evict(run, member, f"{error} and then failed a health check")
            member.suspects.discard(index)
            self._requeue_one(run, member, index)
            return
        member.suspects.discard(index)
        if not run.is_open(index):
            return
        if action is Action.CHECK_HEALTH:
            self._error_row(run, member, index, error)  # slow, on a healthy server
            return
        # A dropped connection or connect timeout on a healthy server: try again, a
        # bounded number of times, so a sample that always breaks its connection ends.
        run.retries[index] += 1
        if run.retries[index] > self.max_sample_retries:
            self._error_row(run, member, index, error)
        else:
            self._requeue_one(run, member, index)

    async def _requeue_later(self, run: Run, index: int, delay: float) -> None:
        await asyncio.sleep(delay)
        run.requeue([index])

    def _requeue_one(self, run: Run, member: Member, index: int) -> None:
        member.requeued += run.requeue([index])

    def _error_row(self, run: Run, member: Member, index: int, error: ProviderError) -> None:
        response = Response(
            error=str(error),
            error_type=error.kind.value,
            server=member.url,
            model=member.client.model,
            provider=member.client.provider,
        )
        if run.store(index, response):
            member.errors += 1
            member.last_error = str(error)

    # -- annotation jobs ------------------------------------------------------------------

    def annotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        system_message: str | None = None,
        id_column: str | None = None,
        options: VLLMOnlineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        retry_errors: bool = False,
        force: bool = False,
        write_jsonl: bool = False,
        max_regenerations: int = 2,
        progress: bool | None = None,
        stop_grace: float = 30.0,
    ) -> AnnotationResult:
        """Annotate a dataset over the pool into ``output_dir``, resumably.

        The same as ``Annotator(pool, progress=..., stop_grace=...).annotate(...)``;
        see :meth:`llm_annotator.Annotator.annotate` for every argument.
        """
        from llm_annotator.jobs.annotate import Annotator

        annotator = Annotator(self, progress=progress, stop_grace=stop_grace)
        return annotator.annotate(
            data,
            prompt_template,
            output_dir,
            system_message=system_message,
            id_column=id_column,
            options=options,
            gen_kwargs=gen_kwargs,
            columns=columns,
            retry_errors=retry_errors,
            force=force,
            write_jsonl=write_jsonl,
            max_regenerations=max_regenerations,
        )

    async def aannotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        system_message: str | None = None,
        id_column: str | None = None,
        options: VLLMOnlineRuntimeOptions | None = None,
        gen_kwargs: dict[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        retry_errors: bool = False,
        force: bool = False,
        write_jsonl: bool = False,
        max_regenerations: int = 2,
        progress: bool | None = None,
        stop_grace: float = 30.0,
        stop: asyncio.Event | None = None,
    ) -> AnnotationResult:
        """Async twin of :meth:`annotate`; set ``stop`` for a clean stop."""
        from llm_annotator.jobs.annotate import Annotator

        annotator = Annotator(self, progress=progress, stop_grace=stop_grace)
        return await annotator.aannotate(
            data,
            prompt_template,
            output_dir,
            system_message=system_message,
            id_column=id_column,
            options=options,
            gen_kwargs=gen_kwargs,
            columns=columns,
            retry_errors=retry_errors,
            force=force,
            write_jsonl=write_jsonl,
            max_regenerations=max_regenerations,
            stop=stop,
        )

    # -- the rest of the Client contract -------------------------------------------------

    async def aresolve_model(self, timeout: float | None = None) -> str:
        """The model the pool runs: the configured one, or the first a server lists.

        Waits for a server to answer ``/v1/models``, up to ``timeout`` seconds
        (``all_down_timeout`` by default), asking every member every 2 s.

        Raises:
            PoolExhaustedError: No server listed a model in time.
        """
        if self.model is not None:
            return self.model
        deadline = time.monotonic() + (self.all_down_timeout if timeout is None else timeout)
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
                said[member.url] = str(answer) if isinstance(answer, BaseException) else "no model"
            left = deadline - time.monotonic()
            if left <= 0:
                listing = "; ".join(f"{url}: {text}" for url, text in said.items())
                raise PoolExhaustedError(
                    f"no server of the pool listed a model on /v1/models in time: {listing}",
                    servers=said,
                )
            await asyncio.sleep(min(2.0, left))

    async def ais_healthy(self, timeout: float = 5.0) -> bool:
        """Whether at least one member answers /health."""
        checks = [m.client.ais_healthy(timeout) for m in self._members.values()]
        return any(await asyncio.gather(*checks))

    async def aclose(self) -> None:
        """Close every member's connections."""
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


async def _aiterate(samples: Iterable[K] | AsyncIterable[K]) -> AsyncIterator[K]:
    """Iterate a sync or an async iterable the same way."""
    if isinstance(samples, AsyncIterable):
        async for item in samples:
            yield item
    else:
        for item in samples:
            yield item
