"""Prompt templates: ``{column}`` fields filled from a row, checked once, rendered safely.

A template uses :meth:`str.format` syntax, but only the plain part of it: each field names
one column of the row. The template is parsed once; rendering joins its literal text
with the row's values and never hands the template to ``str.format``, so a field cannot
reach into a value's attributes or items (``{text.__class__}`` is refused up front).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from string import Formatter
from typing import Any, Protocol

import orjson

from llm_annotator.errors import InputError, PromptError

_CONVERSIONS: dict[str, Callable[[object], str]] = {"r": repr, "s": str, "a": ascii}
_MAX_LISTED_COLUMNS = 30

# One field of a template: (column, conversion, format spec, literal text that follows).
_Step = tuple[str, str | None, str, str]


class PromptTemplate:
    """A prompt with ``{column}`` fields, filled from each row.

    Allowed: ``{text}``, a conversion (``{text!r}``), a format spec on the value
    (``{score:.2f}``, ``{name:>10}``), and ``{{`` / ``}}`` for literal braces. Refused:
    positional fields (``{}``, ``{0}``), fields that reach into a value (``{a.b}``,
    ``{a[0]}``), nested specs (``{a:{width}}``) and a template with no field at all.

    Attributes:
        template: The template as given.
        fields: The columns it uses, each once, in order of first use.

    Raises:
        PromptError: The template is not valid or uses a refused form.

    Examples:
        >>> template = PromptTemplate("Classify the sentiment of: {text}")
        >>> template.fields
        ('text',)
        >>> template.render({"text": "I loved it", "id": 3})
        'Classify the sentiment of: I loved it'
        >>> PromptTemplate("{{literal}} {score:.1f} {tags}").render({"score": 0.25, "tags": ["a"]})
        '{literal} 0.2 ["a"]'
    """

    __slots__ = ("_head", "_steps", "fields", "template")

    def __init__(self, template: str) -> None:
        if not isinstance(template, str):
            raise PromptError(f"prompt_template must be a str, not {type(template).__name__}")
        try:
            parsed = list(Formatter().parse(template))
        except ValueError as exc:
            raise PromptError(
                f"prompt_template is not a valid template ({exc}): {template!r}; "
                "write {{ and }} for literal braces"
            ) from exc
        head = ""
        steps: list[list[Any]] = []
        for literal, field, spec, conversion in parsed:
            if steps:
                steps[-1][3] += literal
            else:
                head += literal
            if field is None:
                continue
            _check_field(template, field, spec or "", conversion)
            steps.append([field, conversion, spec or "", ""])
        if not steps:
            raise PromptError(
                f"the prompt_template uses no column, so every row would get the same prompt: "
                f"{template!r}; name a column in braces, e.g. 'Classify: {{text}}'"
            )
        self.template = template
        self.fields: tuple[str, ...] = tuple(dict.fromkeys(step[0] for step in steps))
        self._head = head
        self._steps: tuple[_Step, ...] = tuple((s[0], s[1], s[2], s[3]) for s in steps)

    def __repr__(self) -> str:
        return f"PromptTemplate({self.template!r})"

    @property
    def head(self) -> str:
        """The text before the first field: every prompt starts with it.

        Examples:
            >>> PromptTemplate("Rate this review: {text} (1 to 5)").head
            'Rate this review: '
        """
        return self._head

    def check_columns(self, columns: Iterable[str], where: str) -> None:
        """Check that every field of the template is one of ``columns``.

        Args:
            columns: The columns the input has.
            where: What the columns belong to (e.g. the input file), for the message.

        Raises:
            PromptError: Naming the unknown fields, ``where`` and the available columns.

        Examples:
            >>> PromptTemplate("{txt}").check_columns(["id", "text"], "data.csv")
            Traceback (most recent call last):
            ...
            llm_annotator.errors.PromptError: the prompt_template uses {txt}, but data.csv \
has no column 'txt' (did you mean 'text'?); its columns: id, text
        """
        available = list(columns)
        known = set(available)
        unknown = [field for field in self.fields if field not in known]
        if not unknown:
            return
        uses = ", ".join(f"{{{field}}}" for field in unknown)
        names = ", ".join(repr(field) for field in unknown)
        plural = "s" if len(unknown) > 1 else ""
        hints = [
            repr(match)
            for name in unknown
            for match in difflib.get_close_matches(name, available, 1)
        ]
        hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
        raise PromptError(
            f"the prompt_template uses {uses}, but {where} has no column{plural} {names}"
            f"{hint}; its columns: {_list_columns(available)}"
        )

    def render(self, values: Mapping[str, Any], where: str = "") -> str:
        """The prompt for one row.

        Strings are used as they are; lists, tuples and dicts as JSON; other values as
        ``str(value)``. A conversion or a format spec applies to the value itself.

        Args:
            values: The row's columns.
            where: Where the row is (e.g. ``"data.jsonl line 18"``), for the message.

        Returns:
            The prompt text.

        Raises:
            PromptError: A field is missing or None in this row, or its format spec does
                not fit the value; the message names ``where``, the field and the columns.

        Examples:
            >>> PromptTemplate("Rate: {review}").render({"stars": 4}, "list item 0")
            Traceback (most recent call last):
            ...
            llm_annotator.errors.PromptError: list item 0: the prompt_template uses {review}, \
but the row has no column 'review'; its columns: stars
        """
        parts = [self._head]
        for field, conversion, spec, literal in self._steps:
            try:
                value = values[field]
            except KeyError:
                raise self._row_error(values, where, field, "has no column") from None
            if type(value) is str and conversion is None and not spec:
                parts.append(value)
            elif value is None:
                raise self._row_error(values, where, field, "has null (None) in column")
            else:
                parts.append(self._format(value, conversion, spec, field, where))
            parts.append(literal)
        return "".join(parts)

    @staticmethod
    def _format(value: Any, conversion: str | None, spec: str, field: str, where: str) -> str:
        if conversion is not None:
            value = _CONVERSIONS[conversion](value)
        elif isinstance(value, list | tuple | dict):
            value = _to_json(value)
        try:
            return format(value, spec)
        except (ValueError, TypeError) as exc:
            prefix = f"{where}: " if where else ""
            raise PromptError(
                f"{prefix}the format spec of {{{field}:{spec}}} does not fit the value "
                f"{_short(value)} of type {type(value).__name__}: {exc}"
            ) from exc

    def _row_error(
        self, values: Mapping[str, Any], where: str, field: str, problem: str
    ) -> PromptError:
        prefix = f"{where}: " if where else ""
        return PromptError(
            f"{prefix}the prompt_template uses {{{field}}}, but the row {problem} {field!r}; "
            f"its columns: {_list_columns(list(values))}"
        )


def build_messages(prompt: str, system_message: str | None = None) -> list[dict[str, str]]:
    """The chat messages for one prompt: an optional system message, then the user's.

    Examples:
        >>> build_messages("Hi")
        [{'role': 'user', 'content': 'Hi'}]
        >>> [m["role"] for m in build_messages("Hi", "Be brief.")]
        ['system', 'user']
    """
    if system_message is None:
        return [{"role": "user", "content": prompt}]
    return [{"role": "system", "content": system_message}, {"role": "user", "content": prompt}]


def _check_field(template: str, field: str, spec: str, conversion: str | None) -> None:
    """Refuse the forms of a field that are not one plain column name."""
    if field == "" or field.isdigit():
        problem = "a positional field"
    elif "." in field or "[" in field:
        problem = "a field that reaches into a value (only whole columns can be used)"
    elif "{" in spec:
        problem = "a nested field inside a format spec"
    elif conversion is not None and conversion not in _CONVERSIONS:
        problem = f"an unknown conversion '!{conversion}' (use !r, !s or !a)"
    else:
        return
    shown = f"{{{field}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
    raise PromptError(
        f"prompt_template field {shown} is {problem}: {template!r}; "
        "write each field as {column_name}, and {{ or }} for literal braces"
    )


def _to_json(value: Any) -> str:
    try:
        return orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    except (TypeError, orjson.JSONEncodeError):
        return str(value)


def _list_columns(columns: list[str]) -> str:
    if not columns:
        return "(none)"
    shown = ", ".join(str(column) for column in columns[:_MAX_LISTED_COLUMNS])
    more = len(columns) - _MAX_LISTED_COLUMNS
    return f"{shown}, and {more} more" if more > 0 else shown


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Columns(Protocol):
    """An input that may say its columns up front (a row source)."""

    @property
    def columns(self) -> Sequence[str] | None: ...

    @property
    def description(self) -> str: ...


def check_job_columns(
    template: PromptTemplate,
    source: Columns,
    *,
    keep: Sequence[str] | None = None,
    group_by: str | None = None,
) -> None:
    """Check a job's use of an input's columns, where it says them up front: the
    template's fields, the columns to keep and the ``group_by`` column.

    Raises:
        PromptError: A template field names no column (see
            :meth:`PromptTemplate.check_columns`).
        InputError: A column to keep or the ``group_by`` column is not in ``columns``.

    Examples:
        >>> from types import SimpleNamespace
        >>> source = SimpleNamespace(columns=["text"], description="a.csv")
        >>> check_job_columns(PromptTemplate("{text}"), source, group_by="doc")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.InputError: a.csv: the group_by column 'doc' is not in the input; its columns are ['text']
    """  # noqa: E501
    if source.columns is None:
        return
    where = source.description
    template.check_columns(source.columns, where)
    available = list(source.columns)
    if keep is not None:
        unknown = [c for c in keep if c not in available]
        if unknown:
            raise InputError(
                f"{where}: columns to keep {unknown} are not in the input; "
                f"its columns are {available}"
            )
    if group_by is not None and group_by not in available:
        raise InputError(
            f"{where}: the group_by column {group_by!r} is not in the input; "
            f"its columns are {available}"
        )
