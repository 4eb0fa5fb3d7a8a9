"""Dispatch: the members' batch slots, settling each answer, and the tail."""

from __future__ import annotations

import asyncio

import structlog

from llm_annotator.clients._retry import retry_delay
from llm_annotator.errors import ErrorKind, ProviderError
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.health import HealthMonitor
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
from llm_annotator.pool.stall import StallWatch
from llm_annotator.pool.state import PoolState
from llm_annotator.response import Response

log = structlog.get_logger(__name__)

_MAX_OVERLOAD_REQUEUES = 50
"""Overload answers (429, 503) one sample may get before it becomes an error row."""


class Dispatcher:
    """Members' batch slots: take a batch, send it, settle every answer."""

    def __init__(
        self, state: PoolState, effects: Effects, health: HealthMonitor, stall: StallWatch
    ) -> None:
        self._state = state
        self._effects = effects
        self._health = health
        self._stall = stall

    def attach(self, run: Run, member: Member) -> None:
        """Start a member's probe loop and batch slots for this call."""
        if member.state is MemberState.DISABLED:
            return
        self._state.spawn(self._health.probe_loop(run, member))
        self._state.spawn(self._stall.watch(run, member))
        for _ in range(self._state.config.max_concurrent_batches_per_client):
            self._state.spawn(self._slot(run, member))

    # -- work --------------------------------------------------------------------------

    async def _slot(self, run: Run, member: Member) -> None:
        """One of a member's batch slots: take a batch whenever the member can work."""
        while not run.finished:
            if member.state is MemberState.DISABLED or not self._state.is_member(member):
                return
            if member.state is MemberState.DRAINING:
                if not member.in_flight:
                    self._state.forget(member)
                    run.notify()
                    return
                await run.wait_for_change(1.0)
                continue
            now = self._state.clock.now()
            if not member.takes_work(now):
                # Not healthy: every change of state notifies, so a long wait is fine.
                # Backing off: wake when the pause ends.
                backing_off = member.state is MemberState.HEALTHY
                wait = member.backoff_until - now if backing_off else 1.0
                await run.wait_for_change(min(max(wait, 0.05), 1.0))
                continue
            batch = run.take(self._working_slots(), self._shunned_by(member))
            tail = run.source_done and not run.queue and not run.stopping
            if batch is None and self._state.config.hedge_tail and tail:
                batch = self._hedge(run, member)
            if batch is None:
                await run.wait_for_change(1.0)
                continue
            await self._run_batch(run, member, batch)

    def _shunned_by(self, member: Member) -> str | None:
        """``member``'s URL if samples that failed there should wait for another member
        (one that takes work now); else None."""
        if not self._state.run or not self._state.run.avoid:
            return None
        now = self._state.clock.now()
        for other in self._state.members.values():
            if other is not member and other.takes_work(now):
                return member.url
        return None

    def _working_slots(self) -> int:
        healthy = sum(m.state is MemberState.HEALTHY for m in self._state.members.values())
        return max(1, healthy) * self._state.config.max_concurrent_batches_per_client

    def _hedge(self, run: Run, member: Member) -> list[int] | None:
        """Samples in flight on the members expected to finish last, not yet hedged."""
        elapsed = max(self._state.clock.now() - run.started, 1e-3)

        def expected_end(other: Member) -> float:
            rate = max(other.completed / elapsed, 1e-3)
            return len(other.in_flight) / rate

        others = [m for m in self._state.members.values() if m is not member and m.in_flight]
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
                    if len(batch) == self._state.config.batch_size:
                        break
            if len(batch) == self._state.config.batch_size:
                break
        if not batch:
            return None
        run.hedged.update(batch)
        member.hedged += len(batch)
        log.debug("samples_hedged", server=member.url, samples=len(batch))
        return batch

    async def _run_batch(self, run: Run, member: Member, batch: list[int]) -> None:
        """Send a batch at once; settle each answer as it arrives; requeue what is left."""
        params = self._state.params_for(member)
        client = member.client
        arrived: asyncio.Queue[asyncio.Task[Response | ProviderError]] = asyncio.Queue()
        tasks: dict[asyncio.Task[Response | ProviderError], int] = {}
        sent_at = self._state.clock.now()
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
                        member.note_arrival(self._state.clock.now())
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
            self._effects.evict(run, member, reason, cause=index)
        elif action is Action.VERIFY:
            if member.state not in (MemberState.HEALTHY, MemberState.DRAINING):
                self._effects.requeue(run, member, index)  # already out; nothing to verify
            else:
                member.suspects.add(index)
                self._state.spawn(self._verify_then_settle(run, member, index, result, sent_at))
        elif action is Action.BACKOFF:
            member.back_off(self._state.clock.now(), retry_delay)
            member.last_error = reason
            run.overloads[index] += 1
            if run.overloads[index] > _MAX_OVERLOAD_REQUEUES:
                self._effects.error_row(run, member, index, result)
            else:
                self._effects.requeue(run, member, index)
        elif action is Action.SERVER_FAULT:
            self._server_fault(run, member, index, result)
        elif action is Action.DISABLE:
            self._effects.requeue(run, member, index)
            self._effects.disable(run, member, reason)
        else:
            self._effects.error_row(run, member, index, result)

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
            if not self._effects.note_eviction(run, member, index):
                self._effects.requeue(run, member, index)
            return
        if not counts:
            self._effects.requeue(run, member, index)
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
            self._state.config.max_sample_retries,
            pool_answered_since=run.answered_since_first_fault(index),
        ):
            self._effects.error_row(run, member, index, error)
        else:
            self._effects.requeue(run, member, index)
        if evicts(streak, self._state.config.max_server_faults):
            broke_on = list(member.fault_samples)
            self._effects.evict(
                run, member, f"{streak} answers in a row were the server's fault; last: {reason}"
            )
            for sample in broke_on:
                self._effects.note_eviction(run, member, sample)

    def _in_flight_elsewhere(self, member: Member, index: int) -> bool:
        return any(
            index in other.in_flight.values()
            for other in self._state.members.values()
            if other is not member
        )

    async def _verify_then_settle(
        self, run: Run, member: Member, index: int, error: ProviderError, sent_at: float
    ) -> None:
        healthy = await self._health.verify(member)
        if not healthy:
            # Counts the eviction for every suspect of this member, this one included.
            self._effects.evict(run, member, f"{error} and then failed a health check")
            member.suspects.discard(index)
            self._effects.requeue(run, member, index)
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
                member.drop_counted_at = self._state.clock.now()
            self._server_fault(run, member, index, error, counts=fresh)
            return
        # A connect timeout on a healthy server: try again, a bounded number of times,
        # so a sample that always breaks its connection ends.
        run.retries[index] += 1
        if run.retries[index] > self._state.config.max_sample_retries:
            self._effects.error_row(run, member, index, error)
        else:
            self._effects.requeue(run, member, index)


def _timed_out(outcome: Response | ProviderError) -> bool:
    return isinstance(outcome, ProviderError) and outcome.kind is ErrorKind.READ_TIMEOUT
