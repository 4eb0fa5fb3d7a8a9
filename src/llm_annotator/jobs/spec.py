"""The arguments of one annotation job, written once."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypedDict, TypeVar

from llm_annotator._job_options import OPTIONS as OPTIONS
from llm_annotator._job_options import JobOption as JobOption
from llm_annotator.errors import ConfigurationError, ErrorKind

Validate = Callable[[str], Any]
"""A user's answer check: the answer text in, the parsed value out (a dict becomes
columns), or an exception when the answer is not acceptable."""
Postprocess = Callable[[dict[str, Any], Any], "Mapping[str, Any] | None"]
"""A user's answer hook: a row's input columns and its accepted answer (the parsed
values with an output schema or ``validate``, else the text) in; columns to add to the
row's output out (or None). An exception makes the answer invalid, as a ``validate``
refusal does."""


class JobArgs(TypedDict, total=False):
    """The types of the job options, as keywords: :meth:`Annotator.annotate` takes them,
    and ``VLLMQueueAnnotator.annotate`` forwards them. Each option is declared in
    :data:`OPTIONS` (its default, what it does, where it may be given); the parity
    tests hold these keys to it."""

    system_message: str | None
    id_column: str | None
    options: Any
    gen_kwargs: dict[str, Any] | None
    columns: Sequence[str] | None
    retry_errors: bool | Collection[str]
    force: bool
    write_jsonl: bool
    max_regenerations: int
    limit: int | None
    shuffle_seed: int | None
    validate: Validate | None
    shard: Any
    skip_bad_files: bool
    claim_lease: float | None
    unit_size: int | str | None
    group_by: str | None
    postprocess: Postprocess | None


def option_field(name: str) -> Any:
    """The dataclass field of job option ``name``: its declared default, with its
    declaration (a :class:`JobOption`) as the field's ``metadata["option"]``.

    Raises:
        KeyError: No job option has that name.
    """
    option = OPTIONS[name]
    return field(default=option.default, metadata={"option": option})


class AnnotatorArgs(TypedDict, total=False):
    """The settings of the :class:`Annotator` that runs a job, as keywords:
    ``VLLMQueueAnnotator.annotate`` takes them besides the job options and makes its
    Annotator with them (see :class:`Annotator` for each and its default)."""

    progress: bool | None
    stop_grace: float
    flush_interval: float
    sync_interval: float
    metrics_port: int | None
    metrics_host: str
    timeline: bool


class PoolJobArgs(AnnotatorArgs, JobArgs, total=False):
    """The keywords of ``VLLMQueueAnnotator.annotate``: the Annotator's settings
    (:class:`AnnotatorArgs`) and the job options (:class:`JobArgs`)."""


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What defines one job: the arguments of :meth:`Annotator.annotate`. Each option
    field takes its default from its declaration in :data:`OPTIONS`
    (:class:`JobArgs` types the keywords)."""

    data: Any
    prompt_template: str
    output_dir: Path
    system_message: str | None = option_field("system_message")
    id_column: str | None = option_field("id_column")
    options: Any = option_field("options")  # noqa: RUF009 (a field)
    gen_kwargs: dict[str, Any] | None = option_field("gen_kwargs")  # noqa: RUF009 (a field)
    columns: Sequence[str] | None = option_field("columns")
    retry_errors: bool | Collection[str] = option_field("retry_errors")
    force: bool = option_field("force")
    write_jsonl: bool = option_field("write_jsonl")
    max_regenerations: int = option_field("max_regenerations")
    limit: int | None = option_field("limit")
    shuffle_seed: int | None = option_field("shuffle_seed")
    validate: Validate | None = option_field("validate")  # noqa: RUF009 (a field)
    shard: Any = option_field("shard")  # noqa: RUF009 (a field)
    skip_bad_files: bool = option_field("skip_bad_files")
    claim_lease: float | None = option_field("claim_lease")
    unit_size: int | str | None = option_field("unit_size")
    group_by: str | None = option_field("group_by")
    postprocess: Postprocess | None = option_field("postprocess")  # noqa: RUF009 (a field)

    @property
    def checks_answers(self) -> bool:
        """Whether a user's callable checks or extends each answer (``validate`` or
        ``postprocess``): the output then has a ``valid`` column."""
        return self.validate is not None or self.postprocess is not None

    def hook_names(self) -> dict[str, str]:
        """The fingerprint entries of the user's callables, by name (none when unused,
        so that a job without them keeps the fingerprint it had before they existed).

        Raises:
            ConfigurationError: One of them is not callable.
        """
        names: dict[str, str] = {}
        for what, hook in (("validate", self.validate), ("postprocess", self.postprocess)):
            if hook is None:
                continue
            if not callable(hook):
                raise ConfigurationError(f"{what} must be a callable, got {hook!r}")
            names[what] = validator_name(hook)
        return names

    @classmethod
    def of(
        cls,
        data: Any,
        prompt_template: str,
        output_dir: str | os.PathLike[str],
        job: Mapping[str, Any],
    ) -> JobSpec:
        """The spec of a call's arguments.

        Raises:
            TypeError: If ``job`` names an argument that does not exist.
        """
        unknown = sorted(set(job) - _JOB_ARGS)
        if unknown:
            raise TypeError(
                f"annotate() got unexpected keyword arguments {unknown}; "
                f"it takes {sorted(_JOB_ARGS)}"
            )
        return cls(data, prompt_template, Path(output_dir), **job)


_JOB_ARGS = frozenset(OPTIONS)
"""The keyword arguments of a job (``tests/unit/test_job_options.py`` checks that
:class:`JobSpec` and :class:`JobArgs` have the same)."""

ANNOTATOR_ARGS = frozenset(AnnotatorArgs.__annotations__)
"""The keywords of ``VLLMQueueAnnotator.annotate`` that make its :class:`Annotator`."""

_F = TypeVar("_F", bound=Callable[..., Any])

OPTIONS_DOC = "Every job option, from its declaration in :mod:`llm_annotator.jobs.spec`."
"""The line of a docstring that :func:`documents_options` replaces."""


def documents_options(function: _F) -> _F:
    """Write the job options into ``function``'s docstring, each with its type and
    what it does, in place of its line :data:`OPTIONS_DOC` (a Google-style
    "Other Parameters" entry each).

    Examples:
        >>> def f(**job):
        ...     '''Other Parameters:
        ...         Every job option, from its declaration in :mod:`llm_annotator.jobs.spec`.
        ...     '''
        >>> print(documents_options(f).__doc__.splitlines()[1])
            system_message (str | None): A system message for every row, or None.
    """
    doc = function.__doc__
    if not doc or OPTIONS_DOC not in doc:
        return function
    before, _, after = doc.partition(OPTIONS_DOC)
    indent = before[before.rfind("\n") + 1 :]
    lines: list[str] = []
    for spec_field in fields(JobSpec):
        option: JobOption | None = spec_field.metadata.get("option")
        if option is not None:
            lines += _entry(option, str(spec_field.type), indent)
    function.__doc__ = before + "\n".join(lines)[len(indent) :] + after
    return function


def _entry(option: JobOption, shown_type: str, indent: str, width: int = 88) -> list[str]:
    """One option's docstring entry, wrapped: ``name (type): what it does``."""
    words = f"{option.name} ({shown_type}): {option.doc}".split(" ")
    lines = [indent + words[0]]
    for word in words[1:]:
        if len(lines[-1]) + 1 + len(word) > width:
            lines.append(indent + "    " + word)
        else:
            lines[-1] += " " + word
    return lines


ERROR_TYPES = frozenset(kind.value for kind in ErrorKind)
"""Every ``error_type`` an error row can have."""


def retry_choice(value: bool | Collection[str]) -> bool | frozenset[str]:
    """``retry_errors`` as the store takes it: False, True (every error row), or the
    error types to send again (an empty list: none).

    Raises:
        ConfigurationError: A type that no error row can have; the message lists them.

    Examples:
        >>> retry_choice(True), retry_choice([])
        (True, False)
        >>> sorted(retry_choice(["read_timeout", "server_error"]))
        ['read_timeout', 'server_error']
        >>> retry_choice(["timeout"])
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: retry_errors: unknown error type 'timeout'; ...
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str) or not isinstance(value, Collection):
        raise ConfigurationError(
            f"retry_errors must be True, False or a list of error types, got {value!r}"
        )
    types = frozenset(value)
    if not types:
        return False
    unknown = sorted(str(t) for t in types if t not in ERROR_TYPES)
    if unknown:
        raise ConfigurationError(
            f"retry_errors: unknown error type {unknown[0]!r}; the error types are "
            f"{', '.join(sorted(ERROR_TYPES))}"
        )
    return types


def validator_name(validate: Callable[..., Any]) -> str:
    """How the fingerprint names a user's callable (``validate``, a hook):
    ``module:qualified.name``.

    Examples:
        >>> import json
        >>> validator_name(json.loads)
        'json:loads'
    """
    module = getattr(validate, "__module__", None) or "?"
    name = getattr(validate, "__qualname__", None) or type(validate).__qualname__
    return f"{module}:{name}"
