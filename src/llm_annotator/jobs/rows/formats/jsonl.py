"""JSON Lines: one JSON object a line.

Read a block of lines (about a MiB) at a time; a line that is blank is not a row, one
that is not a JSON object is an unreadable row. An uncompressed file can also be read
in byte ranges (:meth:`JsonlSource.span_rows`), each on its own.
"""

from __future__ import annotations

import contextlib
import hashlib
from array import array
from collections.abc import Generator, Iterator
from contextlib import closing
from typing import IO, Any

import orjson

from llm_annotator.errors import InputError
from llm_annotator.jobs.ids import INT64_BOUND, hash_id
from llm_annotator.jobs.rows.formats.base import Record, Row, RowSource, Selection
from llm_annotator.jobs.rows.formats.compression import decompressed, unreadable

_BLOCK_BYTES = 1 << 20
"""About how much of a JSONL file is read at a time."""
_BOM = b"\xef\xbb\xbf"
"""UTF-8's byte order mark, dropped before a file's first line."""


class JsonlSource(RowSource):
    """A JSON Lines file, compressed or not; its columns are its first row's keys."""

    def __init__(
        self, path: str, id_column: str | None, *, compressed: str | None = None, peek: bool = True
    ) -> None:
        self._take_file(path, id_column, compressed)
        self.columns = None
        if peek:
            with closing(self._records()) as records:
                first = next(records, None)
            if first is not None and first[2] is not None:
                self.columns = tuple(first[2])

    @contextlib.contextmanager
    def _open(self) -> Iterator[IO[bytes]]:
        try:
            with decompressed(self._path, self._compressed) as file:
                yield file
        except unreadable() as exc:
            raise InputError(f"cannot read {self.description}: {exc}") from exc

    def _blocks(self) -> Generator[tuple[int, list[bytes]], None, None]:
        """The file's lines about a MiB at a time, each block with its first line's number
        (the first line alone, which is all that finding the columns reads; a UTF-8 byte
        order mark before it dropped)."""
        with self._open() as file:
            try:
                if block := file.readlines(1):
                    block[0] = block[0].removeprefix(_BOM)
                number = 1
                while block:
                    yield number, block
                    number += len(block)
                    block = file.readlines(_BLOCK_BYTES)
            except unreadable() as exc:
                raise InputError(f"cannot read {self.description}: {exc}") from exc

    def _lines(self, chosen: Selection | None) -> Iterator[tuple[int, int, bytes]]:
        """Each line that is not blank (``chosen``'s only): its position, number and bytes."""
        position = 0
        for first, block in self._blocks():
            if chosen is not None and all(map(bytes.strip, block)):  # no blank line in it:
                for offset in chosen.offsets(position, position + len(block)).tolist():
                    yield position + offset, first + offset, block[offset]  # the rest unread
                position += len(block)
                continue
            for number, line in enumerate(block, first):
                if line.strip():
                    if chosen is None or position in chosen:
                        yield position, number, line
                    position += 1

    def _count(self) -> int:
        return sum(sum(map(bool, map(bytes.strip, block))) for _, block in self._blocks())

    def _count_and_digest(self) -> tuple[int, str]:
        digest, rows = hashlib.blake2b(digest_size=16), 0
        for _, block in self._blocks():
            rows += sum(map(bool, map(bytes.strip, block)))
            digest.update(b"".join(block))
        return rows, digest.hexdigest()

    def _records(self, chosen: Selection | None = None) -> Generator[Record, None, None]:
        path = self.description
        for position, number, line in self._lines(chosen):
            yield _record(position, f"{path} line {number}", line)

    def span_rows(self, span: tuple[int, int], unit: int | None) -> Iterator[Row]:
        """The rows whose lines begin within ``span`` (bytes, half-open) of an
        uncompressed file: from the first line boundary at or after its start, on past
        its end to the end of its last line. Each row's place is its line's byte offset
        (``data.jsonl byte 1048576``): line numbers are not known without reading what
        comes before.

        Raises:
            InputError: The file is compressed, or cannot be read.
        """
        if self._compressed is not None:
            raise InputError(f"{self.description}: a compressed file cannot be read in parts")
        return self._rows(self._span_records(span), unit)

    def _span_records(self, span: tuple[int, int]) -> Iterator[Record]:
        start, end = span
        path = self.description
        with self._open() as file:
            try:
                if start > 0:  # a line that begins before the span is the span before's
                    file.seek(start - 1)
                    file.readline()
                offset = file.tell()
                while offset < end:
                    # no further than the span's end asks: the next span is another's
                    block = file.readlines(min(_BLOCK_BYTES, end - offset))
                    if not block:
                        return
                    for line in block:
                        if offset >= end:
                            return
                        at, offset = offset, offset + len(line)
                        if at == 0:  # the file's first line: without a byte order mark
                            line = line.removeprefix(_BOM)
                        if line.strip():
                            yield _record(at, f"{path} byte {at}", line)
            except unreadable() as exc:
                raise InputError(f"cannot read {self.description}: {exc}") from exc

    def _hashes(self) -> array[int]:
        """A block at a time while each of its lines is an object with a valid id (the
        common case); a block with anything else goes line by line, as in the records."""
        hashes, column, loads, path = array("Q"), self.id_column, orjson.loads, self.description
        kinds = self._kinds
        for first, block in self._blocks():
            try:
                ids = [loads(line)[column] for line in block]
                if _all_valid(ids):
                    hashes.extend(list(map(hash_id, ids)))
                    kinds.add(type(ids[0]))
                    continue
            except (orjson.JSONDecodeError, TypeError, KeyError):
                pass  # a blank or malformed line, not an object, no id, ...
            for number, line in enumerate(block, first):
                if line.strip():
                    where = f"{path} line {number}"
                    row_id = self._checked_id(where, *_decoded(line, where))
                    kinds.add(str if isinstance(row_id, str) else int)
                    hashes.append(hash_id(row_id))
        return hashes


def _all_valid(ids: list[Any]) -> bool:
    """Whether a block's ids are all valid and of one kind (the fast path's test, in
    bulk; anything else is checked id by id): all ints within 64 bits, or all non-empty
    strings (JSON text decodes to valid Unicode only)."""
    kinds = set(map(type, ids))
    if kinds == {int}:
        return bool(min(ids) >= -INT64_BOUND and max(ids) < INT64_BOUND)
    return kinds == {str} and "" not in ids


def _record(position: int, where: str, line: bytes) -> Record:
    """A line's record: its object, or None and why it is not one."""
    try:
        values = orjson.loads(line)
    except orjson.JSONDecodeError:
        values = None
    if type(values) is dict:
        return position, where, values, None
    return position, where, *_decoded(line, where)  # decoded again, to say why not


def _decoded(line: bytes, where: str) -> tuple[dict[str, Any] | None, str | None]:
    """A JSONL line's object, or None and why it is not one."""
    try:
        values = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        return None, f"{where}: {_json_problem(line, exc)}"
    if type(values) is dict:
        return values, None
    return None, f"{where}: is JSON but not an object (a {type(values).__name__})"


def _json_problem(line: bytes, exc: orjson.JSONDecodeError) -> str:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as bad:
        return f"not valid UTF-8 (byte {bad.start + 1} of the line); save the file as UTF-8"
    cut = "" if line.endswith(b"\n") else " (the last line has no newline: the file may be cut off)"
    return f"not valid JSON: {exc.msg} at column {exc.pos + 1}{cut}"
