"""Work: batch slots, settling each answer by whose fault a failure is, the tail."""

from __future__ import annotations

import asyncio

import structlog

from llm_annotator.clients._retry import retry_delay
from llm_annotator.errors import ErrorKind, ProviderError
from llm_annotator.pool._health import PoolHealth
from llm_annotator.pool.member import Member, MemberState
from llm_annotator.pool.policy import (
    Action,
    action_for,
    evicts,
    fault_once_healthy,
    gives_up_on_sample,
    timeout_action,
)
from llm_annotator.pool.run import Run
from llm_annotator.response import Response

log = structlog.get_logger(__name__)

_MAX_OVERLOAD_REQUEUES = 50
"""Overload answers (429, 503) one sample may get before it becomes an error row."""


class PoolWork(PoolHealth):
    """Members' batch slots: take a batch, send it, settle every answer."""

    def _attach(self, run: Run, member: Member) -> None:
        """Start a member's probe loop and batch slots for this call."""
        if member.state is MemberState.DISABLED:
            return
        self._spawn(self._probe_loop(run, member))
        self._spawn(self._watch_progress(run, member))
        for _ in range(self.config.max_concurrent_batches_per_client):
            self._spawn(self._slot(run, member))

    def _params_for(self, member: Member) -> bytes:
        params = self._params.get(member.url)
        if params is None:
            params = member.client.encode_params(*self._options)
            self._params[member.url] = params
        return params

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
            now = self._clock.now()
            if not member.takes_work(now):
                # Not healthy: every change of state notifies, so a long wait is fine.
                # Backing off: wake when the pause ends.
                backing_off = member.state is MemberState.HEALTHY
                wait = member.backoff_until - now if backing_off else 1.0
                await run.wait_for_change(min(max(wait, 0.05), 1.0))
                continue
            batch = run.take(self._working_slots(), self._shunned_by(member))
            tail = run.source_done and not run.queue and not run.stopping
            if batch is None and self.config.hedge_tail and tail:
                batch = self._hedge(run, member)
            if batch is None:
                await run.wait_for_change(1.0)
                continue
            await self._run_batch(run, member, batch)

    def _shunned_by(self, member: Member) -> str | None:
        """``member``'s URL if samples that failed there should wait for another member
        (one that takes work now); else None."""
        if not self._run or not self._run.avoid:
            return None
        now = self._clock.now()
        for other in self._members.values():
            if other is not member and other.takes_work(now):
                return member.url
        return None

    def _working_slots(self) -> int:
        healthy = sum(m.state is MemberState.HEALTHY for m in self._members.values())
        return max(1, healthy) * self.config.max_concurrent_batches_per_client

    def _hedge(self, run: Run, member: Member) -> list[int] | None:
        """Samples in flight on the members expected to finish last, not yet hedged."""
        elapsed = max(self._clock.now() - run.started, 1e-3)

        def expected_end(other: Member) -> float:
            rate = max(other.completed / elapsed, 1e-3)
            return len(other.in_flight) / rate

        others = [m for m in self._members.values() if m is not member and m.in_flight]
        suspects = run.evicted_with
        failed_here = {i for i, url in run.avoid.items() if url == member.url}
        batch: list[int] = []
        for other in sorted(others, key=expected_end, reverse=True):
            for index in list(other.in_flight.values()):
                # A sample that was on an evicted member may be what kills servers.
                if (
                    index in run.open
                    and index not in run.hedged
                    and index not in suspects
                    and index not in failed_here
                ):
                    batch.append(index)
                    if len(batch) == self.config.batch_size:
                        break
            if len(batch) == self.config.batch_size:
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
        sent_at = self._clock.now()
        member.note_sent(sent_at)
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
                    outcome = self._outcome(task, member)
                    if not _timed_out(outcome):  # an answer: the member is not hung
                        member.note_arrival(self._clock.now())
                    self._settle(run, member, tasks[task], outcome, sent_at)
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
        unexpected = ProviderError(
            f"unexpected {type(error).__name__} in the client: {error}",
            kind=ErrorKind.HTTP_ERROR,
            server=member.url,
        )
        return member.client.redact(unexpected)

    def _settle(
        self,
        run: Run,
        member: Member,
        index: int,
        result: Response | ProviderError,
        sent_at: float = float("inf"),
    ) -> None:
        """Decide what one answer means for its sample and its member (its request was
        sent at ``sent_at``)."""
        if isinstance(result, Response):
            if run.store(index, result):
                member.completed += 1
            member.note_answer()
            return
        action = action_for(result.kind)
        if action is Action.TIMED_OUT:
            # Did the member answer anything else while this request was out?
            action = timeout_action(member_answering=member.last_answer_at > sent_at)
        reason = str(result)
        if action is Action.EVICT:
            self._evict(run, member, reason, cause=index)
        elif action is Action.VERIFY:
            if member.state not in (MemberState.HEALTHY, MemberState.DRAINING):
                self._requeue_one(run, member, index)  # already out; nothing to verify
            else:
                member.suspects.add(index)
                self._spawn(self._verify_then_settle(run, member, index, result, sent_at))
        elif action is Action.BACKOFF:
            member.back_off(self._clock.now(), retry_delay)
            member.last_error = reason
            run.overloads[index] += 1
            if run.overloads[index] > _MAX_OVERLOAD_REQUEUES:
                self._error_row(run, member, index, result)
            else:
                self._requeue_one(run, member, index)
        elif action is Action.SERVER_FAULT:
            self._server_fault(run, member, index, result)
        elif action is Action.DISABLE:
            self._requeue_one(run, member, index)
            self._disable(run, member, reason)
        else:
            self._error_row(run, member, index, result)

    def _server_fault(
        self,
        run: Run,
        member: Member,
        index: int,
        error: ProviderError,
        *,
        counts: bool = True,
    ) -> None:
        """The member failed the sample: count it against the member (unless ``counts``
        is False: one event already counted), send the sample elsewhere, or end it once
        it has failed on every try while others succeed."""
        reason = str(error)
        member.last_error = reason
        if index in run.hedged and self._in_flight_elsewhere(member, index):
            return  # its other copy is still on its way
        faults = run.note_fault(index, member.url)
        if member.state not in (MemberState.HEALTHY, MemberState.DRAINING):
            # Sent before the member was evicted, answered after: it was on the member
            # when it broke, like the requests the eviction cancelled.
            if not self._note_eviction(run, member, index):
                self._requeue_one(run, member, index)
            return
        if not counts:
            self._requeue_one(run, member, index)
            return
        streak = member.note_fault(index)
        log.debug(
            "server_fault",
            server=member.url,
            kind=error.kind.value,
            streak=streak,
            sample_faults=faults,
        )
        if gives_up_on_sample(
            faults,
            self.config.max_sample_retries,
            pool_answered_since=run.answered_since_first_fault(index),
        ):
            self._error_row(run, member, index, error)
        else:
            self._requeue_one(run, member, index)
        if evicts(streak, self.config.max_server_faults):
            broke_on = list(member.fault_samples)
            self._evict(
                run, member, f"{streak} answers in a row were the server's fault; last: {reason}"
            )
            for sample in broke_on:
                self._note_eviction(run, member, sample)

    def _in_flight_elsewhere(self, member: Member, index: int) -> bool:
        return any(
            index in other.in_flight.values()
            for other in self._members.values()
            if other is not member
        )

    async def _verify_then_settle(
        self, run: Run, member: Member, index: int, error: ProviderError, sent_at: float
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
        if fault_once_healthy(error.kind):
            # Requests dropped together (one reset of the server's connections) count as
            # one fault of the member, not one each: a drop counts only if its request
            # was sent after the last drop that counted.
            fresh = sent_at > member.drop_counted_at
            if fresh:
                member.drop_counted_at = self._clock.now()
            self._server_fault(run, member, index, error, counts=fresh)
            return
        # A connect timeout on a healthy server: try again, a bounded number of times,
        # so a sample that always breaks its connection ends.
        run.retries[index] += 1
        if run.retries[index] > self.config.max_sample_retries:
            self._error_row(run, member, index, error)
        else:
            self._requeue_one(run, member, index)

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


def _timed_out(outcome: Response | ProviderError) -> bool:
    return isinstance(outcome, ProviderError) and outcome.kind is ErrorKind.READ_TIMEOUT
