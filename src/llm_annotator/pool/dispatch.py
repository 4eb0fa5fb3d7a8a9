"""Dispatch: the members' batch slots, settling each answer, and the tail."""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import structlog

from llm_annotator.clients.base import Messages
from llm_annotator.clients.retry import retry_delay
from llm_annotator.errors import ErrorKind, ProviderError
from llm_annotator.pool import scheduler
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.health import HealthMonitor
from llm_annotator.pool.member import Member, MemberState
from llm_annotator.pool.pace import tail_share
from llm_annotator.pool.run import Run
from llm_annotator.pool.scheduler import Effect, Failure, Holder, Limits
from llm_annotator.pool.stall import StallWatch
from llm_annotator.pool.state import PoolState
from llm_annotator.pool.window import WindowTuner
from llm_annotator.response import Response

log = structlog.get_logger(__name__)

HEDGE_ROOM = 8
"""Room a slot needs before it hedges while it still holds requests (a hedge walks
what the other members hold, so it is worth doing for several samples at once)."""

PACE_EVERY = 0.05
"""Seconds between two reads of the members' paces for the end-of-call shares."""
SHARE_WAIT = 0.1
"""Seconds an idle slot whose member's share of the end of a call is full waits
before it looks again."""

BURST = 32
"""Requests a slot sends at a time before it lets the event loop run: at the start
every member gets work at once instead of one member's whole batches first."""


class Dispatcher:
    """Members' batch slots: take a batch, send it, settle every answer."""

    def __init__(
        self, state: PoolState, effects: Effects, health: HealthMonitor, stall: StallWatch
    ) -> None:
        self._state = state
        self._effects = effects
        self._health = health
        self._stall = stall
        self._windows = WindowTuner(state)
        self._paces_at = float("-inf")
        self._paces_now: dict[Member, float] = {}
        self._total_pace = 0.0
        config = state.config
        self._limits = Limits(
            max_sample_retries=config.max_sample_retries,
            max_server_faults=config.max_server_faults,
        )

    def attach(self, run: Run, member: Member) -> None:
        """Start a member's probe loop and batch slots for this call."""
        if member.state is MemberState.DISABLED:
            return
        self._state.spawn(self._health.probe_loop(run, member))
        self._state.spawn(self._stall.watch(run, member))
        self._windows.start(member)
        self._paces_at = float("-inf")  # a new call: read its paces afresh
        self._state.spawn(self._windows.watch(run, member))
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
            self._windows.restart_if_back(member)
            limit = self._room(run, member, 0)
            if limit <= 0:
                # Its window is full (a change wakes it), or its share of the end is
                # (that moves with the others' answers: look again soon).
                share_full = member.window > len(member.in_flight)
                await run.wait_for_change(SHARE_WAIT if share_full else 1.0)
                continue
            batch = run.take(1, self._shunned_by(member), limit=limit)
            hedges = False
            if batch is None and self._hedges_now(run):
                batch = self._hedge(run, member, limit)
                hedges = True
            if batch is None:
                await run.wait_for_change(1.0)
                continue
            await self._run_batch(run, member, batch, hedges=hedges)

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

    def _hedge(self, run: Run, member: Member, limit: int) -> list[int] | None:
        """Up to ``limit`` samples in flight on the members expected to finish last, not
        yet hedged (the last sent first: a server's line serves them last)."""
        others = [m for m in self._state.members.values() if m is not member and m.in_flight]
        holders = [Holder(m.completed, list(m.in_flight.values())) for m in others]
        failed_here = {i for i, url in run.avoid.items() if url == member.url}
        batch = scheduler.pick_hedges(
            holders,
            elapsed=self._state.clock.now() - run.started,
            limit=limit,
            skip=_Skip(run, failed_here),
        )
        if not batch:
            return None
        run.hedged.update(batch)
        picked = set(batch)  # the first answer cancels the other copy
        for other in others:
            for task, index in other.in_flight.items():
                if index in picked:
                    run.copies.setdefault(index, []).append(task)
        log.debug("samples_hedged", server=member.url, samples=len(batch))
        return batch

    async def _run_batch(
        self, run: Run, member: Member, batch: list[int], *, hedges: bool = False
    ) -> None:
        """Send ``batch`` (hedges, if ``hedges``) and settle each answer as it arrives;
        keep up to ``batch_size`` requests in flight by taking more work as answers
        arrive (in bursts of :data:`BURST`), until there is none; requeue what is
        left."""
        params = self._state.params_for(member)
        client = member.client
        clock = self._state.clock
        copies = run.copies
        arrived: asyncio.Queue[asyncio.Task[Response | ProviderError]] = asyncio.Queue()
        """The slot's finished requests, in the order they finished."""
        waiting: dict[asyncio.Task[Response | ProviderError], tuple[int, float]] = {}
        """The slot's requests not settled yet: sample and when it was sent."""
        cut: list[int] = []
        """Samples whose request was cancelled (an eviction, a hedged copy answered)."""

        def send(indices: list[int], hedges: bool) -> None:
            sent_at = clock.now()
            member.note_sent(sent_at)
            for index in indices:
                messages = run.open[index]
                request = (
                    _hedge_copy(member, messages, params)
                    if hedges
                    else client.asend(messages, params)
                )
                task = asyncio.ensure_future(request)
                task.add_done_callback(arrived.put_nowait)  # one callback a task
                waiting[task] = (index, sent_at)
                member.in_flight[task] = index
                if copies and index in copies:
                    copies[index].append(task)

        def settle_arrived() -> None:
            while not arrived.empty():
                self._arrival(run, member, arrived.get_nowait(), waiting, cut)
            if cut:
                self._requeue(run, member, cut)
                cut.clear()

        try:
            send(batch, hedges)
            while True:
                settle_arrived()
                more, hedges = self._refill(run, member, len(waiting))
                if more:
                    send(more, hedges)
                    if len(more) == BURST:
                        await asyncio.sleep(0)  # let other slots send, answers arrive
                    continue
                if not waiting:
                    return
                self._arrival(run, member, await arrived.get(), waiting, cut)
        finally:
            for task, (index, _) in waiting.items():
                if not task.done():
                    task.cancel()
                member.in_flight.pop(task, None)
                cut.append(index)
            if cut and not run.finished:
                self._requeue(run, member, cut)

    def _refill(self, run: Run, member: Member, holding: int) -> tuple[list[int] | None, bool]:
        """More samples for a slot that holds ``holding`` requests (see :meth:`_room`),
        and whether they are hedges: once the queue is empty for good it hedges,
        :data:`HEDGE_ROOM` or more at a time. None if it may not take any now."""
        if run.finished:
            return _NONE
        if not member.takes_work(self._state.clock.now()) or not self._state.is_member(member):
            return _NONE
        room = self._room(run, member, holding)
        if room <= 0:
            return _NONE
        if run.queue:
            return run.take(1, self._shunned_by(member), limit=room), False
        if room < HEDGE_ROOM or not self._hedges_now(run):
            return _NONE
        return self._hedge(run, member, room), True

    def _room(self, run: Run, member: Member, holding: int) -> int:
        """How many more requests a slot of ``member`` that holds ``holding`` may send
        now: up to ``batch_size`` in the slot, within the member's window,
        :data:`BURST` at a time, and once the source is done within the member's share
        of what is left (:meth:`_share_room`)."""
        room = min(
            self._state.config.batch_size - holding, BURST, member.window - len(member.in_flight)
        )
        if room > 0 and run.source_done:
            room = min(room, self._share_room(run, member, holding))
        return room

    def _share_room(self, run: Run, member: Member, holding: int) -> int:
        """Room left in ``member``'s share of the end of the call.

        Once the source is done, a member holds no more than its part of what is
        queued or in flight, in proportion to its pace (:func:`tail_share`), so
        that a slow server does not end the call alone on a long line of requests the
        others could have answered. While some member that takes work has no known
        pace yet, a slot holds no more than an even share of the queue over the
        working slots instead. With the queue empty, hedges are bounded by the batch
        and the window only.
        """
        if not run.queue:
            return BURST  # hedges: within the batch and the window only
        paces = self._paces()
        rate = paces.get(member)
        if rate is not None:
            remaining = len(run.queue) + sum(len(m.in_flight) for m in paces)
            return tail_share(remaining, rate, self._total_pace) - len(member.in_flight)
        share = -(-(len(run.queue) + holding) // self._working_slots())
        return share - holding

    def _paces(self) -> dict[Member, float]:
        """The working members' paces, if every one is known (else empty), and their sum
        in ``_total_pace``; read at most every :data:`PACE_EVERY` seconds."""
        now = self._state.clock.now()
        if now - self._paces_at >= PACE_EVERY:
            self._paces_at = now
            working = [m for m in self._state.members.values() if m.takes_work(now)]
            rates = {m: m.pace.rate(now) for m in working}
            known = {m: r for m, r in rates.items() if r is not None and r > 0}
            self._paces_now = known if len(known) == len(rates) else {}
            self._total_pace = sum(self._paces_now.values())
        return self._paces_now

    def _hedges_now(self, run: Run) -> bool:
        """Whether idle room goes to hedges: the queue is empty for good."""
        return (
            self._state.config.hedge_tail and run.source_done and not run.queue and not run.stopping
        )

    def _arrival(
        self,
        run: Run,
        member: Member,
        task: asyncio.Task[Response | ProviderError],
        waiting: dict[asyncio.Task[Response | ProviderError], tuple[int, float]],
        cut: list[int],
    ) -> None:
        """Settle one finished request of a slot (a cancelled one goes to ``cut``)."""
        index, sent_at = waiting.pop(task)
        member.in_flight.pop(task, None)
        if task.cancelled():
            cut.append(index)
            return
        outcome = self._outcome(task, member)
        if not _timed_out(outcome):  # an answer: the member is not hung
            now = self._state.clock.now()
            member.note_arrival(now)
            if isinstance(outcome, Response):  # errors say nothing of its pace
                member.pace.note(now)
                if self._windows.answered(member):
                    run.notify()  # its idle slots may take work now
        self._settle(run, member, index, outcome, sent_at)

    @staticmethod
    def _requeue(run: Run, member: Member, indices: list[int]) -> None:
        """Put a slot's samples whose requests were cut back on the queue (open ones)."""
        moved = run.requeue(indices)
        member.requeued += moved
        if moved:
            log.info("samples_requeued", server=member.url, samples=moved)

    @staticmethod
    def _outcome(
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

    def _settle(
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
        failure = self._failure(run, member, index, result.kind, sent_at)
        effects = scheduler.settle(failure, self._limits)
        self._carry_out(effects, run, member, index, result, sent_at, str(result))

    def _failure(
        self, run: Run, member: Member, index: int, kind: ErrorKind, sent_at: float
    ) -> Failure:
        """What is known of ``member`` and sample ``index`` when its request failed."""
        first_fault = run.first_fault_at.get(index, self._state.clock.now())
        return Failure(
            kind=kind,
            member_working=member.state in (MemberState.HEALTHY, MemberState.DRAINING),
            answered_since_sent=member.last_answer_at > sent_at,
            overloads=run.overloads[index] + 1,
            retries=run.retries[index] + 1,
            sample_faults=run.faults[index] + 1,
            pool_answered_since_first_fault=run.last_success_at > first_fault,
            fault_streak=member.streak_with(index),
            hedged_copy_in_flight=index in run.hedged and self._in_flight_elsewhere(member, index),
            fresh_drop=sent_at > member.drop_counted_at,
            still_open=run.is_open(index),
        )

    def _carry_out(
        self,
        effects: tuple[Effect, ...],
        run: Run,
        member: Member,
        index: int,
        error: ProviderError,
        sent_at: float,
        reason: str,
    ) -> None:
        """Do what the scheduler decided, in its order."""
        do = self._effects
        for effect in effects:
            if effect is Effect.BLAME:
                member.last_error = str(error)
            elif effect is Effect.REQUEUE:
                do.requeue(run, member, index)
            elif effect is Effect.ERROR_ROW:
                do.error_row(run, member, index, error)
            elif effect is Effect.EVICT:
                do.evict(run, member, reason, cause=index)
            elif effect is Effect.DISABLE:
                do.disable(run, member, reason)
            elif effect is Effect.VERIFY:
                member.suspects.add(index)
                held = _Held(run, member, index, error, sent_at, member.evictions)
                self._state.spawn(self._verify_then_settle(held))
            elif effect is Effect.BACK_OFF:
                member.back_off(self._state.clock.now(), retry_delay)
                member.last_error = reason
                run.overloads[index] += 1
            elif effect is Effect.COUNT_SAMPLE_FAULT:
                run.note_fault(index, member.url)
            elif effect is Effect.COUNT_FAULT:
                streak = member.note_fault(index)
                log.debug(
                    "server_fault",
                    server=member.url,
                    kind=error.kind.value,
                    streak=streak,
                    sample_faults=run.faults[index],
                )
            elif effect is Effect.EVICT_FOR_FAULTS:
                broke_on = list(member.fault_samples)
                do.evict(
                    run,
                    member,
                    f"{member.fault_streak} answers in a row were the server's fault; "
                    f"last: {error}",
                )
                for sample in broke_on:
                    do.note_eviction(run, member, sample)
            elif effect is Effect.COUNT_EVICTION:
                do.note_eviction_or_requeue(run, member, index)
            elif effect is Effect.COUNT_DROP:
                member.drop_counted_at = self._state.clock.now()
            elif effect is Effect.COUNT_RETRY:
                run.retries[index] += 1
            elif effect is Effect.PROVE:
                member.suspects.add(index)
                held = _Held(run, member, index, error, sent_at, member.evictions)
                self._state.spawn(self._prove_then_settle(held))

    def _in_flight_elsewhere(self, member: Member, index: int) -> bool:
        return any(
            index in other.in_flight.values()
            for other in self._state.members.values()
            if other is not member
        )

    async def _verify_then_settle(self, held: _Held) -> None:
        """Wait for the member's shared health check, then settle the held sample."""
        run, member, index, error, sent_at, evictions = held
        healthy = await self._health.verify(member)
        member.suspects.discard(index)
        if self._evicted_since(run, member, index, evictions):
            return
        failure = self._failure(run, member, index, error.kind, sent_at)
        effects = scheduler.after_check(failure, healthy, self._limits)
        reason = f"{error} and then failed a health check"
        self._carry_out(effects, run, member, index, error, sent_at, reason)

    async def _prove_then_settle(self, held: _Held) -> None:
        """Wait for the member's shared test completion, then settle the held sample
        (if the member was evicted since, it is sent again without a test)."""
        run, member, index, error, sent_at, evictions = held
        if self._evicted_since(run, member, index, evictions):
            member.suspects.discard(index)
            return
        problem = await self._health.prove(member)
        member.suspects.discard(index)
        if self._evicted_since(run, member, index, evictions):
            return
        log.info(
            "sample_doubted",
            server=member.url,
            error=str(error),
            test_completion="ok" if problem is None else str(problem),
        )
        if problem is None:
            run.last_success_at = self._state.clock.now()  # a server answers: not a storm
            member.end_fault_streak()  # and this one works
        failure = self._failure(run, member, index, error.kind, sent_at)
        effects = scheduler.after_proof(failure, works=problem is None)
        reason = f"{error}, and then its test completion failed: {problem}"
        self._carry_out(effects, run, member, index, error, sent_at, reason)

    def _evicted_since(self, run: Run, member: Member, index: int, evictions: int) -> bool:
        """Whether ``member`` was evicted while sample ``index`` waited for a check that
        began at its ``evictions``-th eviction: that eviction counted the sample as on
        it, so the check's answer is stale (the member may even have rejoined since) and
        the sample goes back on the queue."""
        if member.evictions == evictions:
            return False
        log.debug("check_outlived", server=member.url, sample=index)
        self._effects.requeue(run, member, index)
        return True


class _Held(NamedTuple):
    """A sample held for a check of its member: what its failure was, and the member's
    number of evictions when it was held (a check that outlives one is stale)."""

    run: Run
    member: Member
    sample: int
    error: ProviderError
    sent_at: float
    evictions: int


_NONE: tuple[None, bool] = (None, False)
"""No more work for a slot."""


async def _hedge_copy(
    member: Member, messages: Messages, params: bytes
) -> Response | ProviderError:
    """A hedge request: counted in ``member.hedged`` once it starts, that is when it is
    handed to the client (a copy cancelled before, because the first answer came in
    meanwhile, never reached a server and is no duplicate)."""
    member.hedged += 1
    return await member.client.asend(messages, params)


def _timed_out(outcome: Response | ProviderError) -> bool:
    return isinstance(outcome, ProviderError) and outcome.kind is ErrorKind.READ_TIMEOUT


class _Skip:
    """The samples an idle member must not hedge: closed, hedged already, on an evicted
    member before, or failed on that member (a view, nothing is copied)."""

    __slots__ = ("_failed_here", "_run")

    def __init__(self, run: Run, failed_here: set[int]) -> None:
        self._run = run
        self._failed_here = failed_here

    def __contains__(self, index: object) -> bool:
        run = self._run
        return (
            index not in run.open
            or index in run.hedged
            or index in run.evicted_with
            or index in self._failed_here
        )
