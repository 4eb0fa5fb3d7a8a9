"""The output row of an annotation job: the input's columns, the id, and the answer."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import orjson

from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs.answers.schema import OutputSchema, Parsed
from llm_annotator.jobs.ids import RowId
from llm_annotator.response import Response

ANSWER_COLUMNS: tuple[str, ...] = (
    "response",
    "finish_reason",
    "num_prompt_tokens",
    "num_output_tokens",
    "error",
    "error_type",
    "server",
    "model",
)
"""The columns every output row has besides its id and the input's columns."""
VALID_COLUMN = "valid"
"""With an output_schema or a validate check: whether the answer passed."""
VALIDATED_COLUMN = "validated"
"""With a validate check that returns something other than a dict: what it returned."""
INPUT_PREFIX = "input_"
"""Prefix given to an input column whose name is taken by an output column."""


class RecordBuilder:
    """Turns a row and its Response into one output record (a JSON-able dict).

    Output columns come first: ``id``, the answer's columns, then with an output
    schema its parsed fields and ``valid``. The input's columns follow (all of them, or
    ``columns``); one whose name an output column already uses gets the prefix
    ``input_``, so nothing the user passed in is lost or overwritten.

    A ``validate`` check's dict adds its keys as columns too (they may not name an
    output or input column).

    Args:
        schema: The output schema whose fields become columns, or None.
        columns: The input columns to keep, or None for all.
        validate: Whether the answers are checked by a ``validate`` callable.
        reserved: Further output columns that input columns must not take (a corpus
            job's ``input_file``).

    Examples:
        >>> builder = RecordBuilder(None, columns=None)
        >>> record = builder.build(3, {"text": "ok", "error": "x"}, Response(text="positive"))
        >>> record["id"], record["response"], record["error"], record["input_error"]
        (3, 'positive', None, 'x')
    """

    def __init__(
        self,
        schema: OutputSchema | None,
        columns: Sequence[str] | None,
        *,
        validate: bool = False,
        reserved: Collection[str] = (),
    ) -> None:
        self.schema = schema
        self.columns = tuple(columns) if columns is not None else None
        self.checked = schema is not None or validate
        taken = {"id", *ANSWER_COLUMNS, *reserved}
        if schema is not None:
            taken.update(schema.columns)
        if self.checked:
            taken.add(VALID_COLUMN)
        if validate:
            taken.add(VALIDATED_COLUMN)
        self.taken: Collection[str] = frozenset(taken)
        self._reserved = frozenset({"id", *ANSWER_COLUMNS, VALID_COLUMN, *reserved})

    def output_columns(self) -> list[str]:
        """The output columns known up front, in the order records list them."""
        names = ["id", *ANSWER_COLUMNS]
        if self.schema is not None:
            names += self.schema.columns
        if self.checked:
            names.append(VALID_COLUMN)
        return names

    def validated(
        self,
        value: Any,
        parsed: Parsed | None,
        inputs: Mapping[str, Any],
        check: str = "validate",
    ) -> dict[str, Any]:
        """The columns of what a ``validate`` check returned, after the schema's.

        Args:
            value: What the check returned.
            parsed: The schema's columns, if there is a schema.
            inputs: The row's input values (their names must not be the check's keys:
                the input column would then move between rows).
            check: Which callable returned it, for the message (``validate`` or
                ``postprocess``).

        Raises:
            ConfigurationError: The check returned a dict with a key that is not a
                string, names a column every row has (``id``, ``response``, ...), a
                schema field, or an input column kept in the output.

        Examples:
            >>> builder = RecordBuilder(None, None, validate=True)
            >>> builder.validated({"label": "pos", "score": 0.9}, None, {"text": "t"})
            {'label': 'pos', 'score': 0.9}
            >>> builder.validated(3, None, {})
            {'validated': 3}
            >>> builder.validated({"text": 1}, None, {"text": "t"})
            Traceback (most recent call last):
            ...
            llm_annotator.errors.ConfigurationError: validate returned a dict with the key ...
        """
        values = dict(parsed.values) if parsed is not None else {}
        if not isinstance(value, dict):
            values[VALIDATED_COLUMN] = value
            return values
        kept = self.columns if self.columns is not None else inputs.keys()
        for key in value:
            if not isinstance(key, str):
                why = "not a string"
            elif key in self._reserved or key == VALIDATED_COLUMN:
                why = f"a column every row has ({', '.join(sorted(self._reserved))})"
            elif key in values:
                why = "a field of the output_schema"
            elif key in kept:
                why = (
                    "also an input column kept in the output; rename the key, or leave "
                    "the column out with columns=[...] (CLI --columns)"
                )
            else:
                continue
            raise ConfigurationError(
                f"{check} returned a dict with the key {key!r}, which is {why}: its keys "
                "become columns of their own"
            )
        values.update(value)
        return values

    @staticmethod
    def empty_validated(parsed: Parsed | None) -> dict[str, Any]:
        """The columns of an answer a ``validate`` check refused: the schema's only."""
        return dict(parsed.values) if parsed is not None else {}

    def build(
        self,
        row_id: RowId,
        values: Mapping[str, Any],
        response: Response,
        parsed: Parsed | None = None,
    ) -> dict[str, Any]:
        """The record of one row."""
        record: dict[str, Any] = {
            "id": row_id,
            "response": response.text,
            "finish_reason": response.finish_reason,
            "num_prompt_tokens": response.num_prompt_tokens,
            "num_output_tokens": response.num_output_tokens,
            "error": response.error,
            "error_type": response.error_type,
            "server": response.server,
            "model": response.model,
        }
        if self.checked:
            if parsed is None:
                if self.schema is not None:
                    record.update(dict.fromkeys(self.schema.columns))
                record[VALID_COLUMN] = False
            else:
                record.update(parsed.values)
                record[VALID_COLUMN] = parsed.valid
        self._add_input(record, values)
        return record

    def error_record(self, row_id: RowId, values: Mapping[str, Any], error: str) -> dict[str, Any]:
        """The record of a row that could not be sent (unreadable, or no prompt)."""
        return self.build(row_id, values, Response(error=error, error_type="input_error"))

    def unstorable(self, values: Mapping[str, Any]) -> dict[str, str]:
        """The input columns of a row that its record would keep but the store cannot
        write (a lone surrogate, which is not valid Unicode; a value that is not JSON),
        each with why; empty for a row that can be stored (the common case costs one
        encoding of the kept values).

        Examples:
            >>> builder = RecordBuilder(None, columns=None)
            >>> builder.unstorable({"text": "ok", "n": 1})
            {}
            >>> builder.unstorable({"text": "ok", "tags": {"a", "b"}})
            {'tags': 'Type is not JSON serializable: set'}
        """
        names = self.columns if self.columns is not None else tuple(values)
        kept = {name: values.get(name) for name in names}
        try:
            orjson.dumps(kept, option=orjson.OPT_SERIALIZE_NUMPY)
        except TypeError:
            pass
        else:
            return {}
        problems: dict[str, str] = {}
        for name, value in kept.items():
            try:
                orjson.dumps({name: value}, option=orjson.OPT_SERIALIZE_NUMPY)
            except TypeError as error:
                problems[name] = str(error)
        return problems or {"": "the row's columns cannot be written as JSON together"}

    def _add_input(self, record: dict[str, Any], values: Mapping[str, Any]) -> None:
        taken = self.taken
        names = self.columns if self.columns is not None else values.keys()
        for name in names:
            key = INPUT_PREFIX + name if name in taken else name
            record[key] = values.get(name)
