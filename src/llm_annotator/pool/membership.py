"""Membership: servers joining and leaving the pool, from any thread, during a call."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable

import structlog

from llm_annotator.clients.urls import normalize_base_url
from llm_annotator.errors import ConfigurationError
from llm_annotator.pool.backend import MemberClient, lacks
from llm_annotator.pool.dispatch import Dispatcher
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member
from llm_annotator.pool.state import PoolState

log = structlog.get_logger(__name__)

_CROSS_THREAD_WAIT = 10.0
"""Seconds a change asked for from another thread waits for the pool's loop."""


class Membership:
    """Adds and removes the pool's servers; what :class:`ServerDiscovery` talks to.

    A change asked for from another thread while a call runs is carried out on the
    call's event loop, and its error (a duplicate server, a bad URL) is raised in the
    caller's thread.
    """

    def __init__(self, state: PoolState, dispatcher: Dispatcher, effects: Effects) -> None:
        self._state = state
        self._dispatcher = dispatcher
        self._effects = effects

    def populate(self, base_urls: Iterable[str], clients: Iterable[object]) -> None:
        """The pool's first members: ``base_urls``, ``clients``, and what its discovery
        lists now.

        Raises:
            ConfigurationError: If there is no server and no discovery, or a server is
                given twice.
            TypeError: If one of ``clients`` lacks what the pool calls on a member's
                client (:class:`~llm_annotator.pool.backend.MemberClient`; a
                :class:`~llm_annotator.clients.vllm_online_client.VLLMOnlineClient` has
                it).
        """
        state = self._state
        for url in base_urls:
            state.add(Member(state.new_client(url)))
        for client in clients:
            if not isinstance(client, MemberClient):
                missing = lacks(client)
                raise TypeError(
                    "clients must offer what a VLLMOnlineClient offers the pool (its health "
                    f"checks and metrics), got {type(client).__name__}"
                    + (f", which lacks {', '.join(missing)}" if missing else "")
                )
            state.add(Member(client))
        unknown = [url for url in state.new_client.api_keys if url not in state.members]
        if unknown and state.discovery is None:
            log.warning(
                "api_key_for_unknown_server",
                servers=unknown,
                detail="api_key names servers that are not in the pool; their keys are unused",
            )
        if state.discovery is not None:
            for url in state.discovery.initial_urls():
                if normalize_base_url(url) not in state.members:
                    state.add(Member(state.new_client(url)))
        elif not state.members:
            raise ConfigurationError(
                "the pool needs at least one server: give base_urls, clients or a discovery"
            )

    @property
    def base_urls(self) -> list[str]:
        """The members' base URLs, in the order they joined."""
        return list(self._state.members)

    def add_server(self, base_url: str) -> None:
        """Add a server; during a call it is probed and takes work once healthy.

        Raises:
            ConfigurationError: If the server is already in the pool, or the URL is not
                an http(s) URL.
            RuntimeError: If the pool is closed.
        """
        if self._state.closed:
            raise RuntimeError(f"cannot add {base_url}: the pool is closed")
        member = Member(self._state.new_client(base_url))
        self._in_loop(lambda: self._join(member))

    def remove_server(self, base_url: str) -> None:
        """Remove a server; during a call it takes no new work and leaves once its
        requests in flight have finished.

        Raises:
            KeyError: If the server is not in the pool.
        """
        url = normalize_base_url(base_url)
        if url not in self._state.members:
            raise KeyError(f"server {url} is not in the pool")
        self._in_loop(lambda: self._drain(url))

    def suspect(self, base_url: str, reason: str) -> bool:
        """Evict a healthy member that another process found dead (see
        :meth:`~llm_annotator.pool.queue.QueuePool.suspect_server`); True if it was.

        Raises:
            ConfigurationError: If the URL is not an http(s) URL.
        """
        url = normalize_base_url(base_url)
        done: list[bool] = []
        self._in_loop(lambda: done.append(self._suspect(url, reason)))
        return bool(done and done[0])

    def _suspect(self, url: str, reason: str) -> bool:
        member = self._state.members.get(url)
        run = self._state.run
        if member is None or run is None or member.state is not MemberState.HEALTHY:
            return False  # not ours, not in a call, or out of rotation already
        if not member.health.suspect(reason):
            return False  # acted on already (it came back since: it answers here)
        self._effects.evict(run, member, reason, probation=False)
        return True

    def share(self, workers: int) -> None:
        """Hold a ``workers``-th of each server's budget from now on (see
        :meth:`~llm_annotator.pool.queue.QueuePool.share_servers`).

        Raises:
            ConfigurationError: If ``workers`` is not an int >= 1.
        """
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigurationError(f"workers must be an int >= 1, got {workers!r}")
        self._in_loop(lambda: self._share(workers))

    def _share(self, workers: int) -> None:
        if workers == self._state.sharing:
            return
        was, self._state.sharing = self._state.sharing, workers
        self._dispatcher.reshare()
        log.info(
            "servers_shared",
            workers=workers,
            was=was,
            per_server=self._dispatcher.ceiling,
        )

    def _in_loop(self, action: Callable[[], None]) -> None:
        loop = self._state.loop
        if self._state.run is not None and loop is not None and loop.is_running():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                _call_in(loop, action)
                return
        action()

    def _join(self, member: Member) -> None:
        self._state.add(member)
        log.info("member_added", server=member.url)
        run = self._state.run
        if run is not None:
            self._dispatcher.attach(run, member)

    def _drain(self, url: str) -> None:
        member = self._state.members[url]
        log.info("member_removed", server=url, in_flight=len(member.in_flight))
        run = self._state.run
        if run is None or not member.in_flight:
            self._state.forget(member)
        else:
            member.drain()
            run.notify()


def _call_in(loop: asyncio.AbstractEventLoop, action: Callable[[], None]) -> None:
    """Run ``action`` on ``loop`` (another thread's) and wait; raise what it raised."""
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
    if not done.wait(timeout=_CROSS_THREAD_WAIT):
        # Still queued on the loop: it is carried out when the loop gets to it.
        log.warning(
            "membership_change_pending",
            waited_seconds=_CROSS_THREAD_WAIT,
            detail="the pool's event loop is busy; the change is made when it gets to it",
        )
        return
    if failure:
        raise failure[0]
