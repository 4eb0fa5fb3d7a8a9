"""The arguments of one annotation job, written once."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from llm_annotator._constants import MAX_REGENERATIONS


class JobArgs(TypedDict, total=False):
    """The keyword arguments of a job, written once: :meth:`Annotator.annotate` takes
    them, and ``VLLMQueueAnnotator.annotate`` forwards them (see there for each)."""

    system_message: str | None
    id_column: str | None
    options: Any
    gen_kwargs: dict[str, Any] | None
    columns: Sequence[str] | None
    retry_errors: bool
    force: bool
    write_jsonl: bool
    max_regenerations: int


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
    retry_errors: bool = False
    force: bool = False
    write_jsonl: bool = False
    max_regenerations: int = MAX_REGENERATIONS

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
"""The keyword arguments of a job (``tests/unit/test_annotate.py`` checks that
:class:`JobSpec` has the same)."""
