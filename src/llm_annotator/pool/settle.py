"""Settling an answer: what one finished request means for its sample and its member.

A :class:`~llm_annotator.response.Response` is stored. A failure is described as a
:class:`~llm_annotator.pool.failures.Failure` (facts only), the pure functions of
:mod:`~llm_annotator.pool.failures` decide the steps (:class:`Effect`), and this
module carries them out, in their order, each step in one small method: the one place
where the pool's decisions about a failure become changes of state. A step that needs
to know more first (a health check of the member, a test completion) holds the sample
and settles it again when the answer comes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

import structlog

from llm_annotator.clients.retry import retry_delay
from llm_annotator.errors import ErrorKind, ProviderError
from llm_annotator.pool import failures
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.failures import Effect, Failure, Limits
from llm_annotator.pool.health import HealthMonitor
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member
from llm_annotator.pool.run import Run, SampleState
from llm_annotator.pool.state import PoolState
from llm_annotator.response import Response

log = structlog.get_logger(__name__)


class Settler:
    """Settles each finished request of the members' slots."""

    def __init__(self, state: PoolState, effects: Effects, health: HealthMonitor) -> None:
        self._state = state
        self._effects = effects
        self._health = health
        config = state.config
        self._limits = Limits(
            max_sample_retries=config.max_sample_retries,
            max_server_faults=config.max_server_faults,
        )
        self._steps: dict[Effect, Callable[[_Failed], None]] = {
            Effect.BLAME: self._blame,
            Effect.REQUEUE: self._requeue,
            Effect.ERROR_ROW: self._error_row,
            Effect.EVICT: self._evict,
            Effect.DISABLE: self._disable,
            Effect.VERIFY: self._verify,
            Effect.BACK_OFF: self._back_off,
            Effect.COUNT_SAMPLE_FAULT: self._count_sample_fault,
            Effect.COUNT_FAULT: self._count_fault,
            Effect.EVICT_FOR_FAULTS: self._evict_for_faults,
            Effect.COUNT_EVICTION: self._count_eviction,
            Effect.COUNT_DROP: self._count_drop,
            Effect.COUNT_RETRY: self._count_retry,
            Effect.PROVE: self._prove,
        }

    def settle(
        self,
        run: Run,
        member: Member,
        index: int,
        result: Response | ProviderError,
        sent_at: float = float("inf"),
    ) -> None:
        """Decide what one answer means for its sample and its member (its request was
        sent at ``sent_at``), and carry it out."""
        if isinstance(result, Response):
            if run.store(index, result):
                member.completed += 1
            member.note_answer()
            return
        failed = _Failed(run, member, index, result, sent_at, str(result))
        self._carry_out(failures.settle(self._failure(failed), self._limits), failed)

    @staticmethod
    def outcome(
        task: asyncio.Task[Response | ProviderError], member: Member
    ) -> Response | ProviderError:
        """The task's result; an unexpected exception (a bug, not a server's answer) is
        logged with its traceback and becomes an error row, so that no sample is lost
        to it and the bug is seen."""
        error = task.exception()
        if error is None:
            return task.result()
        log.error(
            "client_raised",
            server=member.url,
            error=f"{type(error).__name__}: {error}",
            exc_info=error,
        )
        unexpected = ProviderError(
            f"unexpected {type(error).__name__} in the client: {error}",
            kind=ErrorKind.HTTP_ERROR,
            server=member.url,
        )
        return member.client.redact(unexpected)

    def _failure(self, failed: _Failed) -> Failure:
        """What is known of the member and the sample when its request failed."""
        run, member, index = failed.run, failed.member, failed.sample
        sent_at = failed.sent_at
        sample = run.open.get(index)
        known = SampleState(messages=[]) if sample is None else sample  # closed: nothing
        first_fault = known.first_fault_at
        if first_fault is None:
            first_fault = self._state.clock.now()
        return Failure(
            kind=failed.error.kind,
            member_working=member.state in (MemberState.HEALTHY, MemberState.DRAINING),
            answered_since_sent=member.stall.last_answer_at > sent_at,
            overloads=known.overloads + 1,
            retries=known.retries + 1,
            sample_faults=known.faults + 1,
            pool_answered_since_first_fault=run.last_success_at > first_fault,
            fault_streak=member.faults.streak_with(index),
            hedged_copy_in_flight=known.hedged and self._in_flight_elsewhere(member, index),
            fresh_drop=sent_at > member.faults.drop_counted_at,
            still_open=sample is not None,
        )

    def _carry_out(self, effects: tuple[Effect, ...], failed: _Failed) -> None:
        """Do what the failure rules decided, in its order."""
        for effect in effects:
            self._steps[effect](failed)

    # -- the steps, one each -------------------------------------------------------------

    def _blame(self, failed: _Failed) -> None:
        failed.member.note_error(str(failed.error))

    def _requeue(self, failed: _Failed) -> None:
        self._effects.requeue(failed.run, failed.member, failed.sample)

    def _error_row(self, failed: _Failed) -> None:
        self._effects.error_row(failed.run, failed.member, failed.sample, failed.error)

    def _evict(self, failed: _Failed) -> None:
        self._effects.evict(failed.run, failed.member, failed.reason, cause=failed.sample)

    def _disable(self, failed: _Failed) -> None:
        self._effects.disable(failed.run, failed.member, failed.reason)

    def _back_off(self, failed: _Failed) -> None:
        member = failed.member
        member.faults.back_off(self._state.clock.now(), retry_delay)
        member.note_error(failed.reason)
        sample = failed.run.open.get(failed.sample)
        if sample is not None:
            sample.overloads += 1

    def _count_sample_fault(self, failed: _Failed) -> None:
        failed.run.note_fault(failed.sample, failed.member.url)

    def _count_fault(self, failed: _Failed) -> None:
        member = failed.member
        streak = member.faults.note_fault(failed.sample)
        sample = failed.run.open.get(failed.sample)
        log.debug(
            "server_fault",
            server=member.url,
            kind=failed.error.kind.value,
            streak=streak,
            sample_faults=0 if sample is None else sample.faults,
        )

    def _evict_for_faults(self, failed: _Failed) -> None:
        run, member = failed.run, failed.member
        faults = member.faults
        broke_on = list(faults.fault_samples)
        self._effects.evict(
            run,
            member,
            f"{faults.fault_streak} answers in a row were the server's fault; last: {failed.error}",
        )
        for sample in broke_on:
            self._effects.note_eviction(run, member, sample)

    def _count_eviction(self, failed: _Failed) -> None:
        self._effects.note_eviction_or_requeue(failed.run, failed.member, failed.sample)

    def _count_drop(self, failed: _Failed) -> None:
        failed.member.faults.count_drop(self._state.clock.now())

    def _count_retry(self, failed: _Failed) -> None:
        sample = failed.run.open.get(failed.sample)
        if sample is not None:
            sample.retries += 1

    def _verify(self, failed: _Failed) -> None:
        failed.member.suspects.add(failed.sample)
        self._state.spawn(self._verify_then_settle(failed, failed.member.evictions))

    def _prove(self, failed: _Failed) -> None:
        failed.member.suspects.add(failed.sample)
        self._state.spawn(self._prove_then_settle(failed, failed.member.evictions))

    # -- held for a check ------------------------------------------------------------------

    def _in_flight_elsewhere(self, member: Member, index: int) -> bool:
        return any(
            index in other.in_flight.values()
            for other in self._state.members.values()
            if other is not member
        )

    async def _verify_then_settle(self, failed: _Failed, evictions: int) -> None:
        """Wait for the member's shared health check, then settle the held sample (the
        member had been evicted ``evictions`` times when it was held)."""
        member, index = failed.member, failed.sample
        healthy = await self._health.verify(member)
        member.suspects.discard(index)
        if self._evicted_since(failed, evictions):
            return
        effects = failures.after_check(self._failure(failed), healthy, self._limits)
        reason = f"{failed.error} and then failed a health check"
        self._carry_out(effects, failed._replace(reason=reason))

    async def _prove_then_settle(self, failed: _Failed, evictions: int) -> None:
        """Wait for the member's shared test completion, then settle the held sample
        (if the member was evicted since, it is sent again without a test)."""
        member, index = failed.member, failed.sample
        if self._evicted_since(failed, evictions):
            member.suspects.discard(index)
            return
        problem = await self._health.prove(member)
        member.suspects.discard(index)
        if self._evicted_since(failed, evictions):
            return
        log.info(
            "sample_doubted",
            server=member.url,
            error=str(failed.error),
            test_completion="ok" if problem is None else str(problem),
        )
        if problem is None:
            failed.run.last_success_at = self._state.clock.now()  # a server answers
            member.faults.end_streak()  # and this one works
        effects = failures.after_proof(self._failure(failed), works=problem is None)
        reason = f"{failed.error}, and then its test completion failed: {problem}"
        self._carry_out(effects, failed._replace(reason=reason))

    def _evicted_since(self, failed: _Failed, evictions: int) -> bool:
        """Whether the member was evicted while the sample waited for a check that began
        at its ``evictions``-th eviction: that eviction counted the sample as on it, so
        the check's answer is stale (the member may even have rejoined since) and the
        sample goes back on the queue."""
        member = failed.member
        if member.evictions == evictions:
            return False
        log.debug("check_outlived", server=member.url, sample=failed.sample)
        self._effects.requeue(failed.run, member, failed.sample)
        return True


class _Failed(NamedTuple):
    """One failed request being settled: its sample, where and when it was sent, the
    error, and the reason an eviction or a disabling gives."""

    run: Run
    member: Member
    sample: int
    error: ProviderError
    sent_at: float
    reason: str
