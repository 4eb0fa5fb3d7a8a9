"""Dispatch: the members' batch slots, their room, and the tail (each answer is settled
by :mod:`~llm_annotator.pool.settle`)."""

from __future__ import annotations

import asyncio

import structlog

from llm_annotator.clients.base import Messages
from llm_annotator.errors import ErrorKind, ProviderError
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.health import HealthMonitor
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member
from llm_annotator.pool.run import Run
from llm_annotator.pool.settle import Settler
from llm_annotator.pool.stall import StallWatch
from llm_annotator.pool.state import PoolState
from llm_annotator.pool.tail import Holder, pick_hedges, tail_share
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

WARM_WAIT = 10.0
"""Seconds a member's batch slots wait for its warm-up answer before they send anyway."""

BURST = 32
"""Requests a slot sends at a time before it lets the event loop run: at the start
every member gets work at once instead of one member's whole batches first."""


class Dispatcher:
    """Members' batch slots: take a batch, send it, settle every answer."""

    def __init__(
        self, state: PoolState, effects: Effects, health: HealthMonitor, stall: StallWatch
    ) -> None:
        self._state = state
        self._health = health
        self._stall = stall
        self._settler = Settler(state, effects, health)
        self._windows = WindowTuner(state)
        self._paces_at = float("-inf")
        self._paces_now: dict[Member, float] = {}
        self._total_pace = 0.0
        self._released: set[Member] = set()
        """Members whose queued groups went back to the queue when they stopped taking
        work (see :meth:`_release`)."""
        self._warming: dict[Member, tuple[asyncio.Future[None], float]] = {}
        """Each member's warm-up request of the current call, and when it was sent."""

    def attach(self, run: Run, member: Member) -> None:
        """Start a member's probe loop and batch slots for this call."""
        if member.state is MemberState.DISABLED:
            return
        self._state.spawn(self._health.probe_loop(run, member))
        self._state.spawn(self._stall.watch(run, member))
        self._windows.start(member)
        self._warming.pop(member, None)
        self._released.discard(member)
        self._paces_at = float("-inf")  # a new call: read its paces afresh
        self._state.spawn(self._windows.watch(run, member))
        for rank in range(self._state.config.max_concurrent_batches_per_client):
            self._state.spawn(self._slot(run, member, rank))

    def reshare(self) -> None:
        """Apply a new number of processes sharing the servers to every member's window
        (see :meth:`~llm_annotator.pool.window.WindowTuner.reshare`)."""
        self._windows.reshare()
        if self._state.run is not None:
            self._state.run.notify()  # a window that may grow again wakes idle slots

    @property
    def ceiling(self) -> int:
        """The most one member may hold now (this process's share of its budget)."""
        return self._windows.ceiling

    # -- work --------------------------------------------------------------------------

    async def _slot(self, run: Run, member: Member, rank: int) -> None:
        """One of a member's batch slots: take a batch whenever the member can work.

        Woken by new work, a member's slot of ``rank`` k lets the event loop run k times
        before it takes any, so that the first slots of all members take theirs before
        the second slots do: rows that come in a few at a time (the first units of a
        corpus) start on every server at once, instead of filling the first servers'
        every slot while the last ones wait (see :data:`BURST` for the same within a
        batch). It does so only at the start of a call (before its first answer: later,
        a slot refills itself as its answers come) and while the queue is short (less
        than a batch a member: with more, every slot finds work anyway), so that many
        servers' slots woken by every change cost no more than they did."""
        while not run.finished:
            if rank and not run.delivered and len(run.queue) < self._short_queue():
                for _ in range(rank):
                    await asyncio.sleep(0)
                if run.finished:  # it may have ended meanwhile
                    return  # type: ignore[unreachable]
            if member.state is MemberState.DISABLED or not self._state.is_member(member):
                self._release(run, member)
                return
            if member.state is MemberState.DRAINING:
                self._release(run, member)
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
                if not backing_off:
                    self._release(run, member)
                wait = member.faults.backoff_until - now if backing_off else 1.0
                await run.wait_for_change(min(max(wait, 0.05), 1.0))
                continue
            self._released.discard(member)
            if run.warmup is not None and not await self._warm(run, member):
                continue
            self._windows.restart_if_back(member)
            limit = self._room(run, member, 0)
            if limit <= 0:
                # Its window is full (a change wakes it), or its share of the end is
                # (that moves with the others' answers: look again soon).
                share_full = member.window.room(len(member.in_flight)) > 0
                await run.wait_for_change(SHARE_WAIT if share_full else 1.0)
                continue
            batch = run.take(1, self._shunned_by(member), limit=limit, member=member.url)
            hedges = False
            if batch is None and self._hedges_now(run):
                batch = self._hedge(run, member, limit)
                hedges = True
            if batch is None:
                await run.wait_for_change(1.0)
                continue
            await self._run_batch(run, member, batch, hedges=hedges)

    def _short_queue(self) -> int:
        """Fewer samples queued than this: not every member's slot finds a batch."""
        return self._state.config.batch_size * len(self._state.members)

    def working(self) -> int:
        """Members taking work now (at least one)."""
        now = self._state.clock.now()
        return max(1, sum(m.takes_work(now) for m in self._state.members.values()))

    def _release(self, run: Run, member: Member) -> None:
        """``member`` stopped taking work: the groups queued for it go to the others."""
        if member not in self._released:
            self._released.add(member)
            warming, _ = self._warming.pop(member, (None, 0.0))  # back later: warm again
            if warming is not None:
                warming.cancel()
            held = run.queue.held().get(member.url, 0)
            run.queue.release(member.url)  # and forget the groups it was home to
            if held:
                run.notify()
                log.debug("groups_released", server=member.url, samples=held)

    async def _warm(self, run: Run, member: Member) -> bool:
        """Send ``run.warmup`` to ``member`` once before its first sample (its batch
        slots wait for the one request); True once done, answered or not (a failed
        warm-up costs only the cache it would have filled), or after
        :data:`WARM_WAIT` seconds (a hung server is the stall watch's to find)."""
        now = self._state.clock.now()
        warming, since = self._warming.get(member, (None, now))
        if warming is None:
            warming = self._state.spawn(self._warm_up(run, member))
            self._warming[member] = (warming, now)
        if warming.done() or now - since >= WARM_WAIT:
            return True
        await run.wait_for_change(min(1.0, since + WARM_WAIT - now))
        return warming.done()

    async def _warm_up(self, run: Run, member: Member) -> None:
        assert run.warmup is not None
        state = self._state
        options, gen_kwargs = state.options
        one_token = {
            **(gen_kwargs or {}),
            "max_tokens": 1,
            "max_completion_tokens": 1,
            "min_tokens": 0,
        }
        started = state.clock.now()
        try:
            params = member.client.encode_params(options, one_token)
            outcome = await member.client.asend(run.warmup, params)
        except Exception as exc:  # a warm-up is a favour: it never ends the call
            log.warning("server_warm_up_failed", server=member.url, error=repr(exc))
            return
        finally:
            run.notify()
        ok = isinstance(outcome, Response) and outcome.ok
        log.debug(
            "server_warmed",
            server=member.url,
            ok=ok,
            error=None if ok else str(getattr(outcome, "error", outcome)),
            seconds=round(state.clock.now() - started, 3),
        )

    def _shunned_by(self, member: Member) -> str | None:
        """``member``'s URL if samples that failed there should wait for another member
        (one that takes work now); else None."""
        if not self._state.run or not self._state.run.avoiding:
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
        batch = pick_hedges(
            holders,
            elapsed=self._state.clock.now() - run.started,
            limit=limit,
            skip=_Skip(run, member.url),
        )
        if not batch:
            return None
        copies: dict[int, list[asyncio.Task[Response | ProviderError]]] = {}
        for index in batch:
            sample = run.open[index]
            sample.hedged = True
            sample.copies = copies[index] = []
        for other in others:  # the first answer cancels the other copy
            for task, index in other.in_flight.items():
                if index in copies:
                    copies[index].append(task)
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
                sample = run.open[index]
                request = (
                    _hedge_copy(member, sample.messages, params)
                    if hedges
                    else client.asend(sample.messages, params)
                )
                task = asyncio.ensure_future(request)
                task.add_done_callback(arrived.put_nowait)  # one callback a task
                waiting[task] = (index, sent_at)
                member.in_flight[task] = index
                if sample.copies is not None:
                    sample.copies.append(task)

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
            if member.state is not MemberState.HEALTHY or not self._state.is_member(member):
                self._release(run, member)  # its slots may hold requests for a while
            return _NONE
        room = self._room(run, member, holding)
        if room <= 0:
            return _NONE
        if run.queue:
            return run.take(1, self._shunned_by(member), limit=room, member=member.url), False
        if room < HEDGE_ROOM or not self._hedges_now(run):
            return _NONE
        return self._hedge(run, member, room), True

    def _room(self, run: Run, member: Member, holding: int) -> int:
        """How many more requests a slot of ``member`` that holds ``holding`` may send
        now: up to ``batch_size`` in the slot, within the member's window,
        :data:`BURST` at a time, and once the source is done within the member's share
        of what is left (:meth:`_share_room`)."""
        room = min(
            self._state.config.batch_size - holding,
            BURST,
            member.window.room(len(member.in_flight)),
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
            rates = {m: m.window.pace.rate(now) for m in working}
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
        outcome = self._settler.outcome(task, member)
        if not _timed_out(outcome):  # an answer: the member is not hung
            now = self._state.clock.now()
            member.note_arrival(now)
            if isinstance(outcome, Response):  # errors say nothing of its pace
                member.window.pace.note(now)
                if self._windows.answered(member):
                    run.notify()  # its idle slots may take work now
        self._settler.settle(run, member, index, outcome, sent_at)

    @staticmethod
    def _requeue(run: Run, member: Member, indices: list[int]) -> None:
        """Put a slot's samples whose requests were cut back on the queue (open ones)."""
        moved = run.requeue(indices)
        member.requeued += moved
        if moved:
            log.info("samples_requeued", server=member.url, samples=moved)


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

    __slots__ = ("_open", "_url")

    def __init__(self, run: Run, url: str) -> None:
        self._open = run.open
        self._url = url

    def __contains__(self, index: object) -> bool:
        sample = self._open.get(index)  # type: ignore[call-overload]
        return (
            sample is None
            or sample.hedged
            or sample.evicted_with is not None
            or sample.avoid == self._url
        )
