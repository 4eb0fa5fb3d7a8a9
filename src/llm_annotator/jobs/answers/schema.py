"""The output_schema: a JSON Schema the answers must follow, and their parsing into columns."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from jsonschema.exceptions import SchemaError, best_match
from jsonschema.validators import validator_for
from referencing.exceptions import Unresolvable

from llm_annotator.errors import ConfigurationError, ErrorKind

PARSED_COLUMN = "parsed"
"""The one output column when the schema is not an object with properties."""

_MAX_MESSAGE = 300
_UNKNOWN_DRAFT: Any = object()


@dataclass(frozen=True, slots=True)
class Parsed:
    """One answer read against the output_schema.

    Attributes:
        values: One entry per output column; None where the answer has no value or is
            not valid.
        valid: Whether the answer is JSON that follows the schema.
        error: Why it is not valid, or None.
        kind: ``ErrorKind.TRUNCATED`` when the answer was cut off by
            max_completion_tokens, ``ErrorKind.INVALID_OUTPUT`` otherwise; None when valid.
    """

    values: dict[str, Any]
    valid: bool
    error: str | None = None
    kind: ErrorKind | None = None


class OutputSchema:
    """A JSON Schema for the answers, checked once, with a validator compiled once.

    The output columns are the schema's top-level property names when it describes an
    object with ``properties``; otherwise the whole answer goes in one column,
    ``"parsed"``. Keys of an answer that are not among the properties are not kept as
    columns.

    Args:
        schema: A JSON Schema (any draft that jsonschema knows; the newest when the
            schema has no ``$schema``).

    Raises:
        ConfigurationError: The schema is not a JSON object or not a valid JSON Schema.

    Examples:
        >>> label = {"enum": ["pos", "neg"]}
        >>> schema = OutputSchema(
        ...     {"type": "object", "properties": {"label": label}, "required": ["label"]}
        ... )
        >>> schema.columns
        ('label',)
        >>> schema.parse('```json\\n{"label": "pos"}\\n```', "stop")
        Parsed(values={'label': 'pos'}, valid=True, error=None, kind=None)
        >>> schema.parse('{"label": "meh"}', "stop").error
        "does not follow the output_schema: $.label: 'meh' is not one of ['pos', 'neg']"
        >>> str(schema.parse('{"lab', "length").kind)
        'truncated_output'
    """

    __slots__ = ("_is_object", "_validator", "columns", "schema")

    def __init__(self, schema: Mapping[str, Any]) -> None:
        if not isinstance(schema, Mapping):
            raise ConfigurationError(
                f"output_schema must be a JSON Schema object (a dict), not {type(schema).__name__}"
            )
        try:
            plain: dict[str, Any] = orjson.loads(orjson.dumps(dict(schema)))
        except (TypeError, orjson.JSONEncodeError) as exc:
            raise ConfigurationError(f"output_schema is not plain JSON data: {exc}") from exc
        if "$schema" in plain:
            draft = plain["$schema"]
            known = isinstance(draft, str) and validator_for(plain, _UNKNOWN_DRAFT) is not (
                _UNKNOWN_DRAFT
            )
            if not known:
                raise ConfigurationError(
                    f"output_schema has an unknown $schema {draft!r}; use a JSON Schema draft "
                    "URI such as 'https://json-schema.org/draft/2020-12/schema', or leave it out"
                )
        cls = validator_for(plain)
        try:
            cls.check_schema(plain)
        except SchemaError as exc:
            raise ConfigurationError(
                f"output_schema is not a valid JSON Schema: at {exc.json_path}: "
                f"{_clip(exc.message)}"
            ) from exc
        self.schema = plain
        self._validator = cls(plain)
        properties = plain.get("properties")
        kind = plain.get("type", "object")
        self._is_object = (
            isinstance(properties, dict)
            and bool(properties)
            and (kind == "object" or (isinstance(kind, list) and "object" in kind))
        )
        self.columns: tuple[str, ...] = (
            tuple(properties) if self._is_object and properties else (PARSED_COLUMN,)
        )

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> OutputSchema:
        """Read a schema from a JSON file.

        Raises:
            ConfigurationError: The file cannot be read, is not JSON or not a JSON Schema;
                the message names the file.
        """
        try:
            with open(path, "rb") as file:
                data = orjson.loads(file.read())
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read the output_schema file {os.fspath(path)}: {exc.strerror or exc}"
            ) from exc
        except orjson.JSONDecodeError as exc:
            raise ConfigurationError(
                f"the output_schema file {os.fspath(path)} is not valid JSON: {exc}"
            ) from exc
        try:
            return cls(data)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{os.fspath(path)}: {exc}") from exc

    def __repr__(self) -> str:
        return f"OutputSchema(columns={self.columns!r})"

    def parse(self, text: str | None, finish_reason: str | None) -> Parsed:
        """Read one answer: strip a Markdown code fence, parse JSON, validate.

        Args:
            text: The model's answer.
            finish_reason: Why generation stopped; ``"length"`` marks an invalid answer
                as truncated. An answer cut off that still parses and validates is valid.

        Returns:
            The columns' values and whether the answer is valid, and why not.

        Raises:
            ConfigurationError: The schema has a ``$ref`` that cannot be resolved.
        """
        if text is None:
            return self._invalid("the answer has no text", finish_reason)
        try:
            instance = orjson.loads(strip_code_fence(text))
        except orjson.JSONDecodeError as exc:
            return self._invalid(f"not valid JSON: {exc}", finish_reason)
        try:
            if not self._validator.is_valid(instance):
                error = best_match(self._validator.iter_errors(instance))
                assert error is not None
                return self._invalid(
                    f"does not follow the output_schema: {error.json_path}: {_clip(error.message)}",
                    finish_reason,
                )
        except Unresolvable as exc:
            raise ConfigurationError(
                f"output_schema has a $ref that cannot be resolved: {exc}"
            ) from exc
        if not self._is_object:
            return Parsed(values={PARSED_COLUMN: instance}, valid=True)
        if isinstance(instance, dict):
            return Parsed(
                values={column: instance.get(column) for column in self.columns}, valid=True
            )
        return Parsed(values=dict.fromkeys(self.columns), valid=True)

    def _invalid(self, error: str, finish_reason: str | None) -> Parsed:
        if finish_reason == "length":
            error = f"cut off by max_completion_tokens (finish_reason 'length'): {error}"
            kind = ErrorKind.TRUNCATED
        else:
            kind = ErrorKind.INVALID_OUTPUT
        return Parsed(values=dict.fromkeys(self.columns), valid=False, error=error, kind=kind)


def strip_code_fence(text: str) -> str:
    """The text inside a Markdown code fence around the whole answer, if there is one.

    An opening fence without a closing one (an answer cut off) is removed too.

    Examples:
        >>> strip_code_fence('```json\\n{"a": 1}\\n```')
        '{"a": 1}'
        >>> strip_code_fence(' {"a": 1} ')
        '{"a": 1}'
    """
    stripped = text.strip()
    if not stripped.startswith("```"):
        return stripped
    newline = stripped.find("\n")
    if newline < 0:
        return stripped[3:].removesuffix("```")
    body = stripped[newline + 1 :].rstrip()
    return body.removesuffix("```").strip()


def _clip(message: str) -> str:
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."
