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
State = Literal["begun", "done", "stale"]
"""``stale``: a step the step it reads was redone under since it ran (its rows are no
longer what it read): it is redone at its next run, without ``force`` (that was given
when the step it reads was redone)."""


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
    """What a run does with one step, and why (for messages and ``describe``)."""

    name: str
    action: Action
    why: str


def plan(
    order: Sequence[tuple[str, str | None]],
    keys: Mapping[str, str],
    settings: Mapping[str, Mapping[str, Any]],
    recorded: Mapping[str, Recorded],
    *,
    selected: Collection[str] | None = None,
    retrying: Collection[str] = (),
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
    unknown = sorted(wanted - set(names))
    if unknown:
        raise ConfigurationError(
            f"--steps: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a "
            f"step; the steps are {', '.join(names)}"
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
        if source is not None and source in moved:
            why = f"reads step {source}, {moved[source]}"
            plans[name] = StepPlan(name, "run" if record is None else "redo", why)
            moved[name] = "which is redone"
        elif record is None:
            plans[name] = StepPlan(name, "run", "not run yet")
        elif record.state == "stale":
            why = "the step it reads was redone since it ran"
            plans[name] = StepPlan(name, "redo", why)
            moved[name] = "which is redone"
        elif record.key == keys[name] and record.state == "done" and name in retrying:
            why = "retry_errors: its error rows are sent again"
            plans[name] = StepPlan(name, "resume", why)
            moved[name] = "whose error rows are sent again"
        elif record.key == keys[name] and record.state == "done":
            plans[name] = StepPlan(name, "skip", "done, settings unchanged")
        elif record.key == keys[name]:
            plans[name] = StepPlan(name, "resume", "begun, settings unchanged")
        else:
            lines = _said(describe_changes(record.settings, settings[name]))
            plans[name] = StepPlan(name, "redo", "; ".join(lines) or "its settings changed")
            moved[name] = "which is redone"
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
        if step.action == "redo" and not step.why.startswith(("reads step", "the step it")):
            line = f"step {step.name} changed since it ran ({step.why})"
        elif step.action == "resume" and step.why.startswith("retry_errors") and later:
            line = f"step {step.name} sends its error rows again (retry_errors)"
        else:
            continue
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
