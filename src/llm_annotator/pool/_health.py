"""Health: probes, eviction, re-admission, and the end of a pool with no server left."""

from __future__ import annotations

import asyncio
import math

import structlog

from llm_annotator import _constants as default
from llm_annotator.errors import (
    ErrorKind,
    PoolExhaustedError,
    ProviderError,
    ServersUnusableError,
)
from llm_annotator.pool._core import PoolCore
from llm_annotator.pool.member import Member, MemberState
from llm_annotator.pool.policy import CONFIGURATION_KINDS, hung, probation, stall_window
from llm_annotator.pool.run import Run
from llm_annotator.response import Response

log = structlog.get_logger(__name__)

CANARY_MESSAGES = [{"role": "user", "content": "Say OK."}]
"""The test completion an evicted member must answer before it takes work again."""


class PoolHealth(PoolCore):
    """Which members may take work, and what happens to a member that fails."""

    # -- health ------------------------------------------------------------------------

    async def _probe_loop(self, run: Run, member: Member) -> None:
        while not run.finished and member.state not in (MemberState.DISABLED,):
            if self._members.get(member.url) is not member:
                return
            started = self._clock.now()
            if (
                member.state is MemberState.EVICTED
                and started < member.probation_until
                and any(m.state is MemberState.HEALTHY for m in self._members.values())
            ):
                # With no member left healthy, waiting out a probation helps nobody.
                await self._clock.sleep(min(member.probation_until - started, 1.0))
                continue
            evictions = member.evictions
            problem = await member.client.acheck_health(self.config.health_check_timeout)
            joining = member.state is MemberState.JOINING
            if joining and problem is not None and problem.kind in CONFIGURATION_KINDS:
                # Never admitted, and a TLS failure, a redirect or a refused key will
                # not heal by waiting. (Once a member has worked, such an answer is one
                # failed probe: an ingress being reloaded says 404 for a moment.)
                self._disable(run, member, f"GET /health: {problem}")
                return
            if problem is not None and not member.last_error:
                member.last_error = f"GET /health: {problem}"
            if member.evictions == evictions:  # else the answer predates the eviction
                await self._after_probe(run, member, problem is None)
            pause = self.config.health_check_interval - (self._clock.now() - started)
            if pause > 0:
                await self._clock.sleep(pause)

    async def _after_probe(self, run: Run, member: Member, healthy: bool) -> None:
        if self._members.get(member.url) is not member:
            return  # removed while the probe ran
        state = member.state
        if state is MemberState.HEALTHY:
            failed = member.note_probe(healthy)
            if failed >= self.config.max_failed_health_checks:
                self._evict(
                    run,
                    member,
                    f"no answer to {failed} health checks in a row "
                    f"({self.config.health_check_timeout:g} s each)",
                )
        elif state in (MemberState.JOINING, MemberState.EVICTED):
            if healthy:
                await self._admit(run, member)
            elif state is MemberState.JOINING:
                member.mark_down("no answer to GET /health")
                log.warning("member_down", server=member.url)
                run.notify()

    async def _admit(self, run: Run, member: Member) -> None:
        """Check the model of a member that answers /health, then let it take work."""
        try:
            models = await member.client.alist_models()
        except ProviderError as exc:
            member.last_error = str(exc)
            if exc.kind in CONFIGURATION_KINDS:
                self._disable(run, member, f"GET /v1/models: {exc}")
            return
        wanted = member.client.model
        if wanted is None:
            if not models:
                self._disable(run, member, "lists no model on /v1/models")
                return
            member.client.model = models[0]
        elif wanted not in models:
            self._disable(
                run, member, f"does not serve model {wanted!r} (it serves {', '.join(models)})"
            )
            return
        if member.state not in (MemberState.JOINING, MemberState.EVICTED):
            return  # disabled or drained while /v1/models was asked
        if member.evictions > 0:
            # /health says 200 for a hung engine or a server answering garbage: only
            # a real completion proves the member fit again.
            problem = await self._canary(member)
            if member.state not in (MemberState.JOINING, MemberState.EVICTED):
                return  # disabled or drained meanwhile
            if problem is not None:
                member.failed_canaries += 1
                member.last_error = f"test completion failed: {problem}"
                member.probation_until = self._clock.now() + self._probation(member)
                log.info("canary_failed", server=member.url, reason=str(problem))
                if problem.kind in CONFIGURATION_KINDS:
                    self._disable(run, member, f"test completion: {problem}")
                return
            run.last_success_at = self._clock.now()  # a server answers: not a storm
        if self._members.get(member.url) is not member:
            return  # removed meanwhile
        if member.admit():
            log.info("member_readmitted", server=member.url, model=member.client.model)
        else:
            log.info("member_joined", server=member.url, model=member.client.model)
        run.notify()

    async def _canary(self, member: Member) -> ProviderError | None:
        """Send the one-token test completion; None if it succeeded, else what failed."""
        client = member.client
        params = client.encode_params(None, {"max_tokens": 1})
        try:
            async with asyncio.timeout(default.CANARY_TIMEOUT):
                result = await client.asend(CANARY_MESSAGES, params)
        except TimeoutError:
            return ProviderError(
                f"no answer within {default.CANARY_TIMEOUT:g} s",
                kind=ErrorKind.READ_TIMEOUT,
                server=member.url,
            )
        return result if isinstance(result, ProviderError) else None

    def _probation(self, member: Member) -> float:
        """The wait before the member's next test completion: doubling with evictions in
        a row (a member that served well since counts afresh) and failed tests, and at
        most a quarter of ``all_down_timeout``, so a pool is never given up on while a
        member that healed still waits out its probation."""
        cap = min(default.MAX_PROBATION, self.config.all_down_timeout / 4)
        return probation(
            member.eviction_streak,
            member.failed_canaries,
            self.config.health_check_interval,
            max(cap, self.config.health_check_interval),
        )

    async def _watch_progress(self, run: Run, member: Member) -> None:
        """Evict a member that holds requests and answers none for its stall window,
        unless its engine's own counters show it working."""
        member.new_call()
        while not run.finished:
            if self._members.get(member.url) is not member:
                return
            if member.state is MemberState.DISABLED:
                return
            floor = self.config.stall_window
            if math.isinf(floor):
                await self._clock.sleep(1.0)
                continue
            window, timing_decides = stall_window(
                floor,
                own_gap=member.longest_gap,
                pool_gap=self._pool_gap(member),
                factor=default.STALL_FACTOR,
            )
            quiet = member.quiet_for(self._clock.now())
            due = not member.progress_read or quiet >= window  # the first read, or the last
            if member.state is MemberState.HEALTHY and quiet >= window / 2 and due:
                await self._check_stall(run, member, window, timing_decides)
            await self._clock.sleep(max(0.05, min(1.0, window / 8)))

    async def _check_stall(
        self, run: Run, member: Member, window: float, timing_decides: bool
    ) -> None:
        """Read the member's progress counters at half its stall window, and again once
        the window has passed: then decide (:func:`~llm_annotator.pool.policy.hung`)."""
        epoch = (member.busy_since, member.last_answer_at, member.watch_from)
        progress = await member.client.aengine_progress(self.config.health_check_timeout)
        if epoch != (member.busy_since, member.last_answer_at, member.watch_from):
            return  # an answer came meanwhile
        if not member.in_flight or member.state is not MemberState.HEALTHY:
            return
        if not member.progress_read:
            member.progress_read, member.progress_seen = True, progress
            return
        before = member.progress_seen
        if (before is None) != (progress is None):
            # One of the two reads failed (a busy server may be slow to render its
            # metrics): take this one as the new baseline and look again, rather than
            # letting a single failed read evict a working server.
            member.progress_seen = progress
            member.watch_from = self._clock.now() - window / 2
            return
        quiet = member.quiet_for(self._clock.now())
        verdict = hung(
            quiet,
            window,
            timing_decides=timing_decides,
            progress_before=before,
            progress_now=progress,
        )
        if verdict is None:
            return
        if not verdict:
            log.info(
                "member_busy_not_hung" if progress is not None else "member_quiet_unproven",
                server=member.url,
                quiet_seconds=round(quiet, 1),
                in_flight=len(member.in_flight),
                engine_progress=progress,
            )
            member.watch_from = self._clock.now()  # watch it again from now
            member.progress_read = False
            return
        metrics = (
            "its engine's counters on /metrics stood still"
            if progress is not None
            else "/metrics could not tell"
        )
        self._evict(
            run,
            member,
            f"hung: it held {len(member.in_flight)} requests and answered none for "
            f"{quiet:.1f} s (stall window {window:.1f} s); {metrics}",
        )

    def _pool_gap(self, member: Member) -> float | None:
        gaps = [
            m.longest_gap
            for m in self._members.values()
            if m is not member and m.longest_gap is not None
        ]
        return max(gaps, default=None)

    async def _verify(self, member: Member) -> bool:
        """One shared health check for all the requests that doubt this member."""
        task = self._verifying.get(member.url)
        if task is None or task.done():
            task = asyncio.ensure_future(
                member.client.ais_healthy(self.config.health_check_timeout)
            )
            self._verifying[member.url] = task
        return await asyncio.shield(task)

    async def _watch_all_down(self, run: Run) -> None:
        down_since: float | None = None
        while not run.finished:
            members = list(self._members.values())
            if any(m.state is MemberState.HEALTHY for m in members):
                down_since = None
            else:
                now = self._clock.now()
                if down_since is None:
                    down_since = now
                usable = [m for m in members if m.state is not MemberState.DISABLED]
                hopeless = not usable and self._discovery is None
                if hopeless and members:
                    run.finish(self._unusable(run, members))
                    return
                if hopeless or now - down_since >= self.config.all_down_timeout:
                    run.finish(self._exhausted(run, members, now - down_since))
                    return
            await run.wait_for_change(0.5)

    @staticmethod
    def _unusable(run: Run, members: list[Member]) -> ServersUnusableError:
        """Every member is disabled: settings to fix, not a server to wait for."""
        servers, listing = _what_servers_said(members)
        done = (
            f"{run.delivered} of {run.admitted} samples taken were done before. "
            if run.delivered
            else ""
        )
        return ServersUnusableError(
            f"no server of the pool can be used, and waiting will not help. {done}"
            f"Servers: {listing}",
            servers=servers,
        )

    def _exhausted(self, run: Run, members: list[Member], waited: float) -> PoolExhaustedError:
        servers, listing = _what_servers_said(members)
        return PoolExhaustedError(
            f"no server of the pool could take work for {waited:.0f} s "
            f"(all_down_timeout={self.config.all_down_timeout:g}); {run.delivered} of "
            f"{run.admitted} samples taken were done (in .responses for batch_generate, "
            f"already handed out for a stream or a job). Servers: {listing}",
            servers=servers,
        )

    # -- state changes -----------------------------------------------------------------

    def _evict(self, run: Run, member: Member, reason: str, cause: int | None = None) -> None:
        """Take a member out of rotation and cancel what it holds (requeued by its slots).

        ``cause`` is the sample whose request revealed the failure: it counts as in
        flight, and goes back on the queue unless that makes it poison.
        """
        draining = member.state is MemberState.DRAINING
        if not member.evict(reason):
            if cause is not None:
                self._requeue_one(run, member, cause)
            return
        # Counted as on the member at this eviction (its number is now incremented).
        if cause is not None and not self._note_eviction(run, member, cause):
            self._requeue_one(run, member, cause)
        member.probation_until = self._clock.now() + self._probation(member)
        poisoned = self._cancel_in_flight(run, member)
        log.warning(
            "member_evicted",
            server=member.url,
            reason=reason,
            in_flight=len(member.in_flight),
            poisoned=poisoned,
        )
        if draining:
            self._forget(member)  # it was leaving; dead, it has nothing left to finish
        run.notify()

    def _disable(self, run: Run, member: Member, reason: str) -> None:
        draining = member.state is MemberState.DRAINING
        if not member.disable(reason):
            return  # disabled already (a second answer of the same kind)
        self._cancel_in_flight(run, member)
        if draining:
            self._forget(member)  # it was leaving; it will not finish anything now
        log.error("member_disabled", server=member.url, reason=reason)
        run.notify()

    def _cancel_in_flight(self, run: Run, member: Member) -> int:
        """Cancel the member's requests; count the eviction for every sample it held,
        including those whose request already failed and wait for a health check."""
        poisoned = 0
        for task, index in list(member.in_flight.items()):
            if task.done():
                continue  # its answer is being settled
            poisoned += self._note_eviction(run, member, index)
            task.cancel()
        for index in member.suspects:
            poisoned += self._note_eviction(run, member, index)
        member.suspects.clear()
        return poisoned

    def _note_eviction(self, run: Run, member: Member, index: int) -> bool:
        """Count that sample ``index`` was on ``member`` when it was evicted; True if that
        made it a poison sample (it then has its error Response)."""
        if not run.is_open(index):
            return False
        marks = run.eviction_marks.setdefault(index, set())
        mark = (member.url, member.evictions)
        if mark in marks:
            return False  # this eviction is counted already (the sample was sent twice)
        marks.add(mark)
        history = run.evicted_with.setdefault(index, [])
        history.append(member.url)
        if len(history) >= self.config.max_sample_evictions:
            return run.store(index, self._poison(member, history))
        return False

    def _poison(self, member: Member, history: list[str]) -> Response:
        return Response(
            error=(
                f"poison sample: it was in flight on {len(history)} servers that were each "
                f"evicted ({', '.join(history)}); it may be what brings servers down, so it "
                "was not sent again"
            ),
            error_type=ErrorKind.POISON.value,
            server=member.url,
            model=member.client.model,
            provider=member.client.provider,
        )

    def _requeue_one(self, run: Run, member: Member, index: int) -> None:
        member.requeued += run.requeue([index])


def _what_servers_said(members: list[Member]) -> tuple[dict[str, str], str]:
    """Each member's last error (or state), by URL, and the same as one line of text;
    an error that begins with its server's URL is not given the URL twice."""
    servers = {m.url: m.last_error or m.state.value for m in members}
    listing = "; ".join(f"{url}: {said.removeprefix(url + ': ')}" for url, said in servers.items())
    return servers, listing
