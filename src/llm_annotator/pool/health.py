"""Health: probes, admission, the shared health check, and a pool with no server left."""

from __future__ import annotations

import asyncio

import structlog

from llm_annotator import _constants as default
from llm_annotator.errors import ErrorKind, PoolExhaustedError, ProviderError, ServersUnusableError
from llm_annotator.pool.books import SERVED_WELL as SERVED_WELL  # re-exported: it was defined here
from llm_annotator.pool.books import HealthBook as HealthBook  # re-exported: it was defined here
from llm_annotator.pool.books import probation as probation  # re-exported: it was defined here
from llm_annotator.pool.discovery import PoolLike
from llm_annotator.pool.effects import Effects
from llm_annotator.pool.failures import CONFIGURATION_KINDS
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member
from llm_annotator.pool.run import Run
from llm_annotator.pool.state import PoolState

log = structlog.get_logger(__name__)

CANARY_MESSAGES = [{"role": "user", "content": "Say OK."}]
"""The test completion an evicted member must answer before it takes work again."""


class HealthMonitor:
    """Which members may take work: probe loops, admission, the shared health check
    that doubting requests wait on, and the all-down deadline."""

    def __init__(self, state: PoolState, effects: Effects) -> None:
        self._state = state
        self._effects = effects

    async def probe_loop(self, run: Run, member: Member) -> None:
        while not run.finished and member.state not in (MemberState.DISABLED,):
            if not self._state.is_member(member):
                return
            started = self._state.clock.now()
            if (
                member.state is MemberState.EVICTED
                and started < member.health.probation_until
                and any(m.state is MemberState.HEALTHY for m in self._state.members.values())
            ):
                # With no member left healthy, waiting out a probation helps nobody.
                await self._state.clock.sleep(min(member.health.probation_until - started, 1.0))
                continue
            evictions = member.evictions
            problem = await member.client.acheck_health(self._state.config.health_check_timeout)
            joining = member.state is MemberState.JOINING
            if joining and problem is not None and problem.kind in CONFIGURATION_KINDS:
                # Never admitted, and a TLS failure, a redirect or a refused key will
                # not heal by waiting. (Once a member has worked, such an answer is one
                # failed probe: an ingress being reloaded says 404 for a moment.)
                self._effects.disable(run, member, f"GET /health: {problem}")
                return
            if problem is not None and not member.last_error:
                member.note_error(f"GET /health: {problem}")
            if member.evictions == evictions:  # else the answer predates the eviction
                await self._after_probe(run, member, problem is None)
            pause = self._state.config.health_check_interval - (self._state.clock.now() - started)
            if pause > 0:
                await self._state.clock.sleep(pause)

    async def _after_probe(self, run: Run, member: Member, healthy: bool) -> None:
        if not self._state.is_member(member):
            return  # removed while the probe ran
        state = member.state
        if state is MemberState.HEALTHY:
            failed = member.health.probe(healthy)
            if failed >= self._state.config.max_failed_health_checks:
                self._effects.evict(
                    run,
                    member,
                    f"no answer to {failed} health checks in a row "
                    f"({self._state.config.health_check_timeout:g} s each)",
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
            member.note_error(str(exc))
            if exc.kind in CONFIGURATION_KINDS:
                self._effects.disable(run, member, f"GET /v1/models: {exc}")
            return
        wanted = member.model
        if wanted is None:
            if not models:
                self._effects.disable(run, member, "lists no model on /v1/models")
                return
            member.note_model(models[0])
        elif wanted not in models:
            self._effects.disable(
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
                member.health.canary_failed()
                member.note_error(f"test completion failed: {problem}")
                self._effects.start_probation(member)
                log.info("canary_failed", server=member.url, reason=str(problem))
                if problem.kind in CONFIGURATION_KINDS:
                    self._effects.disable(run, member, f"test completion: {problem}")
                return
            run.last_success_at = self._state.clock.now()  # a server answers: not a storm
        if not self._state.is_member(member):
            return  # removed meanwhile
        if member.admit():
            log.info("member_readmitted", server=member.url, model=member.model)
        else:
            log.info("member_joined", server=member.url, model=member.model)
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

    async def verify(self, member: Member) -> bool:
        """One shared health check for all the requests that doubt this member (since
        its last eviction)."""
        key = (member.url, member.evictions)
        task = self._state.verifying.get(key)
        if task is None or task.done():
            self._state.verifying.pop((member.url, member.evictions - 1), None)
            task = asyncio.ensure_future(
                member.client.ais_healthy(self._state.config.health_check_timeout)
            )
            self._state.verifying[key] = task
        return await asyncio.shield(task)

    async def prove(self, member: Member) -> ProviderError | None:
        """One shared test completion for all the samples that doubt this member (since
        its last eviction): None if it completed, else what failed."""
        key = (member.url, member.evictions)
        task = self._state.proving.get(key)
        if task is None or task.done():
            self._state.proving.pop((member.url, member.evictions - 1), None)
            task = asyncio.ensure_future(self._canary(member))
            self._state.proving[key] = task
        return await asyncio.shield(task)

    async def watch_all_down(self, run: Run) -> None:
        down_since: float | None = None
        while not run.finished:
            members = list(self._state.members.values())
            if any(m.state is MemberState.HEALTHY for m in members):
                down_since = None
            else:
                now = self._state.clock.now()
                if down_since is None:
                    down_since = now
                usable = [m for m in members if m.state is not MemberState.DISABLED]
                hopeless = not usable and self._state.discovery is None
                if hopeless and members:
                    run.finish(self._effects.unusable(run, members))
                    return
                if hopeless or now - down_since >= self._state.config.all_down_timeout:
                    run.finish(self._effects.exhausted(run, members, now - down_since))
                    return
            await run.wait_for_change(0.5)

    async def resolve_model(self, pool: PoolLike, timeout: float | None = None) -> str:
        """The pool's model (see ``VLLMQueueAnnotator.aresolve_model``); servers that a
        discovery lists are added to ``pool`` first."""
        state = self._state
        config = state.config
        if config.model is not None:
            return config.model
        deadline = state.clock.now() + (config.all_down_timeout if timeout is None else timeout)
        said: dict[str, str] = {}
        while True:
            if state.discovery is not None:
                await state.discovery.refresh(pool)
            members = list(state.members.values())
            answers = await asyncio.gather(
                *(m.client.alist_models() for m in members), return_exceptions=True
            )
            for member, answer in zip(members, answers, strict=True):
                if isinstance(answer, list) and answer:
                    return str(answer[0])
                if isinstance(answer, ProviderError):
                    said[member.url] = answer.message
                else:
                    said[member.url] = (
                        str(answer) if isinstance(answer, BaseException) else "no model"
                    )
            broken = [
                a for a in answers if isinstance(a, ProviderError) and a.kind in CONFIGURATION_KINDS
            ]
            if members and len(broken) == len(members):
                listing = "; ".join(str(error) for error in broken)
                raise ServersUnusableError(
                    f"no server of the pool can be used, and waiting will not help: {listing}",
                    servers=said,
                )
            left = deadline - state.clock.now()
            if left <= 0:
                listing = "; ".join(f"{url}: {text}" for url, text in said.items())
                raise PoolExhaustedError(
                    f"no server of the pool listed a model on /v1/models in time: {listing}",
                    servers=said,
                )
            await state.clock.sleep(min(2.0, left))
