"""The output_schema: checked once, answers parsed into columns, failures classified."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llm_annotator.errors import ConfigurationError, ErrorKind
from llm_annotator.jobs.answers.schema import OutputSchema, Parsed, strip_code_fence

LABEL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["label"],
}


@pytest.fixture
def schema() -> OutputSchema:
    """A schema with two properties, one required."""
    return OutputSchema(LABEL_SCHEMA)


def test_columns_are_the_top_level_properties(schema: OutputSchema) -> None:
    """An object schema with properties gives one column per property, in order."""
    assert schema.columns == ("label", "confidence")
    assert schema.schema == LABEL_SCHEMA


@pytest.mark.parametrize(
    "definition",
    [
        {"type": "array", "items": {"type": "string"}},
        {"type": "string"},
        {"type": "object"},
        {"type": "object", "properties": {}},
        {"type": "string", "properties": {"a": {}}},
        {},
    ],
)
def test_other_schemas_have_one_parsed_column(definition: dict[str, Any]) -> None:
    """Schemas that are not objects with properties put the whole answer in "parsed"."""
    assert OutputSchema(definition).columns == ("parsed",)


def test_valid_answer_fills_every_column(schema: OutputSchema) -> None:
    """A valid answer gives every column, None for an optional one left out."""
    assert schema.parse('{"label": "positive", "confidence": 0.9}', "stop") == Parsed(
        values={"label": "positive", "confidence": 0.9}, valid=True
    )
    parsed = schema.parse('{"label": "negative", "extra": 1}', "stop")
    assert parsed.valid
    assert parsed.values == {"label": "negative", "confidence": None}
    assert (parsed.error, parsed.kind) == (None, None)


def test_whole_answer_goes_in_parsed_column() -> None:
    """A non-object schema keeps the whole JSON value."""
    parsed = OutputSchema({"type": "array"}).parse("[1, 2]", "stop")
    assert parsed == Parsed(values={"parsed": [1, 2]}, valid=True)


def test_nullable_object_schema_with_null_answer_has_empty_columns() -> None:
    """An object-or-null schema answered with null: valid, every column None."""
    schema = OutputSchema({"type": ["object", "null"], "properties": {"a": {}}})
    assert schema.columns == ("a",)
    assert schema.parse("null", "stop") == Parsed(values={"a": None}, valid=True)


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"label": "positive"}\n```',
        '```\n{"label": "positive"}\n```\n',
        '  ```JSON\n{"label": "positive"}```',
        '\n{"label": "positive"}\n',
        '```json\n{"label": "positive"}',
    ],
)
def test_code_fence_is_stripped(schema: OutputSchema, text: str) -> None:
    """A Markdown code fence around the answer (closed or not) is removed before parsing."""
    parsed = schema.parse(text, "stop")
    assert parsed.valid, parsed.error
    assert parsed.values["label"] == "positive"


def test_strip_code_fence_of_one_line() -> None:
    """A fence on one line is removed too."""
    assert strip_code_fence('```{"a": 1}```') == '{"a": 1}'


def test_answer_that_is_not_json_is_invalid_output(schema: OutputSchema) -> None:
    """Text that is not JSON: invalid, every column None, the reason kept."""
    parsed = schema.parse("The sentiment is positive.", "stop")
    assert not parsed.valid
    assert parsed.values == {"label": None, "confidence": None}
    assert parsed.kind is ErrorKind.INVALID_OUTPUT
    assert parsed.error is not None
    assert parsed.error.startswith("not valid JSON: ")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            '{"label": "neutral"}',
            "does not follow the output_schema: $.label: 'neutral' is not one of "
            "['positive', 'negative']",
        ),
        (
            '{"label": "positive", "confidence": 2}',
            "does not follow the output_schema: $.confidence: 2 is greater than the maximum of 1",
        ),
        ("{}", "does not follow the output_schema: $: 'label' is a required property"),
        ("[1]", "does not follow the output_schema: $: [1] is not of type 'object'"),
    ],
)
def test_answer_against_the_schema_names_the_path(
    schema: OutputSchema, text: str, error: str
) -> None:
    """An answer that breaks the schema says where and how."""
    parsed = schema.parse(text, "stop")
    assert (parsed.valid, parsed.error, parsed.kind) == (False, error, ErrorKind.INVALID_OUTPUT)


def test_long_validation_messages_are_clipped(schema: OutputSchema) -> None:
    """A message quoting a huge value is cut to a readable length."""
    parsed = schema.parse('{"label": "%s"}' % ("x" * 5000), "stop")
    assert parsed.error is not None
    assert len(parsed.error) < 400
    assert parsed.error.endswith("...")


def test_cut_off_answer_is_truncated(schema: OutputSchema) -> None:
    """finish_reason 'length' with an invalid answer: TRUNCATED, and the reason says so."""
    parsed = schema.parse('{"label": "posi', "length")
    assert not parsed.valid
    assert parsed.kind is ErrorKind.TRUNCATED
    assert parsed.error is not None
    assert parsed.error.startswith(
        "cut off by max_completion_tokens (finish_reason 'length'): not valid JSON"
    )


def test_cut_off_answer_that_still_validates_is_valid(schema: OutputSchema) -> None:
    """finish_reason 'length' does not matter when the answer parses and validates."""
    parsed = schema.parse('{"label": "positive"}', "length")
    assert (parsed.valid, parsed.kind, parsed.error) == (True, None, None)


@pytest.mark.parametrize(
    ("finish_reason", "kind"), [("stop", ErrorKind.INVALID_OUTPUT), ("length", ErrorKind.TRUNCATED)]
)
def test_missing_text_is_invalid(schema: OutputSchema, finish_reason: str, kind: ErrorKind) -> None:
    """No text at all is an invalid answer, truncated when cut off."""
    parsed = schema.parse(None, finish_reason)
    assert (parsed.valid, parsed.kind) == (False, kind)
    assert parsed.error is not None
    assert "no text" in parsed.error


@pytest.mark.parametrize(
    ("definition", "message"),
    [
        ({"type": "objekt"}, "not a valid JSON Schema: at $.type"),
        ({"properties": {"a": {"minimum": "zero"}}}, "at $.properties.a.minimum"),
        ({"$schema": "https://example.com/mine", "type": "object"}, "unknown $schema"),
        ({"$schema": 7}, "unknown $schema"),
        (["not", "a", "mapping"], "must be a JSON Schema object"),
        ({"type": "object", "default": {1, 2}}, "not plain JSON data"),
    ],
)
def test_invalid_schemas_are_refused(definition: Any, message: str) -> None:
    """A schema jsonschema rejects, an unknown draft, or non-JSON data is a ConfigurationError."""
    with pytest.raises(ConfigurationError) as info:
        OutputSchema(definition)
    assert message in str(info.value)


def test_known_draft_is_used() -> None:
    """A schema naming an older draft is validated by that draft's rules."""
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "maximum": 1,
        "exclusiveMaximum": True,
    }
    schema = OutputSchema(draft4)
    assert not schema.parse("1", "stop").valid
    assert schema.parse("0.5", "stop").valid


def test_unresolvable_ref_is_a_configuration_error() -> None:
    """A $ref to nowhere is a configuration error, not an invalid answer."""
    schema = OutputSchema({"$ref": "#/$defs/missing"})
    with pytest.raises(ConfigurationError, match=r"\$ref that cannot be resolved"):
        schema.parse("1", "stop")


def test_from_file_reads_a_schema(tmp_path: Path) -> None:
    """A schema file is read as JSON."""
    path = tmp_path / "schema.json"
    path.write_text('{"type": "object", "properties": {"label": {"type": "string"}}}')
    assert OutputSchema.from_file(path).columns == ("label",)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read the output_schema file"),
        ("{not json", "is not valid JSON"),
        ('{"type": 5}', "not a valid JSON Schema"),
    ],
)
def test_from_file_errors_name_the_file(tmp_path: Path, content: str | None, message: str) -> None:
    """A missing file, invalid JSON or an invalid schema: the message names the file."""
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigurationError) as info:
        OutputSchema.from_file(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)
