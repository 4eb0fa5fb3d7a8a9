"""Each member's window: how many requests it may hold, sized from its engine's load.

``batch_size x max_concurrent_batches_per_client`` is the most a member ever holds.
A member starts each call at :data:`START_WINDOW`, so that every server gets its first
requests at once rather than behind thousands sent to the others. By default its window
then grows by one with each answer up to that bound. A pool that is one of several
processes sharing its servers (:meth:`~llm_annotator.pool.queue.QueuePool.share_servers`)
takes its share of that bound only (:func:`budget_share`), so that a server carries
the budget once, not once per process. With ``adaptive=True`` its window
instead follows what its server can start soon: every :data:`INTERVAL` seconds the
:class:`WindowTuner` reads the server's ``/metrics`` (vLLM's running and waiting gauges
and its preemption counter) and :func:`next_window` decides the new size. A server
whose queue is longer than it needs to stay busy holds work another server could start
sooner, and at the end of a call that queue is the tail everyone waits for; a server
that preempts is pushed past what its KV cache holds. A server whose ``/metrics``
cannot be read gets the full window. The decision is a pure function, tested as a table.
"""

from __future__ import annotations

import math

import structlog

from llm_annotator.clients.metrics import EngineLoad
from llm_annotator.pool.books import WindowBook as WindowBook  # re-exported: it was defined here
from llm_annotator.pool.lifecycle import MemberState
from llm_annotator.pool.member import Member
from llm_annotator.pool.run import Run
from llm_annotator.pool.state import PoolState

log = structlog.get_logger(__name__)

INTERVAL = 1.0
"""Seconds between two reads of a member's ``/metrics`` (never on the request path)."""
START_WINDOW = 64
"""A member's window when a call starts (then grown; see :meth:`WindowTuner.start`)."""
WAKE_STEP = 32
"""A growing window wakes the member's idle slots each time it grows by this much."""
MIN_WINDOW = 4
"""The least window: a server shared with other clients still gets some of ours."""
MIN_WAITING = 2
"""Requests a server may keep waiting, at least, so that its batch refills at once."""
WAITING_SHARE = 0.1
"""... or this share of what it runs, if more ..."""
QUEUE_SECONDS = 0.1
"""... or what it answers in this many seconds, if more: its batch stays full while the
client takes a while to send more, and at the end of a call its queue is done in
about this long."""
PREEMPTED_SHARE = 0.9
"""After preemptions, the window shrinks to this share of what the server ran."""


def budget_share(budget: int, sharing: int) -> int:
    """The requests one of ``sharing`` processes may hold on a server whose whole
    budget is ``budget``: an even share, rounded down so that together they hold no
    more than the budget, and at least one.

    Examples:
        >>> budget_share(1024, 1), budget_share(64, 8), budget_share(16, 3), budget_share(4, 64)
        (1024, 8, 5, 1)
    """
    return max(1, budget // max(1, sharing))


def waiting_target(running: float, rate: float = 0.0) -> int:
    """How many requests a server running ``running`` and answering ``rate`` per
    second may keep waiting.

    Examples:
        >>> waiting_target(16), waiting_target(256), waiting_target(32, rate=1000.0)
        (2, 26, 100)
    """
    return max(MIN_WAITING, math.ceil(running * WAITING_SHARE), math.ceil(rate * QUEUE_SECONDS))


def next_window(
    window: int,
    load: EngineLoad | None,
    *,
    holding: int,
    preempted: bool,
    ceiling: int,
    rate: float = 0.0,
    floor: int = MIN_WINDOW,
) -> int:
    """A member's next window, from its server's load, what the member holds and how
    many answers a second it gave since the last read (``rate``).

    - ``/metrics`` unreadable (``load`` None): the full window, ``ceiling``.
    - Preemptions since the last read: a little under what the server ran.
    - A queue longer than :func:`waiting_target`: shrink by the excess.
    - The member holds its whole window (within an eighth) and the server queues
      no more than the target: grow, doubling while nothing waits, else by a quarter.
    - Otherwise unchanged. Always within ``floor`` and ``ceiling``.

    Examples:
        >>> from llm_annotator.clients.metrics import EngineLoad
        >>> busy = EngineLoad(running=16, waiting=48)
        >>> next_window(64, busy, holding=64, preempted=False, ceiling=1024)
        18
        >>> idle = EngineLoad(running=64, waiting=0)
        >>> next_window(64, idle, holding=64, preempted=False, ceiling=1024)
        128
        >>> next_window(64, None, holding=10, preempted=False, ceiling=1024)
        1024
    """
    floor = min(floor, ceiling)
    if load is None:
        return ceiling
    target = waiting_target(load.running, rate)
    if preempted:
        new = math.floor(min(window, load.running) * PREEMPTED_SHARE)
    elif load.waiting > target:
        new = min(window, holding) - math.ceil(load.waiting - target)
    elif holding >= window - max(1, window // 8):
        new = window * 2 if load.waiting == 0 else window + max(1, window // 4)
    else:
        new = window
    return max(floor, min(ceiling, new))


class WindowTuner:
    """Reads each member's engine load every :data:`INTERVAL` seconds during a call and
    sets its window (see the module's docstring)."""

    def __init__(self, state: PoolState) -> None:
        self._state = state
        self._grow_to = 0

    @property
    def ceiling(self) -> int:
        """The most a member may hold: the budget, or this process's share of it."""
        config = self._state.config
        budget = config.batch_size * config.max_concurrent_batches_per_client
        return budget_share(budget, self._state.sharing)

    def reshare(self) -> None:
        """The number of processes sharing the servers changed: no member holds more
        than the new :attr:`ceiling` (a window above it shrinks now; requests in flight
        finish); without ``adaptive`` the windows grow up to it again with answers."""
        ceiling = self.ceiling
        if not self._state.config.adaptive:
            self._grow_to = ceiling
        for member in self._state.members.values():
            if member.window.size > ceiling:
                member.window.resize(ceiling)

    def start(self, member: Member) -> None:
        """Set the member's window for a new call (or after it rejoined): with
        ``adaptive=True`` :data:`START_WINDOW`, then what its ``/metrics`` say; else
        :data:`START_WINDOW` growing by one with each answer (:meth:`answered`) up to
        the whole window, so that at the start of a call every server gets its first
        requests at once instead of behind thousands of others."""
        adaptive = self._state.config.adaptive
        member.window.start(min(START_WINDOW, self.ceiling), evictions=member.evictions)
        self._grow_to = 0 if adaptive else self.ceiling

    def restart_if_back(self, member: Member) -> None:
        """Start the member's window again if it was evicted since it was last started:
        the server that rejoined may be a restarted one, or another GPU."""
        if member.window.started_at != member.evictions:
            self.start(member)
            log.debug("window_changed", server=member.url, window=member.window.size)

    def answered(self, member: Member) -> bool:
        """A good answer arrived from ``member``: without ``adaptive``, its window grows
        by one up to the whole window (doubling with each round of answers). True when
        it grew to a multiple of :data:`WAKE_STEP`, for the caller to wake idle slots."""
        book = member.window
        if book.size >= self._grow_to:
            return False
        return book.grow() % WAKE_STEP == 0

    async def watch(self, run: Run, member: Member) -> None:
        """Tune the member's window until the call ends or the member leaves."""
        if not self._state.config.adaptive:
            return
        clock = self._state.clock
        preemptions: float | None = None
        answered, since = member.completed + member.errors, clock.now()
        evictions = member.evictions
        while not run.finished:
            await clock.sleep(INTERVAL)
            now, count = clock.now(), member.completed + member.errors
            rate = (count - answered) / max(now - since, 1e-3)
            answered, since = count, now
            if not self._state.is_member(member) or member.state is MemberState.DISABLED:
                return
            if member.state is not MemberState.HEALTHY:
                continue
            if member.evictions != evictions:
                # Evicted and back: what it showed before says nothing of the restarted
                # server (it may be another GPU); start afresh.
                evictions, preemptions = member.evictions, None
                self.restart_if_back(member)
                continue
            load = await member.client.aengine_load(self._state.config.health_check_timeout)
            preempted = False
            if load is not None and load.preemptions is not None:
                preempted = preemptions is not None and load.preemptions > preemptions
                preemptions = load.preemptions
            book = member.window
            was = book.resize(
                next_window(
                    book.size,
                    load,
                    holding=len(member.in_flight),
                    preempted=preempted,
                    ceiling=self.ceiling,
                    rate=rate,
                )
            )
            if book.size != was:
                log.debug(
                    "window_changed",
                    server=member.url,
                    window=book.size,
                    was=was,
                    running=None if load is None else load.running,
                    waiting=None if load is None else load.waiting,
                    rate=round(rate, 1),
                    preempted=preempted,
                )
                if book.size > was:
                    run.notify()  # idle slots may take work now
