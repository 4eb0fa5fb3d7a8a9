"""A job's fingerprint: the settings that define its results, to refuse mixing two jobs.

A run directory records the fingerprint of the job that made it in ``job.json``.
Resuming with other settings (another prompt, model or output schema) would mix two
kinds of results in one dataset, so the result store compares fingerprints, names what
changed, and refuses unless forced. Which job options it records, and how, follows
their declaration (``fingerprinted`` in :mod:`llm_annotator._job_options`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import orjson
import structlog

from llm_annotator._job_options import JOB_OPTIONS, JobOption
from llm_annotator.errors import ConfigurationError, FingerprintMismatchError, JobError
from llm_annotator.jobs.spec import JobSpec, validator_name

log = structlog.get_logger(__name__)

_SHORT = 60
"""Longest value shown whole by :func:`describe_changes`; longer ones are cut with …."""
_CONTEXT = 20
"""Characters kept before the first difference when a long string is cut."""


def make_fingerprint(**settings: Any) -> dict[str, Any]:
    """The canonical, JSON-able form of the settings that define a job's results.

    Keys are sorted at every depth and values normalized through a JSON round trip
    (tuples become lists, dataclasses dicts, enums their values), so two equal
    settings give equal fingerprints whatever their Python types.

    Args:
        **settings: What defines the results: template, system message, model, options
            payload, output schema, id column, and so on.

    Returns:
        A new dict, keys sorted.

    Raises:
        ConfigurationError: If a setting cannot be written as JSON.

    Examples:
        >>> make_fingerprint(model="m", options={"top_p": 1, "temperature": 0.5}, stop=("a",))
        {'model': 'm', 'options': {'temperature': 0.5, 'top_p': 1}, 'stop': ['a']}
    """
    try:
        encoded = orjson.dumps(settings, option=orjson.OPT_SORT_KEYS)
    except TypeError as error:
        raise ConfigurationError(
            f"a job setting cannot be part of the job's fingerprint (not JSON-able): {error}"
        ) from error
    fingerprint: dict[str, Any] = orjson.loads(encoded)
    return fingerprint


Record = Callable[[JobOption, Any], dict[str, Any]]
"""How the fingerprint records an option: its declaration and value in, its entries
out (none: left out)."""


@dataclass(frozen=True, slots=True)
class ByCaller:
    """An option recorded by the caller of :func:`job_fingerprint`, as the extra
    ``key``: its entry depends on more than the spec (the input's size)."""

    key: str


def _unless_default(option: JobOption, value: Any) -> dict[str, Any]:
    """Under its name, left out at its default: a job that leaves a new option unset
    keeps the fingerprint it had before the option existed."""
    return {} if value == option.default else {option.name: value}


def _always(option: JobOption, value: Any) -> dict[str, Any]:
    """Under its name, None included (recorded so since the first fingerprints)."""
    return {option.name: value}


def _options(option: JobOption, value: Any) -> dict[str, Any]:
    """The runtime options as sent (their payload; ``{}`` for none), and their output
    schema apart, since it decides how answers are parsed."""
    return {
        "options": value.to_payload() if value is not None else {},
        "output_schema": getattr(value, "output_schema", None),
    }


def _gen_kwargs(option: JobOption, value: Any) -> dict[str, Any]:
    return {option.name: value or {}}


def _columns(option: JobOption, value: Any) -> dict[str, Any]:
    return {option.name: list(value) if value is not None else None}


def _hook(option: JobOption, value: Any) -> dict[str, Any]:
    """A user's callable, by name (:func:`~llm_annotator.jobs.spec.validator_name`);
    left out when unused, as the fingerprints made before hooks existed."""
    if value is None:
        return {}
    if not callable(value):
        raise ConfigurationError(f"{option.name} must be a callable, got {value!r}")
    return {option.name: validator_name(value)}


RECORDED: Mapping[str, Record | ByCaller] = MappingProxyType(
    {
        "system_message": _always,
        "id_column": _always,
        "options": _options,
        "gen_kwargs": _gen_kwargs,
        "columns": _columns,
        "limit": ByCaller("sample"),
        "shuffle_seed": ByCaller("sample"),
        "validate": _hook,
        "postprocess": _hook,
    }
)
"""How :func:`job_fingerprint` records each option declared ``fingerprinted`` in
:mod:`llm_annotator._job_options`, when not by :func:`_unless_default`. Every entry
here is what run directories already hold: changing one refuses their resumption."""


def job_fingerprint(spec: JobSpec, model: str | None, **extras: Any) -> dict[str, Any]:
    """The fingerprint of a job (:func:`make_fingerprint`): its prompt template, the
    model, and each job option declared fingerprinted, recorded as :data:`RECORDED`
    says; with ``extras``, settings a job may leave out (left out when unused).

    Args:
        spec: The job.
        model: The model that answers it (None: each server's own).
        **extras: Entries the spec cannot make: the ones :data:`RECORDED` leaves to
            the caller (the sample of a trial run, which depends on the input's size),
            and settings that are no job option. An extra may repeat an entry made from
            the spec (the hooks' names) only with the same value.

    Returns:
        A new dict, keys sorted.

    Raises:
        ConfigurationError: A hook is not callable, or a setting is not JSON-able.
        TypeError: The spec sets an option whose entry the caller gives, and the
            caller gave none.
        ValueError: An extra contradicts an entry made from the spec.

    Examples:
        >>> from pathlib import Path
        >>> spec = JobSpec([], "Label: {text}", Path("out"), id_column="uid")
        >>> fingerprint = job_fingerprint(spec, "m")
        >>> fingerprint["id_column"], fingerprint["options"], fingerprint["columns"]
        ('uid', {}, None)
    """
    settings: dict[str, Any] = {"prompt_template": spec.prompt_template, "model": model}
    for option in JOB_OPTIONS:
        if not option.fingerprinted:
            continue
        value = getattr(spec, option.name)
        how = RECORDED.get(option.name, _unless_default)
        if isinstance(how, ByCaller):
            if value != option.default and how.key not in extras:
                raise TypeError(
                    f"job_fingerprint: the job sets {option.name}, which the caller records "
                    f"as the extra {how.key!r} (it depends on the input); none was given"
                )
            continue
        settings.update(how(option, value))
    for key, value in extras.items():
        if key in settings and make_fingerprint(v=settings[key]) != make_fingerprint(v=value):
            raise ValueError(
                f"job_fingerprint: the extra {key}={value!r} contradicts the job's "
                f"{settings[key]!r}"
            )
    return make_fingerprint(**{**settings, **extras})


def fingerprint_digest(fingerprint: Mapping[str, Any]) -> str:
    """The SHA-256 hex digest of a fingerprint's canonical JSON.

    Examples:
        >>> a = fingerprint_digest({"model": "m", "seed": 1})
        >>> a == fingerprint_digest({"seed": 1, "model": "m"})
        True
        >>> len(a), a == fingerprint_digest({"model": "m", "seed": 2})
        (64, False)
    """
    return hashlib.sha256(_canonical(fingerprint)).hexdigest()


def describe_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """One line per setting that differs between two fingerprints, old value first.

    Nested mappings (such as the options payload) are compared key by key, their
    lines named by the dotted path. Long values are cut with … around the first place
    they differ.

    Examples:
        >>> old = {"prompt_template": "Classify: {text}", "options": {"temperature": 0}}
        >>> new = {"prompt_template": "Label: {text}", "options": {"temperature": 0.7},
        ...        "id_column": "uid"}
        >>> for line in describe_changes(old, new):
        ...     print(line)
        id_column: added 'uid'
        options.temperature: 0 -> 0.7
        prompt_template: 'Classify: {text}' -> 'Label: {text}'
        >>> describe_changes({"model": "m"}, {"model": "m"})
        []
    """
    lines: list[str] = []
    _compare(dict(make_fingerprint(**old)), dict(make_fingerprint(**new)), "", lines)
    return lines


def _compare(old: dict[str, Any], new: dict[str, Any], prefix: str, lines: list[str]) -> None:
    for key in sorted(old.keys() | new.keys()):
        name = f"{prefix}{key}"
        if key not in old:
            lines.append(f"{name}: added {_show(new[key])}")
        elif key not in new:
            lines.append(f"{name}: removed (was {_show(old[key])})")
        elif isinstance(old[key], dict) and isinstance(new[key], dict):
            _compare(old[key], new[key], f"{name}.", lines)
        elif _canonical(old[key]) != _canonical(new[key]):
            before, after = _show_pair(old[key], new[key])
            lines.append(f"{name}: {before} -> {after}")


def _canonical(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def _text(value: Any) -> str:
    """A value as shown to a user: strings quoted and escaped, everything else as JSON."""
    return repr(value) if isinstance(value, str) else _canonical(value).decode()


def _show(value: Any) -> str:
    text = _text(value)
    return text if len(text) <= _SHORT else text[: _SHORT - 1] + "…"


def _show_pair(old: Any, new: Any) -> tuple[str, str]:
    """Both values, cut to a window that starts just before their first difference."""
    before, after = _text(old), _text(new)
    if len(before) <= _SHORT and len(after) <= _SHORT:
        return before, after
    same = 0
    for a, b in zip(before, after, strict=False):
        if a != b:
            break
        same += 1
    start = max(0, same - _CONTEXT)
    return _window(before, start), _window(after, start)


def _window(text: str, start: int) -> str:
    head = "…" if start else ""
    body = text[start : start + _SHORT - len(head)]
    tail = "…" if start + len(body) < len(text) else ""
    if tail:
        body = body[:-1]
    return head + body + tail


JOB_FORMAT_VERSION = 1
"""The version of the ``job.json`` layout this code writes and reads."""


def job_record(
    previous: Mapping[str, Any] | None,
    fingerprint: Mapping[str, Any],
    *,
    where: str,
    now: str,
    force: bool = False,
    identity: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """What a run directory's ``job.json`` says once a run with ``fingerprint`` starts.

    A pure function: the caller reads and writes the file.

    Args:
        previous: The directory's record so far, or None for a new directory.
        fingerprint: The settings of the run that starts (see :func:`make_fingerprint`).
        where: The directory, for messages.
        now: The time of the start, an ISO 8601 string.
        force: Accept a fingerprint that differs from the recorded one; the old one
            moves to ``history``.
        identity: What identifies the run's input
            (:meth:`~llm_annotator.jobs.rows.inputs.InputIdentity.to_json`: ``where``,
            ``rows``, ``digest``), or None to leave the recorded one as it is. Another
            input is recorded, never refused (the old one moves to ``input_history``):
            the job compares its rows with the records.

    Returns:
        The new record: ``format_version``, ``fingerprint``, ``digest``, ``created``,
        ``updated``, ``history`` (earlier fingerprints, each with when it was
        replaced), and with an input ``input``, ``input_history`` and
        ``mixed_inputs``: true once the directory may hold results of rows that are
        not in the current input (a change of input, or a directory made before
        inputs were recorded), so that only the current input's rows are
        consolidated.

    Raises:
        FingerprintMismatchError: If the fingerprints differ and ``force`` is False.
        JobError: If the record was written by a newer version of this package.

    Examples:
        >>> first = job_record(None, {"model": "a"}, where="out", now="t0")
        >>> job_record(first, {"model": "a"}, where="out", now="t1")["updated"]
        't1'
        >>> job_record(first, {"model": "b"}, where="out", now="t1")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.FingerprintMismatchError: out holds results made with other settings:
          model: 'a' -> 'b'
        Pass force=True (CLI --force) to resume anyway, or choose a new output directory.
    """
    canonical = make_fingerprint(**fingerprint)
    digest = fingerprint_digest(canonical)
    if previous is None:
        record: dict[str, Any] = {
            "format_version": JOB_FORMAT_VERSION,
            "fingerprint": canonical,
            "digest": digest,
            "created": now,
            "updated": now,
            "history": [],
        }
        if identity is not None:
            record.update(input=dict(identity), input_history=[], mixed_inputs=False)
        return record
    version = previous.get("format_version", JOB_FORMAT_VERSION)
    if not isinstance(version, int) or version > JOB_FORMAT_VERSION:
        raise JobError(
            f"{where} was made by a newer llm-annotator (job format {version!r}, this one "
            f"reads {JOB_FORMAT_VERSION}); upgrade, or choose a new output directory"
        )
    record = dict(previous)
    old = dict(previous.get("fingerprint") or {})
    history = list(previous.get("history") or [])
    old_digest = fingerprint_digest(old)
    changes = describe_changes(old, canonical) if old_digest != digest else []
    recorded = previous.get("input")
    old_input: Mapping[str, Any] | None = recorded if isinstance(recorded, Mapping) else None
    input_changed = (
        identity is not None
        and old_input is not None
        and old_input.get("digest") != identity.get("digest")
    )
    if identity is not None and old_input is not None and input_changed:
        # Not refused: the job compares the rows themselves (jobs/rundir/changes.py).
        log.info(
            "input_replaced",
            output_dir=where,
            old=_input_text(old_input),
            new=_input_text(identity),
        )
    if changes:
        if not force:
            listed = "".join(f"\n  {line}" for line in changes)
            hint = "Pass force=True (CLI --force) to resume anyway"
            trial = old.get("sample")
            if trial and all(line.startswith("sample") for line in changes):
                hint = (
                    f"It holds a trial run on a sample of the input ({_show(trial)}"
                    "). Pass force=True (CLI --force) to go on from it: the rows done are "
                    "kept and only the others are sent"
                )
            raise FingerprintMismatchError(
                f"{where} holds results made with other settings:{listed}\n"
                f"{hint}, or choose a new output directory.",
                changes=changes,
            )
        log.warning("fingerprint_changed_forced", output_dir=where, changes=changes)
        if old_digest != digest:
            history.append({"fingerprint": old, "digest": old_digest, "replaced": now})
    if identity is not None:
        inputs = list(previous.get("input_history") or [])
        mixed = bool(previous.get("mixed_inputs")) or input_changed or old_input is None
        if old_input is not None and input_changed:
            inputs.append({**old_input, "replaced": now})
        record.update(input=dict(identity), input_history=inputs, mixed_inputs=mixed)
    record.update(
        format_version=JOB_FORMAT_VERSION,
        fingerprint=canonical,
        digest=digest,
        updated=now,
        history=history,
    )
    record.setdefault("created", now)
    return record


def _input_text(identity: Mapping[str, Any]) -> str:
    """An input as a change line shows it: where (whole: it names the input), its rows,
    the start of its digest."""
    where = identity.get("where")
    shown = where if isinstance(where, str) else "an input"
    digest = str(identity.get("digest"))[:12]
    return f"{shown} ({identity.get('rows')} rows, digest {digest})"


def read_job_record(path: Path, *, force: bool = False) -> dict[str, Any] | None:
    """A run directory's ``job.json``; None if it has none (or, with ``force``, a broken one).

    The record is checked: a JSON object with a ``fingerprint`` object, and the other
    fields a job writes (``format_version``, ``history``, ``input``, ...) of their types.

    Raises:
        RunDirectoryError: If the file is not a job record and ``force`` is False (the
            message names the file and what is wrong), or, even with ``force``, if it is
            a link or not a regular file (nothing is written over it then).
    """
    from llm_annotator.errors import RunDirectoryError
    from llm_annotator.jobs.files import read_bytes

    fields: dict[str, tuple[type, str]] = {
        "format_version": (int, "an integer from 1"),
        "digest": (str, "a string"),
        "created": (str, "a string"),
        "updated": (str, "a string"),
        "history": (list, "a list of objects"),
        "input": (dict, "an object"),
        "input_history": (list, "a list of objects"),
        "mixed_inputs": (bool, "true or false"),
    }

    def problem_of(job: Any) -> str | None:
        if not isinstance(job, dict):
            return f"a JSON {type(job).__name__}, not an object"
        if not isinstance(job.get("fingerprint"), dict):
            return "no fingerprint in it"
        for name, (kind, words) in fields.items():
            value: Any = job.get(name)
            if name not in job or (value is None and name != "format_version"):
                continue
            wrong = not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)
            if kind is int and not wrong:
                wrong = value < 1
            if kind is list and not wrong:
                wrong = not all(isinstance(entry, dict) for entry in value)
            if wrong:
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
                return f"its {name} is {shown}, not {words}"
        return None

    problem: str | None
    try:
        data = read_bytes(path)
    except OSError as error:
        problem = f"cannot read it: {error.strerror or error}"
    else:
        if data is None:
            return None
        try:
            job = orjson.loads(data)
        except orjson.JSONDecodeError as error:
            problem = f"not JSON: {error}"
        else:
            problem = problem_of(job)
            if problem is None:
                record: dict[str, Any] = job
                return record
    if not force:
        raise RunDirectoryError(
            f"{path} is not a readable job record ({problem}); restore it, or pass "
            "force=True (CLI --force) to record the current settings",
            path=str(path),
        )
    log.warning("job_record_replaced", path=str(path), problem=problem)
    return None
