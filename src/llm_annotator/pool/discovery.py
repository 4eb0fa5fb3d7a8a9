"""Live server discovery: the pool follows a file, a directory or a DNS name during a run.

A :class:`ServerDiscovery` reads its sources every ``interval`` seconds and brings a
pool in line with what they list: a new URL is added (it joins once its ``/health``
answers), a URL no source lists any more is removed (its member drains: it finishes
what it holds and takes nothing new). Servers given to the pool by hand are never
removed. A source that cannot be read keeps its last list, so a DNS hiccup or a file
being replaced never empties the pool.

The sources are in :mod:`llm_annotator.pool.sources` (re-exported here).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Protocol

import structlog

from llm_annotator.clients.urls import normalize_base_url
from llm_annotator.errors import ConfigurationError, DuplicateServerError
from llm_annotator.pool.sources import (
    DirectorySource,
    DnsSource,
    FileSource,
    ServerSource,
    address_url,
    parse_dns_target,
)

__all__ = [
    "DISCOVERY_INTERVAL",
    "SOURCE_TIMEOUT",
    "Changes",
    "DirectorySource",
    "DnsSource",
    "FileSource",
    "PoolLike",
    "ServerDiscovery",
    "ServerSource",
    "address_url",
    "parse_dns_target",
    "plan_changes",
]

log = structlog.get_logger(__name__)

DISCOVERY_INTERVAL = 2.0
"""Seconds between two reads of the sources."""
SOURCE_TIMEOUT = 10.0
"""Seconds one read of one source may take before the round goes on without it."""


class PoolLike(Protocol):
    """What discovery needs of a pool (``VLLMQueueAnnotator`` has it)."""

    @property
    def base_urls(self) -> list[str]: ...

    def add_server(self, base_url: str) -> None:
        """Add a server; raise DuplicateServerError (or ValueError) if it is there."""

    def remove_server(self, base_url: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Changes:
    """What one discovery round does to the pool.

    Attributes:
        add: URLs listed and not in the pool: add them.
        remove: URLs discovery added that no source lists any more: drain them.
        waiting: URLs listed again while their old member still drains: add them once
            it has left.
    """

    add: tuple[str, ...]
    remove: tuple[str, ...]
    waiting: tuple[str, ...]


def plan_changes(
    listed: AbstractSet[str],
    members: Sequence[str],
    owned: AbstractSet[str],
    withdrawn: AbstractSet[str],
) -> Changes:
    """Compare what the sources list with the pool: a pure function.

    Args:
        listed: URLs the sources list now.
        members: The pool's members (``base_urls``), draining ones included.
        owned: Members discovery added (only those are ever removed).
        withdrawn: URLs discovery removed; those still members are draining.

    Examples:
        >>> plan_changes({"http://b/v1"}, ["http://a/v1"], {"http://a/v1"}, set())
        Changes(add=('http://b/v1',), remove=('http://a/v1',), waiting=())
    """
    present = set(members)
    draining = present & withdrawn
    return Changes(
        add=tuple(sorted(set(listed) - present)),
        remove=tuple(
            url for url in members if url in owned and url not in listed and url not in draining
        ),
        waiting=tuple(sorted(draining & listed)),
    )


class ServerDiscovery:
    """Keep a pool's members in line with what some sources list, during a run.

    Run :meth:`run` as a task beside the pool's call: every ``interval`` seconds it
    reads every source (at once) and adds the URLs that appeared and removes the ones
    that disappeared. Only URLs that discovery added (or handed out through
    :meth:`initial_urls`) are ever removed. A source that fails keeps its last list
    and is logged once until it reads again.

    Args:
        sources: Where to find servers.
        interval: Seconds between two rounds.
        source_timeout: Seconds one read of one source may take.

    Raises:
        ConfigurationError: If there is no source or a number is out of range.

    Examples:
        >>> discovery = ServerDiscovery([DnsSource("vllm.example", 8000)], interval=5)
        >>> discovery
        <ServerDiscovery sources=1 listed=0 added=0 draining=0 interval=5>
    """

    def __init__(
        self,
        sources: Sequence[ServerSource],
        *,
        interval: float = DISCOVERY_INTERVAL,
        source_timeout: float = SOURCE_TIMEOUT,
    ) -> None:
        if not sources:
            raise ConfigurationError("ServerDiscovery needs at least one source")
        for name, value in (("interval", interval), ("source_timeout", source_timeout)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigurationError(f"{name} must be a positive number, got {value!r}")
        self.sources: tuple[ServerSource, ...] = tuple(sources)
        self.interval = float(interval)
        self.source_timeout = float(source_timeout)
        self._listed: list[frozenset[str]] = [frozenset()] * len(self.sources)
        self._failing: list[str | None] = [None] * len(self.sources)
        self._owned: set[str] = set()
        self._withdrawn: set[str] = set()
        self._waiting: set[str] = set()

    @property
    def listed(self) -> list[str]:
        """The URLs the sources listed at their last good read, in source order."""
        seen: dict[str, None] = {}
        for urls in self._listed:
            seen.update(dict.fromkeys(sorted(urls)))
        return list(seen)

    def initial_urls(self) -> list[str]:
        """Read every source once, synchronously, to build the pool before a run.

        The URLs returned count as discovered: they are removed from the pool when no
        source lists them any more. The list may be empty (no server is up yet).
        """
        for index, source in enumerate(self.sources):
            try:
                self._note_read(index, source.read_sync())
            except Exception as exc:  # a source's failure is logged, never raised
                self._note_failure(index, exc)
        urls = self.listed
        self._owned.update(urls)
        return urls

    async def refresh(self, pool: PoolLike) -> tuple[list[str], list[str]]:
        """One round: read the sources, then add and remove members.

        Returns:
            The URLs added and the URLs removed (drained) this round.
        """
        await asyncio.gather(*(self._read(i, s) for i, s in enumerate(self.sources)))
        members = pool.base_urls
        changes = plan_changes(set(self.listed), members, self._owned, self._withdrawn)
        added: list[str] = []
        removed: list[str] = []
        for url in changes.add:
            try:
                pool.add_server(url)
            except DuplicateServerError:  # joined meanwhile by someone else: not ours
                continue
            except ConfigurationError as exc:
                log.warning("discovery_entry_skipped", entry=url, reason=str(exc))
                continue
            except ValueError:  # a PoolLike of another kind saying the same as the first
                continue
            self._owned.add(url)
            self._withdrawn.discard(url)
            added.append(url)
            log.info("server_discovered", server=url, source=self._source_of(url))
        for url in changes.remove:
            with contextlib.suppress(KeyError):  # left meanwhile
                pool.remove_server(url)
                self._withdrawn.add(url)
                removed.append(url)
                log.info("server_withdrawn", server=url)
            self._owned.discard(url)
        for url in set(changes.waiting) - self._waiting:
            log.info("server_rejoin_pending", server=url, reason="its old member still drains")
        self._waiting = set(changes.waiting)
        present = set(pool.base_urls)
        self._owned &= present
        self._withdrawn &= present
        return added, removed

    async def run(self, pool: PoolLike, stop: asyncio.Event) -> None:
        """Run a round every ``interval`` seconds until ``stop`` is set; never raises
        because of a source or a round that failed (it logs them)."""
        while not stop.is_set():
            try:
                await self.refresh(pool)
            except Exception as exc:
                log.error("discovery_round_failed", error=f"{type(exc).__name__}: {exc}")
            await _wait(stop, self.interval)

    async def _read(self, index: int, source: ServerSource) -> None:
        try:
            async with asyncio.timeout(self.source_timeout):
                urls = await source.read()
        except Exception as exc:  # a source's failure is logged, never raised
            self._note_failure(index, exc)
        else:
            self._note_read(index, urls)

    def _note_read(self, index: int, urls: set[str] | None) -> None:
        if urls is None:
            return
        good: set[str] = set()
        for url in urls:
            try:
                good.add(normalize_base_url(url))
            except ConfigurationError as exc:
                log.warning("discovery_entry_skipped", entry=str(url)[:200], reason=str(exc))
        self._listed[index] = frozenset(good)
        if self._failing[index] is not None:
            self._failing[index] = None
            log.info("discovery_source_recovered", source=self.sources[index].description)

    def _note_failure(self, index: int, exc: Exception) -> None:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self._failing[index] != error:  # once per failure, not once per round
            self._failing[index] = error
            log.warning(
                "discovery_source_failed",
                source=self.sources[index].description,
                error=error,
                keeping=len(self._listed[index]),
            )

    def _source_of(self, url: str) -> str:
        return next(
            (
                s.description
                for s, urls in zip(self.sources, self._listed, strict=True)
                if url in urls
            ),
            "?",
        )

    def __repr__(self) -> str:
        return (
            f"<ServerDiscovery sources={len(self.sources)} listed={len(self.listed)} "
            f"added={len(self._owned)} draining={len(self._withdrawn)} "
            f"interval={self.interval:g}>"
        )


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Wait until ``event`` is set or ``seconds`` have passed."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()
