"""An elastic worker's way through a pipeline's steps: which step it works on next.

A worker (``shard="claim"``) does not run the steps one after the other to their ends:
it takes the units it can of each step in turn, in the steps' order, and goes on to the
next step as soon as it can take no unit now (the others hold the rest, or they are not
ready: their rows come from units of the step before that are not finished yet), or
once it has taken units of the step for :data:`TURN_SECONDS` (the units it holds then
are finished first). So the later steps' units start while the first step has units
left, a turn after the units they read are finished, even for a worker alone. A
pass over the steps that did nothing (every unit held or waiting) is followed by a
pause, doubling from :data:`FIRST_PAUSE` to :data:`LONGEST_PAUSE`, then the next
pass; a step is left out of the passes once it is done. So step 2 runs while step 1
is still answering, and a unit left behind by a worker that died is taken over by the
first worker to come back to its step once its lease has run out.

Only the last step not done waits inside its job for the units that others hold (it
has nothing else to go to), as a corpus job's worker does.

:class:`Turns` decides; it does no I/O, and the pipeline runs what it says.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from llm_annotator.jobs.rundir.claims import new_owner

TURN_SECONDS = 20.0
"""Seconds a worker claims units of a step before it goes on to the next steps (the
last step not done excepted); each turn ends with the units in hand finished, so the
servers wait a moment at a turn's end (the rows in flight drain, the next job starts):
a turn is long beside that."""
FIRST_PAUSE = 0.25
"""Seconds a worker waits after a pass that did nothing, doubling to the longest."""
LONGEST_PAUSE = 4.0
"""The longest pause between two passes that did nothing."""


class Turns:
    """Which step an elastic worker runs next (see the module).

    Args:
        steps: The steps to run, in the order they run.
        owner: The worker's name in every step's claims (the same each time it comes
            back to a step), new by default.

    Examples:
        >>> turns = Turns(["a", "b"], owner="w")
        >>> turns.next(), turns.is_last("a"), turns.is_last("b")
        ('a', False, True)
        >>> turns.ran("a", finished=False, worked=True)
        >>> turns.next()
        'b'
        >>> turns.ran("b", finished=False, worked=False)
        >>> turns.next()  # the pass worked: no pause
        'a'
        >>> turns.ran("a", finished=True, worked=False)
        >>> turns.next(), turns.is_last("b")
        ('b', True)
        >>> turns.ran("b", finished=False, worked=False)
        >>> turns.next()  # a pass that did nothing: a pause first
        0.25
        >>> turns.next()
        'b'
        >>> turns.ran("b", finished=True, worked=True)
        >>> turns.next() is None
        True
    """

    def __init__(self, steps: Sequence[str], *, owner: str | None = None) -> None:
        self.owner = owner if owner is not None else new_owner()
        self.left = list(steps)
        """The steps not done, in order."""
        self._pass: deque[str] = deque(self.left)
        self._worked = False
        self._pause = FIRST_PAUSE
        self._paused = False

    def __repr__(self) -> str:
        return f"<Turns left={self.left} owner={self.owner!r}>"

    def next(self) -> str | float | None:
        """The step to run now; or the seconds to wait first (the pass did nothing);
        or None: every step is done."""
        if not self.left:
            return None
        if not self._pass:
            self._pass.extend(self.left)
            if self._worked:
                self._worked = False
                self._pause = FIRST_PAUSE
            elif not self._paused:
                self._paused = True
                wait, self._pause = self._pause, min(self._pause * 2, LONGEST_PAUSE)
                return wait
        self._paused = False
        return self._pass.popleft()

    def ran(self, step: str, *, finished: bool, worked: bool) -> None:
        """Say what running ``step`` did: ``finished`` the step (by whichever worker),
        ``worked`` (this worker answered rows of it)."""
        self._worked = self._worked or worked
        if finished and step in self.left:
            self.left.remove(step)
            if step in self._pass:
                self._pass.remove(step)

    def is_last(self, step: str) -> bool:
        """Whether ``step`` is the last step not done: its job waits for the units that
        other workers hold rather than leave them."""
        return bool(self.left) and self.left[-1] == step
