"""CSV: a header line of column names, then one record a line or more.

Every value is a string. A record with a field too many or too few, or that is not
UTF-8, is an unreadable row; a blank line is not a row.
"""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Iterator
from typing import IO

from llm_annotator.errors import InputError
from llm_annotator.jobs.rows.formats.base import Record, RowSource, Selection
from llm_annotator.jobs.rows.formats.compression import decompressed, unreadable

_CSV_FIELD_LIMIT = 2**31 - 1
_UTF8_CHECK = "\x1f"


class CsvSource(RowSource):
    """A CSV file, compressed or not; its columns are its header's."""

    columns_up_front = True

    def __init__(
        self, path: str, id_column: str | None, *, compressed: str | None = None, peek: bool = True
    ) -> None:
        self._take_file(path, id_column, compressed)
        with self._open() as file:
            header = next(self._lines(file), None)
        if header is None:
            raise InputError(f"{path} is empty: a CSV input needs a header line of column names")
        names = header[1]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise InputError(
                f"{path}: the header names column {', '.join(map(repr, repeated))} more than "
                "once; give every column its own name"
            )
        self.columns = tuple(names)

    @contextlib.contextmanager
    def _open(self) -> Iterator[IO[str]]:
        try:
            with (
                decompressed(self._path, self._compressed) as binary,
                io.TextIOWrapper(
                    binary, encoding="utf-8-sig", errors="surrogateescape", newline=""
                ) as file,
            ):
                yield file
        except unreadable() as exc:
            raise InputError(f"cannot read {self.description}: {exc}") from exc

    def _lines(self, file: IO[str]) -> Iterator[tuple[int, list[str]]]:
        """Each record that is not a blank line, with the line it starts on."""
        if csv.field_size_limit() < _CSV_FIELD_LIMIT:
            csv.field_size_limit(_CSV_FIELD_LIMIT)
        reader = csv.reader(file)
        end = 0
        try:
            for fields in reader:
                start, end = end + 1, reader.line_num
                if fields:
                    yield start, fields
        except unreadable(csv.Error) as exc:
            raise InputError(f"{self.description} line {reader.line_num + 1}: {exc}") from exc

    def _records(self, chosen: Selection | None = None) -> Iterator[Record]:
        return self._read(chosen, None)

    def _id_records(self) -> Iterator[Record]:
        return self._read(None, self.id_column)

    def _read(self, chosen: Selection | None, only: str | None) -> Iterator[Record]:
        """The rows (``chosen``'s only), with all their columns or ``only`` that one."""
        path, columns = self.description, self.columns or ()
        key = columns.index(only) if only is not None else -1
        with self._open() as file:
            lines = self._lines(file)
            next(lines, None)
            for position, (number, fields) in enumerate(lines):
                if chosen is not None and position not in chosen:
                    continue
                where = f"{path} line {number}"
                if len(fields) != len(columns):
                    problem = f"has {len(fields)} fields where the header has {len(columns)}"
                    yield position, where, None, f"{where}: {problem}"
                    continue
                try:
                    _UTF8_CHECK.join(fields).encode("utf-8")
                except UnicodeEncodeError:
                    yield position, where, None, f"{where}: not valid UTF-8; save the file as UTF-8"
                    continue
                if only is None:
                    yield position, where, dict(zip(columns, fields, strict=True)), None
                else:
                    yield position, where, {only: fields[key]}, None
