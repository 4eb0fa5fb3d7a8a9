"""What every part of the pool shares: its settings, its members and the current call.

The pool is built in layers, one module each, so that each stays small:
``PoolCore`` (this: state and shared helpers) <- ``PoolHealth`` (probes, eviction,
re-admission) <- ``PoolWork`` (batch slots, settling answers, the tail) <- ``PoolCalls``
(a call from start to end: batch or stream) <- ``VLLMQueueAnnotator`` (the public API).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from llm_annotator.clients._transport import Verify, normalize_base_url
from llm_annotator.clients.vllm_online_client import VLLMOnlineClient, VLLMOnlineRuntimeOptions
from llm_annotator.pool.clock import Clock
from llm_annotator.pool.config import PoolConfig
from llm_annotator.pool.discovery import ServerDiscovery
from llm_annotator.pool.member import Member
from llm_annotator.pool.run import Run


class PoolCore:
    """The pool's settings and state; ``VLLMQueueAnnotator.__init__`` sets them all."""

    config: PoolConfig
    _clock: Clock
    _tls_verify: Verify
    _api_key: str | None
    _api_keys: Mapping[str, str]
    _members: dict[str, Member]
    _removed: list[Member]
    _discovery: ServerDiscovery | None
    _run: Run | None
    _loop: asyncio.AbstractEventLoop | None
    _group: asyncio.TaskGroup
    _tasks: set[asyncio.Task[Any]]
    _verifying: dict[str, asyncio.Task[bool]]
    _params: dict[str, bytes]
    _options: tuple[VLLMOnlineRuntimeOptions | None, dict[str, Any] | None]

    def _new_client(self, url: str) -> VLLMOnlineClient:
        return VLLMOnlineClient(
            model=self.config.model,
            base_url=url,
            timeout=self.config.timeout,
            max_retries=0,
            on_error="ignore",
            connect_timeout=self.config.connect_timeout,
            api_key=self._api_keys.get(normalize_base_url(url), self._api_key),
            verify=self._tls_verify,
            max_response_bytes=self.config.max_response_bytes,
        )

    def _prototype(self) -> VLLMOnlineClient:
        """A client to check options with (no connection is made)."""
        for member in self._members.values():
            return member.client
        return self._new_client("http://127.0.0.1:9/v1")

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = self._group.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _forget(self, member: Member) -> None:
        if self._members.get(member.url) is member:
            del self._members[member.url]
            self._removed.append(member)
