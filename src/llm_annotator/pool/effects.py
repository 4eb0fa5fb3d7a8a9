"""The pool's state changes: what the health monitor and the dispatcher decide, done.

Each change moves a member through its transitions and keeps the run's books (which
evictions a sample lived through, what goes back on the queue, which error row a
sample ends with), then wakes whoever waits on the run.
"""

from __future__ import annotations

import structlog

from llm_annotator.errors import ErrorKind, PoolExhaustedError, ProviderError, ServersUnusableError
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member
from llm_annotator.pool.run import Run
from llm_annotator.pool.state import PoolState
from llm_annotator.response import Response

log = structlog.get_logger(__name__)


class Effects:
    """Carries out state changes on the members and the run of one pool."""

    def __init__(self, state: PoolState) -> None:
        self._state = state

    def evict(
        self,
        run: Run,
        member: Member,
        reason: str,
        cause: int | None = None,
        *,
        probation: bool = True,
    ) -> None:
        """Take a member out of rotation and cancel what it holds (requeued by its slots).

        ``cause`` is the sample whose request revealed the failure: it counts as in
        flight, and goes back on the queue unless that makes it poison. Without
        ``probation`` its probes may readmit it at their next answer (another process
        found it dead: if it answers here, there is nothing to wait out).
        """
        draining = member.state is MemberState.DRAINING
        if not member.evict(reason):
            if cause is not None:
                self.requeue(run, member, cause)
            return
        # Counted as on the member at this eviction (its number is now incremented).
        if cause is not None and not self.note_eviction(run, member, cause):
            self.requeue(run, member, cause)
        if probation:
            self.start_probation(member)
        poisoned = self._cancel_in_flight(run, member)
        log.warning(
            "member_evicted",
            server=member.url,
            reason=reason,
            in_flight=len(member.in_flight),
            poisoned=poisoned,
        )
        if draining:
            self._state.forget(member)  # it was leaving; dead, it has nothing to finish
        run.notify()

    def start_probation(self, member: Member) -> None:
        """Hold an evicted member back from its next test completion for its probation
        (see :meth:`~llm_annotator.pool.books.HealthBook.start_probation`)."""
        config = self._state.config
        member.health.start_probation(
            self._state.clock.now(),
            interval=config.health_check_interval,
            all_down_timeout=config.all_down_timeout,
        )

    def disable(self, run: Run, member: Member, reason: str) -> None:
        """Take a member out for good: its settings (key, TLS, model, URL) are wrong."""
        draining = member.state is MemberState.DRAINING
        if not member.disable(reason):
            return  # disabled already (a second answer of the same kind)
        self._cancel_in_flight(run, member)
        if draining:
            self._state.forget(member)  # it was leaving; it will not finish anything now
        log.error("member_disabled", server=member.url, reason=reason)
        run.notify()

    def _cancel_in_flight(self, run: Run, member: Member) -> int:
        """Cancel the member's requests; count the eviction for every sample it held,
        including those whose request already failed and wait for a health check."""
        poisoned = 0
        for task, index in list(member.in_flight.items()):
            if task.done():
                continue  # its answer is being settled
            poisoned += self.note_eviction(run, member, index)
            task.cancel()
        for index in member.suspects:
            poisoned += self.note_eviction(run, member, index)
        member.suspects.clear()
        return poisoned

    def note_eviction(self, run: Run, member: Member, index: int) -> bool:
        """Count that sample ``index`` was on ``member`` when it was evicted; True if that
        made it a poison sample (it then has its error Response)."""
        sample = run.open.get(index)
        if sample is None:
            return False
        mark = (member.url, member.evictions)
        if sample.evicted_with is None:
            sample.evicted_with = []
        elif mark in sample.evicted_with:
            return False  # this eviction is counted already (the sample was sent twice)
        sample.evicted_with.append(mark)
        if len(sample.evicted_with) >= self._state.config.max_sample_evictions:
            return run.store(index, _poison(member, [url for url, _ in sample.evicted_with]))
        return False

    def note_eviction_or_requeue(self, run: Run, member: Member, index: int) -> None:
        """A sample answered by a member evicted since it was sent: it was on the member
        when it broke, like the requests the eviction cancelled."""
        if not self.note_eviction(run, member, index):
            self.requeue(run, member, index)

    @staticmethod
    def requeue(run: Run, member: Member, index: int) -> None:
        """Put sample ``index`` back on the queue (if it is still open)."""
        member.requeued += run.requeue([index])

    @staticmethod
    def error_row(run: Run, member: Member, index: int, error: ProviderError) -> None:
        """End sample ``index`` with ``error`` as its Response."""
        response = Response(
            error=str(error),
            error_type=error.kind.value,
            server=member.url,
            model=member.model,
            provider=member.client.provider,
        )
        if run.store(index, response):
            member.errors += 1
            member.note_error(str(error))

    # -- the end of a pool with no server left -----------------------------------------

    @staticmethod
    def unusable(run: Run, members: list[Member]) -> ServersUnusableError:
        """Every member is disabled: settings to fix, not a server to wait for."""
        servers, listing = what_servers_said(members)
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

    def exhausted(self, run: Run, members: list[Member], waited: float) -> PoolExhaustedError:
        """No member could take work for ``waited`` seconds."""
        servers, listing = what_servers_said(members)
        return PoolExhaustedError(
            f"no server of the pool could take work for {waited:.0f} s "
            f"(all_down_timeout={self._state.config.all_down_timeout:g}); {run.delivered} "
            f"of {run.admitted} samples taken were done (in .responses for batch_generate, "
            f"already handed out for a stream or a job). Servers: {listing}",
            servers=servers,
        )


def _poison(member: Member, history: list[str]) -> Response:
    return Response(
        error=(
            f"poison sample: it was in flight on {len(history)} servers that were each "
            f"evicted ({', '.join(history)}); it may be what brings servers down, so it "
            "was not sent again"
        ),
        error_type=ErrorKind.POISON.value,
        server=member.url,
        model=member.model,
        provider=member.client.provider,
    )


def what_servers_said(members: list[Member]) -> tuple[dict[str, str], str]:
    """Each member's last error (or state), by URL, and the same as one line of text;
    an error that begins with its server's URL is not given the URL twice."""
    servers = {m.url: m.last_error or m.state.value for m in members}
    listing = "; ".join(f"{url}: {said.removeprefix(url + ': ')}" for url, said in servers.items())
    return servers, listing
