"""VLLMQueueAnnotator: the pool with annotation jobs, the class users make.

It sits above both layers it joins: the pool (:class:`~llm_annotator.pool.QueuePool`)
imports nothing of the jobs, and the job layer takes the pool as any client. Its only
additions are :meth:`~VLLMQueueAnnotator.annotate` and its async twin, which hand the
pool to an :class:`~llm_annotator.Annotator`; the job layer is imported when a job
starts, so that making a pool loads no Arrow or NumPy.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Unpack, cast

from llm_annotator.pool.queue import QueuePool

if TYPE_CHECKING:
    from llm_annotator.jobs.annotate import AnnotationResult, Annotator
    from llm_annotator.jobs.spec import JobArgs, PoolJobArgs


class VLLMQueueAnnotator(QueuePool):
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
        prefix_affinity: Keep the samples of one group (a stream's ``group``; a job's
            ``group_by`` column, or else its prompts' first field) on one member while
            it has room, so a shared prefix (a document asked several questions) is
            computed once and then found in that server's prefix cache; new groups go
            to whichever member is free, a member never idles while work waits, and
            an evicted member's groups go to the others. A stream's ``warmup``
            conversation is sent to each member once before its first sample. Off by
            default (see the performance guide, docs/performance.md).
        clock: Where the pool reads the time and sleeps: the system's by default; a
            test gives a fake one so that health intervals, backoff and deadlines pass
            without waiting.

    Raises:
        ConfigurationError: If no server is given, one is given twice, or a setting is
            out of range (a ``ValueError``).
        TypeError: If one of ``clients`` lacks what the pool needs of a member (a
            :class:`VLLMOnlineClient` has it all; see ``pool.backend.MemberClient``).

    Examples:
        >>> pool = VLLMQueueAnnotator(["http://127.0.0.1:8001/v1", "http://127.0.0.1:8002/v1"])
        >>> pool
        <VLLMQueueAnnotator joining=2 in_flight=0 queued=0>
        >>> pool.close()
    """

    def annotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        **settings: Unpack[PoolJobArgs],
    ) -> AnnotationResult:
        """Annotate a dataset over the pool into ``output_dir``, resumably.

        The same as ``Annotator(pool, progress=..., ...).annotate(data, ...)``: the
        keywords of :class:`~llm_annotator.jobs.spec.AnnotatorArgs` (``progress``,
        ``stop_grace``, ``flush_interval``, ``sync_interval``, ``metrics_port``,
        ``metrics_host``, ``timeline``) make the :class:`~llm_annotator.Annotator`, with
        its defaults; the others are the job options, each forwarded to
        :meth:`llm_annotator.Annotator.annotate` (see there for every one).
        """
        runner, job = self._runner(settings)
        return runner.annotate(data, prompt_template, output_dir, **job)

    async def aannotate(
        self,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        *,
        stop: asyncio.Event | None = None,
        **settings: Unpack[PoolJobArgs],
    ) -> AnnotationResult:
        """Async twin of :meth:`annotate`; set ``stop`` for a clean stop."""
        runner, job = self._runner(settings)
        return await runner.aannotate(data, prompt_template, output_dir, stop=stop, **job)

    def _runner(self, settings: Mapping[str, Any]) -> tuple[Annotator, JobArgs]:
        """The Annotator that the Annotator's settings among ``settings`` make, and the
        job options (the rest, which the job checks)."""
        # Imported here: making a pool loads no job layer (Arrow, NumPy).
        from llm_annotator.jobs.annotate import Annotator
        from llm_annotator.jobs.spec import ANNOTATOR_ARGS

        made = {name: value for name, value in settings.items() if name in ANNOTATOR_ARGS}
        job = {name: value for name, value in settings.items() if name not in ANNOTATOR_ARGS}
        return Annotator(self, **made), cast("JobArgs", job)
