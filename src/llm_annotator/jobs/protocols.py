"""What the job layer needs of a client, beyond :class:`~llm_annotator.clients.base.Client`.

The pool satisfies all of them; a single client (``OpenAIClient``, a test's fake) may
satisfy none, and the job then batches for it, counts one server, and watches nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Hashable
from typing import Any, Protocol, TypeVar, runtime_checkable

from llm_annotator.clients.base import Messages
from llm_annotator.pool.member import MemberChange
from llm_annotator.pool.statistics import PoolStatistics
from llm_annotator.response import Response

K = TypeVar("K")


@runtime_checkable
class Streamer(Protocol):
    """A client that streams a job's samples itself and reports on its servers, as
    :class:`~llm_annotator.VLLMQueueAnnotator` does. The job needs only this of a pool.
    """

    def astream(
        self,
        samples: AsyncIterable[tuple[K, Messages]],
        *,
        options: Any = None,
        gen_kwargs: dict[str, Any] | None = None,
        stop: asyncio.Event | None = None,
        group: Callable[[K], Hashable | None] | None = None,
        warmup: Messages | None = None,
    ) -> AsyncGenerator[tuple[K, Response], None]:
        """``(key, Response)`` pairs as each completes (``group`` and ``warmup``: see
        :meth:`~llm_annotator.pool.QueuePool.astream`)."""
        ...

    async def aresolve_model(self) -> str:
        """The model the servers run."""
        ...

    def statistics(self) -> PoolStatistics:
        """A snapshot of the servers' counters."""
        ...


@runtime_checkable
class ModelSource(Protocol):
    """A client that can say which model it runs (``OpenAIClient`` and the pool can)."""

    async def aresolve_model(self) -> str:
        """The model's name."""
        ...


@runtime_checkable
class MemberWatchable(Protocol):
    """A client that tells of its servers' changes of state (the pool does)."""

    def watch_members(self, watcher: Callable[[MemberChange], None]) -> Callable[[], None]:
        """Call ``watcher`` with each change; returns a function that stops it."""
        ...


@runtime_checkable
class SharesServers(Protocol):
    """A client that can hold a share of each server's budget only (the pool can), for
    the workers of one job that send to the same servers."""

    def share_servers(self, workers: int) -> None:
        """Hold a ``workers``-th of each server's budget from now on."""
        ...


@runtime_checkable
class SuspectsServers(Protocol):
    """A client that can take a server out that another process found dead (the pool
    can), for the workers of one job that send to the same servers."""

    def suspect_server(self, base_url: str, reason: str) -> bool:
        """Evict the server if it is a healthy member now; True if it was."""
        ...
