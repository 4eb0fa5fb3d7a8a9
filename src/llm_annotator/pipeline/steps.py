"""The steps of a pipeline: what each one asks, of what rows, checked as a whole."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from llm_annotator._job_options import STEP_OPTIONS
from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs.rundir.fingerprint import fingerprint_digest, make_fingerprint
from llm_annotator.jobs.spec import JobArgs, Postprocess, Validate, option_field, validator_name
from llm_annotator.pipeline.where import Where

Preprocess = Callable[[dict[str, Any]], "dict[str, Any] | None"]
"""A user's row hook: a row's columns in; the row to send (a dict), or None to leave the
row out of the step."""
GENERATED_PROMPT = "{prompt}"
"""The template of a generation step that gives none: the prompt as it is."""
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


@dataclass(frozen=True, slots=True)
class Step:
    """One annotation step of a :class:`~llm_annotator.pipeline.Pipeline`.

    A step reads exactly one of: ``data`` (a dataset or corpus, as
    :meth:`Annotator.annotate` takes it), ``from_step`` (the rows an earlier step
    answered without error, with that step's columns), or ``prompts`` (generation
    without a dataset). Its results are a job of their own, in
    ``OUTPUT_DIR/steps/NAME``.

    Args:
        name: The step's name: letters, digits, ``_`` and ``-``, starting with a letter.
        prompt_template: The user message with ``{column}`` fields; for a generation
            step, by default ``{prompt}``.
        data: The dataset the step reads.
        from_step: The earlier step whose answered rows the step reads. Its answer
            columns are renamed ``<step>_response`` (and ``<step>_validated``,
            ``<step>_input_file``); the fields of its output schema or ``validate``
            keep their names. Its bookkeeping columns (tokens, server, ...) are left out.
        where: A filter on the rows read, such as ``"sentiment == 'negative'"`` (see
            :class:`~llm_annotator.pipeline.where.Where`).
        prompts: Generation: the prompts, each a row ``{"prompt": text}``.
        copies: Generation: each prompt this many times (``prompt_id`` counts them all).
        n: Answers per row: each row becomes ``n`` rows with the id
            ``"<prompt_id>:<answer_index>"`` and the columns ``prompt_id`` and
            ``answer_index``, each sent and stored once like any row.
        preprocess: Called with each row's columns before it is sent; returns the
            columns to use, or None to leave the row out.
        postprocess: Called with each accepted answer (see
            :data:`~llm_annotator.jobs.spec.Postprocess`).
        servers: The name of the client (a server group) that answers this step, as
            given to :meth:`Pipeline.run`; None for the default one.
        system_message: As for :meth:`Annotator.annotate`.
        id_column: As for :meth:`Annotator.annotate` (for ``data`` only).
        options: As for :meth:`Annotator.annotate`.
        gen_kwargs: As for :meth:`Annotator.annotate`.
        columns: As for :meth:`Annotator.annotate`.
        validate: As for :meth:`Annotator.annotate`.
        max_regenerations: As for :meth:`Annotator.annotate`.
        retry_errors: As for :meth:`Annotator.annotate`.
        write_jsonl: As for :meth:`Annotator.annotate`.
        group_by: As for :meth:`Annotator.annotate`.
        skip_bad_files: As for :meth:`Annotator.annotate` (for a corpus ``data``).

    Raises:
        ConfigurationError: A bad name, no input or more than one, or a setting the
            step's kind of input does not take.

    Examples:
        >>> Step("label", "Positive or negative? {text}", data="reviews.jsonl").reads
        'data'
        >>> Step("ideas", prompts=["Name a fruit."], copies=3, n=2).rows_per_prompt
        2
        >>> Step("judge", "Fair? {text}", data="x.jsonl", from_step="label")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: step 'judge': give one of data, from_step ...
    """

    name: str
    prompt_template: str | None = None
    data: Any = None
    from_step: str | None = None
    where: str | None = None
    prompts: Sequence[str] | None = None
    copies: int = 1
    n: int = 1
    preprocess: Preprocess | None = None
    postprocess: Postprocess | None = option_field("postprocess")  # noqa: RUF009 (a field)
    servers: str | None = None
    # The job options a step takes (STEP_OPTIONS), each with its declared default:
    system_message: str | None = option_field("system_message")
    id_column: str | None = option_field("id_column")
    options: Any = option_field("options")  # noqa: RUF009 (a field)
    gen_kwargs: dict[str, Any] | None = option_field("gen_kwargs")  # noqa: RUF009 (a field)
    columns: Sequence[str] | None = option_field("columns")
    validate: Validate | None = option_field("validate")  # noqa: RUF009 (a field)
    max_regenerations: int = option_field("max_regenerations")
    retry_errors: bool | Collection[str] = option_field("retry_errors")
    write_jsonl: bool = option_field("write_jsonl")
    group_by: str | None = option_field("group_by")
    skip_bad_files: bool = option_field("skip_bad_files")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ConfigurationError(
                f"a step's name must be letters, digits, _ and -, starting with a letter "
                f"(at most 64), got {self.name!r}"
            )
        said = f"step {self.name!r}"
        given = [
            kind
            for kind, value in (
                ("data", self.data),
                ("from_step", self.from_step),
                ("prompts", self.prompts),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ConfigurationError(
                f"{said}: give one of data, from_step or prompts (what the step reads), "
                f"got {', '.join(given) or 'none'}"
            )
        if self.prompts is not None:
            if isinstance(self.prompts, str) or not self.prompts:
                raise ConfigurationError(f"{said}: prompts must be a non-empty list of strings")
            if not all(isinstance(p, str) and p for p in self.prompts):
                raise ConfigurationError(f"{said}: every prompt must be a non-empty string")
            if self.id_column is not None:
                raise ConfigurationError(
                    f"{said}: a generation step numbers its prompts; leave out id_column"
                )
        elif self.copies != 1:
            raise ConfigurationError(f"{said}: copies is for a generation step (prompts)")
        if self.prompt_template is None and self.prompts is None:
            raise ConfigurationError(f"{said}: give a prompt_template")
        if self.from_step is not None and self.id_column is not None:
            raise ConfigurationError(
                f"{said}: a step from another keeps that step's ids; leave out id_column"
            )
        for what, number in (("n", self.n), ("copies", self.copies)):
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise ConfigurationError(f"{said}: {what} must be an integer >= 1, got {number!r}")
        for what, hook in (
            ("preprocess", self.preprocess),
            ("postprocess", self.postprocess),
            ("validate", self.validate),
        ):
            if hook is not None and not callable(hook):
                raise ConfigurationError(f"{said}: {what} must be a callable, got {hook!r}")
        if self.where is not None:
            try:
                Where(self.where)
            except ConfigurationError as error:
                raise ConfigurationError(f"{said}: {error}") from None
        seed = (self.gen_kwargs or {}).get("seed", getattr(self.options, "seed", None))
        if seed is not None and (self.n > 1 or (self.prompts is not None and self.copies > 1)):
            raise ConfigurationError(
                f"{said}: a fixed seed would give the same answer to every copy of a "
                "prompt (n > 1 or copies > 1); leave out seed"
            )

    def job_args(self) -> JobArgs:
        """The job options the step gives its job (each of ``STEP_OPTIONS``), as the
        keywords of :meth:`Annotator.annotate`; the pipeline then sets what its own
        rows change (the id column, the columns kept).

        Examples:
            >>> job = Step("label", "{text}", data="d.jsonl", system_message="Be brief.").job_args()
            >>> job["system_message"], job["max_regenerations"]
            ('Be brief.', 2)
        """
        return cast("JobArgs", {name: getattr(self, name) for name in STEP_OPTIONS})

    @property
    def reads(self) -> str:
        """What the step reads: ``"data"``, ``"step"`` or ``"prompts"``."""
        if self.data is not None:
            return "data"
        return "step" if self.from_step is not None else "prompts"

    @property
    def template(self) -> str:
        """The prompt template the step's job renders."""
        return self.prompt_template if self.prompt_template is not None else GENERATED_PROMPT

    @property
    def rows_per_prompt(self) -> int:
        """Rows each input row becomes (``n``)."""
        return self.n

    @property
    def rewrites_input(self) -> bool:
        """Whether the step's rows are written out before its job (anything but a
        dataset read as it is)."""
        return (
            self.reads != "data"
            or self.where is not None
            or self.preprocess is not None
            or self.n > 1
        )

    def describe_input(self) -> str:
        """What the step reads, in words.

        Examples:
            >>> Step("j", "Fair? {x}", from_step="label", where="y == 1").describe_input()
            'the rows of step label where y == 1'
            >>> Step("g", prompts=["a", "b"], copies=5, n=2).describe_input()
            '2 prompts x 5 copies, 2 answers each'
        """
        if self.reads == "prompts":
            assert self.prompts is not None
            text = f"{len(self.prompts)} prompt{'s' if len(self.prompts) != 1 else ''}"
            if self.copies > 1:
                text += f" x {self.copies} copies"
        elif self.reads == "step":
            text = f"the rows of step {self.from_step}"
        else:
            text = f"the dataset {_shown(self.data)}"
        if self.where is not None:
            text += f" where {self.where}"
        if self.n > 1:
            text += f", {self.n} answers each"
        return text

    def settings(self, upstream: str | None, identity: Any = None) -> dict[str, Any]:
        """What defines the step's results, as a fingerprint (``upstream``: the key of
        the step it reads, which changes when that step is redone; ``identity``: what
        says its dataset changed, see :func:`~llm_annotator.pipeline.inputs.data_identity`).

        Raises:
            ConfigurationError: A setting cannot be part of a fingerprint.
        """
        options = self.options.to_payload() if self.options is not None else {}
        extras: dict[str, Any] = {}
        for what, hook in (
            ("validate", self.validate),
            ("preprocess", self.preprocess),
            ("postprocess", self.postprocess),
        ):
            if hook is not None:
                extras[what] = validator_name(hook)
        return make_fingerprint(
            reads=self.reads,
            data=_shown(self.data) if self.data is not None else None,
            data_identity=identity,
            from_step=self.from_step,
            upstream=upstream,
            prompts=list(self.prompts) if self.prompts is not None else None,
            copies=self.copies,
            n=self.n,
            where=self.where,
            prompt_template=self.template,
            system_message=self.system_message,
            options=options,
            gen_kwargs=self.gen_kwargs or {},
            output_schema=getattr(self.options, "output_schema", None),
            id_column=self.id_column,
            columns=list(self.columns) if self.columns is not None else None,
            max_regenerations=self.max_regenerations,
            **extras,
        )


def step_key(settings: Mapping[str, Any]) -> str:
    """A step's key: the digest of its settings (16 hex digits)."""
    return fingerprint_digest(settings)[:16]


def ordered(steps: Sequence[Step]) -> list[Step]:
    """The steps in an order that runs each after the step it reads (the given order
    where it allows).

    Raises:
        ConfigurationError: Two steps share a name, a step reads one that does not
            exist, or steps read each other in a cycle; the message names them.

    Examples:
        >>> steps = [Step("b", "{x}", from_step="a"), Step("a", "{x}", data="d.jsonl")]
        >>> [step.name for step in ordered(steps)]
        ['a', 'b']
        >>> ordered([Step("a", "{x}", from_step="b"), Step("b", "{x}", from_step="a")])
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: steps read each other in a cycle: a -> b -> a
    """
    if not steps:
        raise ConfigurationError("a pipeline needs at least one step")
    by_name: dict[str, Step] = {}
    for step in steps:
        if not isinstance(step, Step):
            raise ConfigurationError(f"a pipeline's steps are Step objects, got {step!r}")
        if step.name in by_name:
            raise ConfigurationError(f"two steps are named {step.name!r}")
        by_name[step.name] = step
    for step in steps:
        if step.from_step is not None and step.from_step not in by_name:
            raise ConfigurationError(
                f"step {step.name!r} reads from_step {step.from_step!r}, which is not a "
                f"step; the steps are {', '.join(by_name)}"
            )
    placed: dict[str, Step] = {}
    for step in steps:
        chain: list[str] = []
        current: Step | None = step
        while current is not None and current.name not in placed:
            if current.name in chain:
                cycle = [*chain[chain.index(current.name) :], current.name]
                raise ConfigurationError(f"steps read each other in a cycle: {' -> '.join(cycle)}")
            chain.append(current.name)
            current = by_name[current.from_step] if current.from_step is not None else None
        for name in reversed(chain):
            placed[name] = by_name[name]
    return list(placed.values())


def _shown(data: Any) -> Any:
    """A dataset as a step's settings and messages show it: paths as given; other data
    (a list of dicts, a Dataset) by its kind and size."""
    if isinstance(data, str):
        return data
    if hasattr(data, "__fspath__"):
        return str(data)
    if isinstance(data, list | tuple) and all(
        isinstance(p, str) or hasattr(p, "__fspath__") for p in data
    ):
        return [str(p) for p in data]
    size = len(data) if hasattr(data, "__len__") else "?"
    return f"<{type(data).__name__} of {size} rows>"
