"""What a pipeline run does with each step, decided before anything runs (pure).

A step recorded as done with the same settings is skipped; one begun with the same
settings is resumed; one whose settings changed (or whose upstream is redone, which
changes its key) is redone from scratch, replacing its results. Replacing results is
refused without ``force``, naming each changed step, what changed, and the steps that
read it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs.rundir.fingerprint import describe_changes

Action = Literal["run", "resume", "skip", "redo", "leave"]
"""``run`` a step never begun, ``resume`` one begun, ``skip`` one done, ``redo`` one
whose settings changed (its results replaced), ``leave`` one not selected."""
State = Literal["begun", "done", "stale", "lost"]
"""``stale``: a step the step it reads was redone under since it ran (its rows are no
longer what it read): it is redone at its next run, without ``force`` (that was given
when the step it reads was redone). ``lost``: done, but its output is gone: its job
makes its rows again, so the steps that read it are redone."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the pipeline's record says of a step.

    Attributes:
        key: The key of the settings it ran with.
        state: ``begun`` (its job may hold rows), ``done`` or ``stale``.
        settings: Those settings, to say what changed.
    """

    key: str
    state: State
    settings: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What a run does with one step, and why (for messages and ``describe``).

    Attributes:
        name: The step.
        action: What the run does with it.
        why: Why, in words.
        rows_change: Its rows may differ from what the steps that read it read (it
            runs anew, is redone, sends its error rows again, or makes a lost output
            again): those steps are marked stale when it begins.
        needs_force: Running it replaces results because of a change of the step
            itself (its settings, its dataset, ``retry_errors``, a lost output): refused
            without ``force``.
    """

    name: str
    action: Action
    why: str
    rows_change: bool = False
    needs_force: bool = False


def plan(
    order: Sequence[tuple[str, str | None]],
    keys: Mapping[str, str],
    settings: Mapping[str, Mapping[str, Any]],
    recorded: Mapping[str, Recorded],
    *,
    selected: Collection[str] | None = None,
    retrying: Collection[str] = (),
    redo: Collection[str] = (),
    force: bool = False,
) -> list[StepPlan]:
    """Decide each step's action.

    Args:
        order: Each step's name and the step it reads (or None), readers after what
            they read.
        keys: Each step's key now.
        settings: Each step's settings now.
        recorded: What the record says of the steps that began.
        selected: The steps to run (``--steps``); None for all.
        retrying: The steps with ``retry_errors``: done, they are resumed to send their
            error rows again, and the steps that read them redone.
        redo: Steps to redo whatever their record says (``--redo``), with the steps
            that read them: asked by name, so not refused without ``force``.
        force: Allow replacing a changed step's results.

    Returns:
        One plan per step, in ``order``.

    Raises:
        ConfigurationError: A selected name is not a step; a selected step reads one
            that is not selected and not done as it is now; or a step with results
            would be replaced and ``force`` is not given.

    Examples:
        >>> order = [("label", None), ("reason", "label")]
        >>> keys = {"label": "k1", "reason": "k2"}
        >>> s = {"label": {"prompt_template": "A {x}"}, "reason": {"prompt_template": "B {x}"}}
        >>> done = {"label": Recorded("k1", "done", s["label"])}
        >>> [(p.name, p.action) for p in plan(order, keys, s, done)]
        [('label', 'skip'), ('reason', 'run')]
        >>> changed = {"label": {"prompt_template": "C {x}"}, "reason": s["reason"]}
        >>> ran = {**done, "reason": Recorded("k2", "done", s["reason"])}
        >>> plan(order, {"label": "k3", "reason": "k4"}, changed, ran)
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: step label changed since it ran ...
    """
    names = [name for name, _ in order]
    wanted = set(names) if selected is None else set(selected)
    for flag, asked in (("--steps", wanted), ("--redo", set(redo))):
        unknown = sorted(asked - set(names))
        if unknown:
            raise ConfigurationError(
                f"{flag}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not "
                f"a step; the steps are {', '.join(names)}"
            )
    plans: dict[str, StepPlan] = {}
    moved: dict[str, str] = {}  # steps whose rows change in this run, and how
    for name, source in order:
        record = recorded.get(name)
        if name not in wanted:
            plans[name] = StepPlan(name, "leave", "not in --steps")
            continue
        if source is not None and source not in wanted:
            upstream = recorded.get(source)
            if upstream is None or upstream.key != keys[source] or upstream.state != "done":
                raise ConfigurationError(
                    f"step {name} reads step {source}, which is not done as the pipeline "
                    f"says it now; add {source} to --steps"
                )
        same = record is not None and record.key == keys[name]
        if source is not None and source in moved:
            why = f"reads step {source}, {moved[source]}"
            step = StepPlan(name, "run" if record is None else "redo", why, rows_change=True)
        elif record is None:
            step = StepPlan(name, "run", "not run yet", rows_change=True)
        elif name in redo:
            step = StepPlan(name, "redo", "asked with --redo", rows_change=True)
        elif record.state == "stale":
            why = "the step it reads was redone since it ran"
            step = StepPlan(name, "redo", why, rows_change=True)
        elif same and record.state == "lost":
            why = "done, but its output is gone: its rows are made again"
            step = StepPlan(name, "resume", why, rows_change=True, needs_force=True)
        elif same and record.state == "done" and name in retrying:
            why = "retry_errors: its error rows are sent again"
            step = StepPlan(name, "resume", why, rows_change=True, needs_force=True)
        elif same and record.state == "done":
            step = StepPlan(name, "skip", "done, settings unchanged")
        elif same:
            step = StepPlan(name, "resume", "begun, settings unchanged")
        else:
            lines = describe_changes(record.settings, settings[name])
            own = [line for line in lines if not line.startswith("upstream:")]
            why = "; ".join(_said(lines)) or "its settings changed"
            step = StepPlan(name, "redo", why, rows_change=True, needs_force=bool(own))
        plans[name] = step
        if step.rows_change:
            moved[name] = "whose rows change"
    if not force:
        _refuse_replacing([plans[name] for name in names], order, recorded)
    return [plans[name] for name in names]


def _refuse_replacing(
    plans: Sequence[StepPlan],
    order: Sequence[tuple[str, str | None]],
    recorded: Mapping[str, Recorded],
) -> None:
    """Refuse a plan that replaces results, saying which and why."""
    lines = []
    for step in plans:
        later = [
            name
            for name in downstream(order, step.name)
            if name in recorded and recorded[name].state != "stale"
        ]
        if not step.needs_force or (step.action == "resume" and not later):
            continue
        if step.action == "redo":
            line = f"step {step.name} changed since it ran ({step.why})"
        else:
            line = f"step {step.name} makes rows again ({step.why})"
        if later:
            line += f"; the steps that read it ({', '.join(later)}) would be redone too"
        lines.append(line)
    if not lines:
        return
    raise ConfigurationError(
        "; ".join(lines) + ". Their results would be replaced: run again with --force "
        "(force=True) to do so, or restore the settings to resume."
    )


def downstream(order: Sequence[tuple[str, str | None]], name: str) -> list[str]:
    """The steps that read ``name``, directly or through others (``order``: each step
    and what it reads, readers after what they read).

    Examples:
        >>> downstream([("a", None), ("b", "a"), ("c", "b"), ("d", None)], "a")
        ['b', 'c']
    """
    found: list[str] = []
    wanted = {name}
    for step, source in order:
        if source in wanted:
            found.append(step)
            wanted.add(step)
    return found


def _said(lines: Sequence[str]) -> list[str]:
    """Changes in words: a dataset's identity (sizes, times, a digest) as one line, and
    the key of the step it reads as that step having been redone.

    Examples:
        >>> _said(["data_identity.0: 10 -> 12", "data_identity.1: 1 -> 2", "n: 1 -> 2"])
        ['its dataset changed since it ran (size, time or files)', 'n: 1 -> 2']
        >>> _said(["upstream: 'a1' -> 'b2'"])
        ['the step it reads ran with other settings since']
    """
    said = [line for line in lines if not line.startswith(("data_identity", "upstream:"))]
    if any(line.startswith("upstream:") for line in lines):
        said.insert(0, "the step it reads ran with other settings since")
    if any(line.startswith("data_identity") for line in lines):
        said.insert(0, "its dataset changed since it ran (size, time or files)")
    return said
