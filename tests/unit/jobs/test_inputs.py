"""Input rows: JSONL, CSV and Parquet files, lists and Datasets, streamed with checked ids."""

from __future__ import annotations

import bz2
import csv
import dataclasses
import gzip
import io
import lzma
import os
import re
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from llm_annotator.errors import ConfigurationError, InputError
from llm_annotator.jobs.rows import inputs
from llm_annotator.jobs.rows.formats import base as reader_base
from llm_annotator.jobs.rows.formats import dataset as dataset_reader
from llm_annotator.jobs.rows.formats import parquet as parquet_reader
from llm_annotator.jobs.rows.inputs import Row, open_input


def write_lines(path: Path, lines: list[bytes], *, final_newline: bool = True) -> Path:
    """Write raw lines (bytes) joined by newlines."""
    path.write_bytes(b"\n".join(lines) + (b"\n" if final_newline else b""))
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Write one JSON value per line."""
    return write_lines(path, [orjson.dumps(row) for row in rows])


def write_csv(path: Path, rows: list[list[str]]) -> Path:
    """Write rows (the first is the header) with the csv module."""
    with path.open("w", newline="", encoding="utf-8") as file:
        csv.writer(file).writerows(rows)
    return path


def write_parquet(path: Path, columns: dict[str, list[Any]], **kwargs: Any) -> Path:
    """Write a table given by its columns."""
    pq.write_table(pa.table(columns), path, **kwargs)
    return path


class FakeDataset:
    """Duck-types a datasets.Dataset: column_names, __len__, iterates as dicts."""

    def __init__(self, rows: list[dict[str, Any]], column_names: Any = None) -> None:
        self.rows = rows
        self.column_names = column_names if column_names is not None else list(rows[0])

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)


# JSONL


def test_jsonl_rows_are_numbered_by_position_skipping_blank_lines(tmp_path: Path) -> None:
    """Blank lines are not rows: ids count rows, `where` names the file line."""
    path = write_lines(
        tmp_path / "data.jsonl", [b'{"text": "a"}', b"", b"   ", b'{"text": "b"}', b""]
    )
    source = open_input(path)
    assert source.scan() == 2
    rows = list(source)
    assert [(row.id, row.where, row.values) for row in rows] == [
        (0, f"{path} line 1", {"text": "a"}),
        (1, f"{path} line 4", {"text": "b"}),
    ]
    assert all(row.error is None for row in rows)
    assert source.description == str(path)
    assert source.columns == ("text",)


def test_jsonl_malformed_middle_line_is_an_error_row(tmp_path: Path) -> None:
    """A line that is not JSON becomes one error row; the rows after it still come."""
    path = write_lines(tmp_path / "d.jsonl", [b'{"t": 1}', b'{"t": 2,,}', b'{"t": 3}'])
    source = open_input(path)
    assert source.scan() == 3
    rows = list(source)
    assert [row.id for row in rows] == [0, 1, 2]
    bad = rows[1]
    assert bad.values == {}
    assert bad.error is not None
    assert bad.error.startswith(f"{path} line 2: not valid JSON")
    assert rows[2].values == {"t": 3}


def test_jsonl_truncated_last_line_is_an_error_row(tmp_path: Path) -> None:
    """A partial object on the last line, without a newline, is an error row that says so."""
    path = write_lines(tmp_path / "d.jsonl", [b'{"t": 1}', b'{"t": 2, "te'], final_newline=False)
    rows = list(open_input(path))
    assert len(rows) == 2
    assert rows[1].error is not None
    assert f"{path} line 2: not valid JSON" in rows[1].error
    assert "may be cut off" in rows[1].error


def test_jsonl_line_that_is_not_an_object_is_an_error_row(tmp_path: Path) -> None:
    """Valid JSON that is not an object (a list, a number) cannot be a row."""
    path = write_lines(tmp_path / "d.jsonl", [b"[1, 2]", b"7", b'{"t": 1}'])
    rows = list(open_input(path))
    assert rows[0].error == f"{path} line 1: is JSON but not an object (a list)"
    assert rows[1].error == f"{path} line 2: is JSON but not an object (a int)"
    assert rows[2].error is None


def test_jsonl_non_utf8_line_is_an_error_row(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 make that row an error, not a crash."""
    path = write_lines(tmp_path / "d.jsonl", [b'{"t": "caf\xe9"}', b'{"t": "ok"}'])
    rows = list(open_input(path))
    assert rows[0].error is not None
    assert rows[0].error.startswith(f"{path} line 1: not valid UTF-8")
    assert rows[1].values == {"t": "ok"}


def test_jsonl_byte_order_mark_is_ignored(tmp_path: Path) -> None:
    """A UTF-8 BOM before the first line does not spoil it."""
    path = write_lines(tmp_path / "d.jsonl", [b'\xef\xbb\xbf{"t": 1}'])
    assert [row.values for row in open_input(path)] == [{"t": 1}]


@pytest.mark.parametrize("name", ["d.ndjson", "d.jsonlines", "D.JSONL"])
def test_other_jsonl_suffixes_are_read(tmp_path: Path, name: str) -> None:
    """.ndjson and .jsonlines are JSONL too, whatever the case of the suffix."""
    path = write_jsonl(tmp_path / name, [{"t": 1}])
    assert [row.values for row in open_input(path)] == [{"t": 1}]


def test_gzipped_jsonl_and_csv_are_read(tmp_path: Path) -> None:
    """.jsonl.gz and .csv.gz are decompressed as they are read."""
    jsonl = tmp_path / "d.jsonl.gz"
    jsonl.write_bytes(gzip.compress(b'{"t": 1}\n\n{"t": 2}\n'))
    table = tmp_path / "d.csv.gz"
    table.write_bytes(gzip.compress(b"t\nx\ny\n"))
    assert [row.values for row in open_input(jsonl)] == [{"t": 1}, {"t": 2}]
    assert [row.values for row in open_input(table)] == [{"t": "x"}, {"t": "y"}]


def _compress(suffix: str, data: bytes) -> bytes:
    if suffix == ".gz":
        return gzip.compress(data)
    if suffix == ".bz2":
        return bz2.compress(data)
    if suffix == ".xz":
        return lzma.compress(data)
    return zstandard.ZstdCompressor().compress(data)


@pytest.mark.parametrize("suffix", inputs.COMPRESSIONS)
def test_each_compression_of_jsonl_and_csv_reads_the_same_rows(tmp_path: Path, suffix: str) -> None:
    """gzip, Zstandard, bzip2 and xz: the rows, their ids and the count are those of the
    same file uncompressed (read in blocks larger than one, so streaming is used)."""
    lines = b"".join(b'{"id": %d, "t": "row %d"}\n' % (i, i) for i in range(20_000))
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(lines)
    packed = tmp_path / f"d.JSONL{suffix.upper()}"  # suffixes in any case
    packed.write_bytes(_compress(suffix, lines))
    expected = [(row.id, row.values) for row in open_input(plain, id_column="id")]
    source = open_input(packed, id_column="id")
    assert [(row.id, row.values) for row in source] == expected
    assert source.scan() == 20_000
    table = tmp_path / f"d.csv{suffix}"
    table.write_bytes(_compress(suffix, b"t\nx\ny\n"))
    assert [row.values for row in open_input(table)] == [{"t": "x"}, {"t": "y"}]


@pytest.mark.parametrize("suffix", inputs.COMPRESSIONS)
@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_a_damaged_compressed_file_is_an_input_error_naming_it(
    tmp_path: Path, suffix: str, damage: str
) -> None:
    """A compressed file cut off or with garbage inside is one InputError with its path,
    never the decompressor's own error."""
    whole = _compress(suffix, b"".join(b'{"t": %d}\n' % i for i in range(50_000)))
    if damage == "cut":
        broken = whole[: len(whole) // 2]
    else:
        middle = len(whole) // 2
        broken = whole[:middle] + bytes(range(256)) * 64 + whole[middle:]
    for name in (f"d.jsonl{suffix}", f"d.csv{suffix}"):
        path = tmp_path / name
        path.write_bytes(broken)
        with pytest.raises(InputError, match=re.escape(str(path))):
            open_input(path).scan()


def test_a_compressed_parquet_name_is_refused_with_the_forms_known(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet.zst"
    path.write_bytes(b"x")
    with pytest.raises(InputError, match=r"unknown input format \(Parquet compresses inside"):
        open_input(path)


def test_cut_off_gzip_is_an_input_error(tmp_path: Path) -> None:
    """A gzipped file that ends early is reported with its path, not as EOFError."""
    path = tmp_path / "d.jsonl.gz"
    whole = gzip.compress(b"".join(b'{"t": %d}\n' % i for i in range(5000)))
    path.write_bytes(whole[: len(whole) // 2])
    source = open_input(path)
    with pytest.raises(InputError, match=re.escape(f"cannot read {path}")):
        source.scan()


def test_jsonl_columns_are_the_first_rows_keys_or_none(tmp_path: Path) -> None:
    """A JSONL file's columns are its first row's keys; None when that row is unreadable."""
    good = write_jsonl(tmp_path / "a.jsonl", [{"a": 1, "b": 2}, {"c": 3}])
    bad = write_lines(tmp_path / "b.jsonl", [b"nope", b'{"a": 1}'])
    empty = write_lines(tmp_path / "c.jsonl", [], final_newline=False)
    assert open_input(good).columns == ("a", "b")
    assert open_input(bad).columns is None
    assert open_input(empty).columns is None
    assert open_input(empty).scan() == 0


# ids


def test_id_column_values_become_the_row_ids(tmp_path: Path) -> None:
    """With id_column, each row's id is that field's value, int or str as it is."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "t": 1}, {"id": 7, "t": 2}])
    source = open_input(path, id_column="id")
    assert source.scan() == 2
    assert [row.id for row in source] == ["a", 7]


def test_duplicate_ids_are_reported_with_both_locations(tmp_path: Path) -> None:
    """A repeated id names the file, the id, the field and both lines."""
    rows = [{"id": f"r{i}"} for i in range(10)] + [{"id": "r3"}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(InputError) as info:
        open_input(path, id_column="id").scan()
    message = str(info.value)
    assert "'r3'" in message
    assert "field 'id'" in message
    assert f"{path} line 4" in message
    assert f"{path} line 11" in message


def test_an_int_id_and_its_string_are_refused_as_one_output_id() -> None:
    """7 and "7" are one id in the output (its id column holds text when ints and strings
    mix): refused naming both rows; ints and strings that differ as text pass."""
    source = open_input([{"id": 7}, {"id": 1}, {"id": "7"}], id_column="id")
    with pytest.raises(InputError, match=r"ids 7 \(at list item 0\) and '7' \(at list item 2\)"):
        source.scan()
    assert open_input([{"id": 7}, {"id": "8"}, {"id": "07"}], id_column="id").scan() == 3


def test_a_jsonl_file_mixing_an_int_id_and_its_string_is_refused(tmp_path: Path) -> None:
    """The same rule on the JSONL reader's fast path, naming both lines."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": 1}\n{"id": 2}\n{"id": "1"}\n')
    with pytest.raises(InputError, match=r"ids 1 \(at .*line 1\) and '1' \(at .*line 3\)"):
        open_input(path, id_column="id").scan()


def test_a_hash_collision_is_not_reported_as_a_duplicate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Equal hashes are re-checked exactly: distinct ids sharing a hash pass."""
    monkeypatch.setattr(reader_base, "hash_id", lambda row_id: 42)
    assert open_input([{"id": i} for i in range(5)], id_column="id").scan() == 5
    with pytest.raises(InputError, match=r"id 3 .* list item 3 and at list item 5"):
        open_input([{"id": i} for i in range(5)] + [{"id": 3}], id_column="id").scan()


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"t": 1}, "has no 'id' field"),
        ({"id": None}, "is null"),
        ({"id": ""}, "is empty"),
        ({"id": True}, "is True, a bool"),
        ({"id": 3.0}, "is 3.0, a float"),
        ({"id": [1]}, "is [1], a list"),
    ],
)
def test_bad_ids_are_refused_by_scan(tmp_path: Path, row: dict[str, Any], problem: str) -> None:
    """Each id must be present, not null, and an int or a str; the message says which row."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"id": 1}, row])
    with pytest.raises(InputError) as info:
        open_input(path, id_column="id").scan()
    assert problem in str(info.value)
    assert f"{path} line 2" in str(info.value)
    assert "id_column=None" in str(info.value)


def test_unreadable_line_with_id_column_is_refused_by_scan(tmp_path: Path) -> None:
    """A malformed line cannot be given an id: scan names the file and line and the fix."""
    path = write_lines(tmp_path / "d.jsonl", [b'{"id": 1}', b"{oops", b'{"id": 2}'])
    with pytest.raises(InputError) as info:
        open_input(path, id_column="id").scan()
    message = str(info.value)
    assert message.startswith(f"{path} line 2: not valid JSON")
    assert "cannot be given an id" in message
    assert "fix or remove it" in message


def test_iterating_with_id_column_refuses_a_row_without_id() -> None:
    """Iteration checks each id too, for callers that skipped scan."""
    source = open_input([{"id": 1}, {"t": 2}], id_column="id")
    rows = iter(source)
    assert next(rows).id == 1
    with pytest.raises(InputError, match="list item 1 has no 'id' field"):
        next(rows)


def test_id_column_must_be_a_string() -> None:
    """A non-str id_column is refused at once."""
    with pytest.raises(InputError, match="id_column must be a column name"):
        open_input([{"id": 1}], id_column=0)  # type: ignore[arg-type]


# CSV


def test_csv_values_are_strings_and_lines_are_named(tmp_path: Path) -> None:
    """CSV rows: strings, line numbers where each record starts, blank lines skipped."""
    path = tmp_path / "d.csv"
    path.write_text('id,text\n1,hello\n\n2,"two\nlines"\n3,end\n', encoding="utf-8")
    source = open_input(path)
    assert source.columns == ("id", "text")
    assert source.scan() == 3
    assert [(row.id, row.where, row.values) for row in source] == [
        (0, f"{path} line 2", {"id": "1", "text": "hello"}),
        (1, f"{path} line 4", {"id": "2", "text": "two\nlines"}),
        (2, f"{path} line 6", {"id": "3", "text": "end"}),
    ]


def test_csv_row_with_wrong_field_count_is_an_error_row(tmp_path: Path) -> None:
    """A record with more or fewer fields than the header is an error row."""
    path = write_csv(tmp_path / "d.csv", [["a", "b"], ["1", "2"], ["3"], ["4", "5", "6"]])
    rows = list(open_input(path))
    assert rows[0].error is None
    assert rows[1].error == f"{path} line 3: has 1 fields where the header has 2"
    assert rows[2].error == f"{path} line 4: has 3 fields where the header has 2"
    assert rows[2].values == {}


def test_csv_non_utf8_row_is_an_error_row(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 make that CSV row an error, the others still read."""
    path = tmp_path / "d.csv"
    path.write_bytes(b"t\ncaf\xe9\nok\n")
    rows = list(open_input(path))
    assert rows[0].error is not None
    assert rows[0].error.startswith(f"{path} line 2: not valid UTF-8")
    assert rows[1].values == {"t": "ok"}


def test_csv_ids_are_checked(tmp_path: Path) -> None:
    """CSV ids are strings; a repeated one is reported with both lines."""
    path = write_csv(tmp_path / "d.csv", [["key", "t"], ["a", "x"], ["b", "y"], ["a", "z"]])
    with pytest.raises(
        InputError,
        match=rf"'a' .* at {re.escape(str(path))} line 2 and at {re.escape(str(path))} line 4",
    ):
        open_input(path, id_column="key").scan()


def test_csv_long_fields_are_read(tmp_path: Path) -> None:
    """A field longer than the csv module's default limit (128 KiB) is read whole."""
    text = "x" * 300_000
    path = write_csv(tmp_path / "d.csv", [["t"], [text]])
    assert next(iter(open_input(path))).values["t"] == text


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "is empty"), (b"\n\n", "is empty"), (b"a,b,a\n1,2,3\n", "'a' more than once")],
)
def test_csv_without_a_usable_header_is_refused(
    tmp_path: Path, content: bytes, message: str
) -> None:
    """An empty CSV or one with repeated column names is refused when opened."""
    path = tmp_path / "d.csv"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message):
        open_input(path)


# Parquet


def test_parquet_rows_are_streamed_in_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parquet rows keep their types and are named by row; batches do not show."""
    monkeypatch.setattr(parquet_reader, "PARQUET_BATCH_ROWS", 3)
    path = write_parquet(
        tmp_path / "d.parquet",
        {"id": list(range(10)), "text": [f"t{i}" for i in range(10)]},
        row_group_size=4,
    )
    source = open_input(path)
    assert source.columns == ("id", "text")
    assert source.scan() == 10
    rows = list(source)
    assert [row.id for row in rows] == list(range(10))
    assert rows[7] == Row(7, {"id": 7, "text": "t7"}, f"{path} row 7")


def test_parquet_ids_are_checked(tmp_path: Path) -> None:
    """A repeated Parquet id is reported with both rows."""
    path = write_parquet(tmp_path / "d.parquet", {"key": ["a", "b", "c", "b"], "t": [1, 2, 3, 4]})
    with pytest.raises(
        InputError,
        match=rf"'b' .* at {re.escape(str(path))} row 1 and at {re.escape(str(path))} row 3",
    ):
        open_input(path, id_column="key").scan()
    good = write_parquet(tmp_path / "e.parquet", {"key": [5, 6], "t": [1, 2]})
    source = open_input(good, id_column="key")
    assert source.scan() == 2
    assert [row.id for row in source] == [5, 6]


def test_parquet_null_id_is_refused(tmp_path: Path) -> None:
    """A null in the id column is refused with its row."""
    path = write_parquet(tmp_path / "d.parquet", {"key": ["a", None]})
    with pytest.raises(
        InputError, match=rf"{re.escape(str(path))} row 1: the id in field 'key' is null"
    ):
        open_input(path, id_column="key").scan()


def test_unknown_id_column_is_refused_when_opening(tmp_path: Path) -> None:
    """For inputs with known columns, a missing id_column is refused with the columns."""
    table = write_parquet(tmp_path / "d.parquet", {"a": [1]})
    text = write_csv(tmp_path / "d.csv", [["a"], ["1"]])
    for data in (table, text, FakeDataset([{"a": 1}])):
        with pytest.raises(InputError, match=r"has no column 'ID' .*its columns: a"):
            open_input(data, id_column="ID")


def test_corrupt_parquet_is_refused(tmp_path: Path) -> None:
    """A file that is not Parquet is refused, naming it."""
    path = tmp_path / "d.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match=re.escape(f"cannot read {path} as Parquet")):
        open_input(path)


# lists and datasets


def test_list_items_that_are_not_mappings_are_error_rows() -> None:
    """A list item that is not a mapping becomes an error row; mappings become dicts."""
    source = open_input([{"t": 1}, "oops", MappingProxyType({"t": 3})])
    assert source.description == "a list of 3 rows"
    assert source.columns == ("t",)
    assert source.scan() == 3
    rows = list(source)
    assert rows[1] == Row(
        1, {}, "list item 1", "list item 1: is a str, not a mapping of column names to values"
    )
    assert rows[2].values == {"t": 3}
    assert type(rows[2].values) is dict


def test_empty_list_has_no_rows() -> None:
    """An empty list scans to zero rows and no columns."""
    source = open_input([])
    assert (source.scan(), list(source), source.columns) == (0, [], None)


def test_dataset_is_duck_typed() -> None:
    """Anything with column_names and __len__ that iterates as dicts reads as a Dataset."""
    data = FakeDataset([{"id": "x", "t": 1}, {"id": "y", "t": 2}])
    source = open_input(data, id_column="id")
    assert source.columns == ("id", "t")
    assert source.description == "a dataset of 2 rows"
    assert source.scan() == 2
    assert [(row.id, row.where) for row in source] == [
        ("x", "dataset row 0"),
        ("y", "dataset row 1"),
    ]


def test_pyarrow_table_is_read_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pyarrow.Table is read like a Dataset, a batch at a time."""
    monkeypatch.setattr(dataset_reader, "PARQUET_BATCH_ROWS", 2)
    source = open_input(pa.table({"t": ["a", "b", "c"]}))
    assert (source.description, source.columns, source.scan()) == ("a table of 3 rows", ("t",), 3)
    assert [(row.id, row.where, row.values) for row in source] == [
        (0, "table row 0", {"t": "a"}),
        (1, "table row 1", {"t": "b"}),
        (2, "table row 2", {"t": "c"}),
    ]


def test_dataset_dict_is_refused_with_a_hint() -> None:
    """A DatasetDict (column_names is a dict) asks for one split."""
    data = FakeDataset([{"t": 1}], column_names={"train": ["t"]})
    with pytest.raises(InputError, match=r"data\['train'\]"):
        open_input(data)


@pytest.mark.parametrize("data", [5, {"t": 1}, (x for x in [{"t": 1}]), b"d.jsonl"])
def test_unsupported_input_types_are_refused(data: object) -> None:
    """Dicts, generators (readable once), bytes and other types are refused with the options."""
    with pytest.raises(InputError, match="cannot read input of type"):
        open_input(data)


# files


def test_missing_file_is_refused(tmp_path: Path) -> None:
    """A missing file is refused with its path, as a ConfigurationError too."""
    path = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigurationError, match=re.escape(f"cannot read the input file {path}")):
        open_input(path)


def test_directory_is_refused(tmp_path: Path) -> None:
    """A directory is not an input file."""
    folder = tmp_path / "d.parquet"
    folder.mkdir()
    with pytest.raises(InputError, match="is a directory"):
        open_input(folder)


def test_unreadable_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file the process may not read is refused with its path (the permission error
    is raised at the os.open() boundary: as root, chmod 0 would not stop the read)."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"t": 1}])
    real_open = os.open

    def refusing_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("os.open", refusing_open)
    with pytest.raises(InputError, match=re.escape(f"cannot read the input file {path}")):
        open_input(path)


@pytest.mark.parametrize(("name", "hint"), [("d.txt", ""), ("d.json", "one JSON object per line")])
def test_unknown_extension_is_refused(tmp_path: Path, name: str, hint: str) -> None:
    """An unknown suffix is refused, listing the formats that work."""
    path = tmp_path / name
    path.write_text("{}", encoding="utf-8")
    with pytest.raises(InputError, match="unknown input format") as info:
        open_input(path)
    assert ".jsonl" in str(info.value)
    assert ".parquet" in str(info.value)
    assert hint in str(info.value)


# streaming


def test_rows_are_frozen() -> None:
    """A Row cannot be changed after it is made."""
    row = Row(0, {"t": 1}, "list item 0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.id = 1  # type: ignore[misc]


def test_large_jsonl_is_streamed(tmp_path: Path) -> None:
    """200,000 lines: scan counts and checks them, and the first row comes without a pass."""
    path = tmp_path / "big.jsonl"
    with path.open("wb") as file:
        for i in range(200_000):
            file.write(b'{"id": "r%d", "text": "row number %d"}\n' % (i, i))
    source = open_input(path, id_column="id")
    rows = iter(source)
    first = next(rows)
    assert (first.id, first.values["text"]) == ("r0", "row number 0")
    assert next(rows).id == "r1"
    assert source.scan() == 200_000
    assert open_input(path).scan() == 200_000
    (last,) = deque(source, maxlen=1)
    assert (last.id, last.where) == ("r199999", f"{path} line 200000")


def test_iterating_again_reads_the_input_again(tmp_path: Path) -> None:
    """Each iteration starts from the first row."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"t": 1}, {"t": 2}])
    source = open_input(path)
    assert list(source) == list(source)
    assert len(list(source)) == 2


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".csv", ".parquet"])
@pytest.mark.parametrize("kind", ["fifo", "link to a fifo", "directory", "device"])
def test_an_input_that_is_not_a_regular_file_is_refused_without_blocking(
    tmp_path: Path, suffix: str, kind: str
) -> None:
    """A FIFO (directly or through a link), a directory or a device under an input's
    name is refused at once, naming it: a plain open() of a FIFO waits for a writer
    forever, on the thread that would have to run the signal handlers. The test runs in a
    thread it can abandon, so a regression fails instead of hanging the suite."""
    path = tmp_path / f"in{suffix}"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to a fifo":
        os.mkfifo(tmp_path / "pipe")
        path.symlink_to(tmp_path / "pipe")
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    outcome: list[BaseException | int] = []

    def attempt() -> None:
        try:
            outcome.append(open_input(path).scan())
        except BaseException as error:
            outcome.append(error)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    assert outcome, f"open_input blocked on {kind}"
    assert isinstance(outcome[0], InputError), outcome
    assert "not a regular file" in str(outcome[0]) and str(path) in str(outcome[0])


def test_the_identity_follows_the_ids_or_the_content(tmp_path: Path) -> None:
    """With an id column the identity is the set of ids (order and other fields free);
    without one it is the content, for every reader."""
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": 1, "t": "x"}, {"id": 2, "t": "y"}])
    again = write_jsonl(tmp_path / "b.jsonl", [{"id": 2, "t": "z"}, {"id": 1, "t": "x"}])
    other = write_jsonl(tmp_path / "c.jsonl", [{"id": 1, "t": "x"}, {"id": 3, "t": "y"}])

    def identity(path: Path, id_column: str | None) -> str:
        source = open_input(path, id_column=id_column)
        source.scan()
        return source.identity.digest

    assert identity(first, "id") == identity(again, "id") != identity(other, "id")
    assert identity(first, None) != identity(again, None)
    assert identity(first, None) == identity(first, None)
    table = pa.table({"id": [1, 2], "t": ["x", "y"]})
    pq.write_table(table, tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": [1, 2], "t": ["x", "w"]}), tmp_path / "b.parquet")
    assert identity(tmp_path / "a.parquet", "id") == identity(tmp_path / "b.parquet", "id")
    assert identity(tmp_path / "a.parquet", None) != identity(tmp_path / "b.parquet", None)
    with pytest.raises(InputError, match="scan"):
        _ = open_input(first).identity


def test_a_zstd_file_of_several_frames_is_read_whole(tmp_path: Path) -> None:
    """zstd and pzstd may write a file as frames in a row: every frame's rows are read."""
    frames = [b"".join(b'{"t": %d}\n' % i for i in range(k, k + 1000)) for k in (0, 1000, 2000)]
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(b"".join(zstandard.ZstdCompressor().compress(frame) for frame in frames))
    assert [row.values["t"] for row in open_input(path)] == list(range(3000))


@pytest.mark.parametrize("suffix", inputs.COMPRESSIONS)
def test_streams_in_a_row_are_read_and_a_damaged_or_foreign_one_is_refused(
    tmp_path: Path, suffix: str
) -> None:
    """A file of several streams (pbzip2, pixz, pzstd) gives every stream's rows; a
    damaged second stream, or bytes after the last that are not a stream, is an
    InputError naming the file (the standard library's bzip2 and xz readers would stop
    there quietly, losing the rows after it)."""
    parts = [b"".join(b'{"t": %d}\n' % i for i in range(k, k + 1000)) for k in (0, 1000)]
    first, second = (_compress(suffix, part) for part in parts)
    path = tmp_path / f"d.jsonl{suffix}"
    path.write_bytes(first + second)
    assert [row.values["t"] for row in open_input(path)] == list(range(2000))
    damaged = second[:30] + bytes(10) + second[40:]
    for broken in (first + damaged, first + b"not a stream at all, but garbage"):
        path.write_bytes(broken)
        with pytest.raises(InputError, match=re.escape(str(path))):
            open_input(path).scan()


def test_a_zstd_file_written_with_a_long_window_is_read(tmp_path: Path) -> None:
    """``zstd --long`` writes frames that need a window beyond libzstd's default limit."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=28, enable_ldm=True)
    packed = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(
        packed, closefd=False
    ) as writer:
        writer.write(b"".join(b'{"t": %d}\n' % i for i in range(1000)))
    assert zstandard.get_frame_parameters(packed.getvalue()).window_size == 1 << 28
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(packed.getvalue())
    assert open_input(path).scan() == 1000
