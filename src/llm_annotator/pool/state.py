"""What every part of the pool shares: its settings, its members and the current call.

The pool is composed of small objects that each own one concern and share one
:class:`PoolState`:

- :class:`~llm_annotator.pool.effects.Effects` carries out the state changes (evict,
  disable, requeue, error rows) that the others decide on;
- :class:`~llm_annotator.pool.health.HealthMonitor` probes members, admits them and
  watches for a pool with no member left;
- :class:`~llm_annotator.pool.stall.StallWatch` finds members that hold requests and
  answer none;
- :class:`~llm_annotator.pool.dispatch.Dispatcher` runs the members' batch slots;
- :class:`~llm_annotator.pool.settle.Settler` settles every answer by the pure
  decisions of :mod:`~llm_annotator.pool.failures`, the one place they are carried out;
- :class:`~llm_annotator.pool.calls.Calls` runs one call (a batch or a stream);
- :class:`~llm_annotator.pool.membership.Membership` adds and removes servers, from any
  thread;
- :class:`~llm_annotator.pool.queue.QueuePool` is the public facade.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from llm_annotator._validate import check_api_key
from llm_annotator.clients.tls import Verify, ssl_setting
from llm_annotator.clients.tls import unverified_context as _unverified_context
from llm_annotator.clients.urls import normalize_base_url
from llm_annotator.clients.vllm_online_client import VLLMOnlineClient, VLLMOnlineRuntimeOptions
from llm_annotator.errors import ConfigurationError, DuplicateServerError, ProviderError
from llm_annotator.pool.backend import MemberClient
from llm_annotator.pool.clock import Clock
from llm_annotator.pool.config import PoolConfig
from llm_annotator.pool.discovery import ServerDiscovery
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member, MemberChange
from llm_annotator.pool.run import Run
from llm_annotator.pool.statistics import PoolStatistics

log = structlog.get_logger(__name__)

Options = tuple[VLLMOnlineRuntimeOptions | None, dict[str, Any] | None]
"""A call's generation options and raw parameters."""


@dataclass(frozen=True, slots=True)
class ClientFactory:
    """Builds the client of a server given by URL, with the pool's settings and keys."""

    config: PoolConfig
    verify: Verify
    api_key: str | None
    api_keys: Mapping[str, str]
    """Per-server keys, by normalised base URL."""

    @classmethod
    def build(
        cls, config: PoolConfig, api_key: str | Mapping[str, str] | None, verify: Verify
    ) -> ClientFactory:
        """Check the key and TLS settings once, naming the setting that is wrong.

        Raises:
            ConfigurationError: If a key or the CA bundle is unusable.
        """
        default_key, keys = _api_keys(api_key)
        tls = ssl_setting(verify)  # a bad CA bundle fails here, once, naming the setting
        if tls is False:
            log.warning(
                "tls_verification_disabled",
                detail="verify=False: no server's certificate is checked",
            )
            tls = _unverified_context()  # the same, without a warning per client
        return cls(config=config, verify=tls, api_key=default_key, api_keys=keys)

    def __call__(self, url: str) -> VLLMOnlineClient:
        config = self.config
        return VLLMOnlineClient(
            model=config.model,
            base_url=url,
            timeout=config.timeout,
            max_retries=0,
            on_error="ignore",
            connect_timeout=config.connect_timeout,
            api_key=self.api_keys.get(normalize_base_url(url), self.api_key),
            verify=self.verify,
            max_response_bytes=config.max_response_bytes,
        )


class PoolState:
    """The pool's settings, its members and its current call, shared by its parts.

    Attributes:
        config: The settings.
        clock: Where the pool reads the time and sleeps.
        new_client: Builds a member's client from its URL.
        discovery: Where servers are discovered, or None.
        members: The members by normalised base URL, in the order they joined.
        removed: Members removed (their connections are closed with the pool).
        run: The call running now, or None.
        loop: The event loop of the current call.
        verifying: The shared health check per member (and its number of evictions
            when the check began: a check from before an eviction is not shared
            with a doubt after it) that requests doubt.
        proving: The same for the shared test completion that samples doubt.
        params: The encoded request parameters per member, for the current call.
        options: The current call's options.
        closed: Whether the pool is closed.
        sharing: How many processes share each server's budget, this one included
            (:meth:`~llm_annotator.pool.queue.QueuePool.share_servers`).
    """

    def __init__(
        self,
        config: PoolConfig,
        clock: Clock,
        new_client: ClientFactory,
        discovery: ServerDiscovery | None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.new_client = new_client
        self.discovery = discovery
        self.members: dict[str, Member] = {}
        self.removed: list[Member] = []
        self.run: Run | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.verifying: dict[tuple[str, int], asyncio.Task[bool]] = {}
        self.proving: dict[tuple[str, int], asyncio.Task[ProviderError | None]] = {}
        self.params: dict[str, bytes] = {}
        self.options: Options = (None, None)
        self.closed = False
        self.sharing = 1
        self.watchers: list[Callable[[MemberChange], None]] = []
        """Called with every change of a member's state, in the pool's event loop."""
        self._group: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def add(self, member: Member) -> None:
        """Make ``member`` part of the pool.

        Raises:
            DuplicateServerError: If its server is in the pool already (a
                ConfigurationError).
        """
        if member.url in self.members:
            raise DuplicateServerError(f"server {member.url} is in the pool twice")
        self.members[member.url] = member
        member.on_move = self._moved

    def _moved(self, member: Member, before: MemberState) -> None:
        """Tell the watchers; a watcher that fails is logged and left out of this one."""
        after = member.state
        reason = member.last_error if after in (MemberState.EVICTED, MemberState.DISABLED) else None
        change = MemberChange(member.url, before.value, after.value, reason)
        for watcher in list(self.watchers):
            try:
                watcher(change)
            except Exception as error:  # an observer must never break the pool
                log.warning("member_watcher_failed", server=member.url, error=repr(error))

    def forget(self, member: Member) -> None:
        """Take ``member`` out of the pool (it stays among :attr:`removed`)."""
        if self.members.get(member.url) is member:
            del self.members[member.url]
            self.removed.append(member)

    def is_member(self, member: Member) -> bool:
        """Whether ``member`` is (still) the pool's member for its URL."""
        return self.members.get(member.url) is member

    def prototype(self) -> MemberClient:
        """A client to check options with (no connection is made)."""
        for member in self.members.values():
            return member.client
        return self.new_client("http://127.0.0.1:9/v1")

    def statistics(self) -> PoolStatistics:
        """A frozen snapshot of the pool's counters."""
        members = tuple(m.statistics() for m in list(self.members.values()))
        run = self.run
        return PoolStatistics(
            members=members,
            healthy=sum(m.state == MemberState.HEALTHY.value for m in members),
            queued=run.queued if run is not None else 0,
            in_flight=sum(m.in_flight for m in members),
        )

    def params_for(self, member: Member) -> bytes:
        """The current call's encoded request parameters for ``member``'s server."""
        params = self.params.get(member.url)
        if params is None:
            params = member.client.encode_params(*self.options)
            self.params[member.url] = params
        return params

    # -- the current call's tasks ---------------------------------------------------------

    def open_tasks(self, group: asyncio.TaskGroup) -> None:
        """Start a call: its tasks run in ``group``."""
        self._group = group

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run ``coro`` as a task of the current call."""
        if self._group is None:
            raise RuntimeError("no call is running")
        task: asyncio.Task[Any] = self._group.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def cancel_tasks(self) -> None:
        """Cancel every task of the current call and every shared health check."""
        for task in list(self._tasks):
            task.cancel()
        self._tasks.clear()
        for checks in (self.verifying, self.proving):
            for check in checks.values():
                check.cancel()
            checks.clear()


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
