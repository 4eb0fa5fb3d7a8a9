"""A stream of results from any client: the pool's own, or batches for a single client."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Hashable
from typing import Any, TypeVar

from llm_annotator.clients.base import Client, Messages
from llm_annotator.jobs.protocols import ModelSource, Streamer
from llm_annotator.response import Response

K = TypeVar("K")

__all__ = ["ModelSource", "Streamer", "stream"]  # the protocols, here before protocols.py


def stream(
    client: Client[Any],
    samples: AsyncIterable[tuple[K, Messages]],
    *,
    options: Any,
    gen_kwargs: dict[str, Any] | None,
    stop: asyncio.Event,
    batch_size: int,
    max_concurrent_batches: int,
    group: Callable[[K], Hashable | None] | None = None,
    warmup: Messages | None = None,
) -> AsyncGenerator[tuple[K, Response], None]:
    """``(key, Response)`` pairs as they complete, for any client.

    A :class:`Streamer` (the pool) streams on its own, with ``group`` and ``warmup``
    for its prefix affinity (see :meth:`~llm_annotator.pool.QueuePool.astream`). Any other
    client gets batches of ``batch_size`` through ``abatch_generate``, up to
    ``max_concurrent_batches`` at once, each yielded when it completes.
    """
    if isinstance(client, Streamer):
        return client.astream(
            samples,
            options=options,
            gen_kwargs=gen_kwargs,
            stop=stop,
            group=group,
            warmup=warmup,
        )
    return _batched(client, samples, options, gen_kwargs, stop, batch_size, max_concurrent_batches)


async def _batched(
    client: Client[Any],
    samples: AsyncIterable[tuple[K, Messages]],
    options: Any,
    gen_kwargs: dict[str, Any] | None,
    stop: asyncio.Event,
    batch_size: int,
    max_concurrent_batches: int,
) -> AsyncGenerator[tuple[K, Response], None]:
    # The source is read by its own task: it may wait for results of this very stream
    # (regenerations), so the loop that yields them must never wait on it.
    buffer: deque[tuple[K, Messages]] = deque()
    more, room = asyncio.Event(), asyncio.Event()
    limit = batch_size * max_concurrent_batches

    async def read() -> None:
        async for pair in samples:
            while len(buffer) >= limit and not stop.is_set():
                room.clear()
                await room.wait()
            if stop.is_set():
                break
            buffer.append(pair)
            more.set()

    async def one_batch(batch: list[tuple[K, Messages]]) -> list[tuple[K, Response]]:
        responses = await client.abatch_generate(
            messages=[messages for _, messages in batch], options=options, gen_kwargs=gen_kwargs
        )
        return [(key, response) for (key, _), response in zip(batch, responses, strict=True)]

    reader = asyncio.ensure_future(read())
    stopped = asyncio.ensure_future(stop.wait())
    pending: set[asyncio.Future[Any]] = set()
    try:
        while True:
            while buffer and len(pending) < max_concurrent_batches and not stop.is_set():
                batch = [buffer.popleft() for _ in range(min(batch_size, len(buffer)))]
                room.set()
                pending.add(asyncio.ensure_future(one_batch(batch)))
            if reader.done() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
            source_over = reader.done() and not buffer
            if not pending and (source_over or stop.is_set()):
                return
            waiting: set[asyncio.Future[Any]] = set(pending)
            if not stopped.done():
                waiting.add(stopped)
            if len(pending) < max_concurrent_batches and not reader.done():
                more.clear()
                waiting.add(asyncio.ensure_future(more.wait()))
                waiting.add(reader)
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in waiting - pending - {stopped, reader}:
                future.cancel()  # the "more" waiter
            for future in done & pending:
                pending.discard(future)
                for pair in future.result():
                    yield pair
    finally:
        stopped.cancel()
        reader.cancel()
        for future in pending:
            future.cancel()
        for future in [*pending, reader]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await future  # its error, if any, was raised above
