"""The arguments of one annotation job, written once."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from llm_annotator._constants import MAX_REGENERATIONS
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
    """The keyword arguments of a job, written once: :meth:`Annotator.annotate` takes
    them, and ``VLLMQueueAnnotator.annotate`` forwards them (see there for each)."""

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


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What defines one job: the arguments of :meth:`Annotator.annotate`, with their
    defaults, written once (:class:`JobArgs` types the keywords)."""

    data: Any
    prompt_template: str
    output_dir: Path
    system_message: str | None = None
    id_column: str | None = None
    options: Any = None
    gen_kwargs: dict[str, Any] | None = None
    columns: Sequence[str] | None = None
    retry_errors: bool | Collection[str] = False
    force: bool = False
    write_jsonl: bool = False
    max_regenerations: int = MAX_REGENERATIONS
    limit: int | None = None
    shuffle_seed: int | None = None
    validate: Validate | None = None
    shard: Any = None
    skip_bad_files: bool = False
    claim_lease: float | None = None
    unit_size: int | str | None = None
    group_by: str | None = None
    postprocess: Postprocess | None = None

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


_JOB_ARGS = frozenset(JobArgs.__annotations__)
"""The keyword arguments of a job (``tests/unit/jobs/test_annotate.py`` checks that
:class:`JobSpec` has the same)."""


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
