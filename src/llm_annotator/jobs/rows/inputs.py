"""Input rows, streamed: JSONL, Parquet or CSV files, a list of dicts, or a Dataset.

:func:`open_input` picks a reader; the :class:`RowSource` it returns streams
:class:`Row` objects without holding the input in memory, however many rows it has.
A row's id is its position (0-based, counting rows, not blank lines) or the value of
the id column. :meth:`RowSource.scan` makes one cheap pass first: it counts the rows
and, with an id column, checks that every id is there, an int or a str, and unique.

One of several processes that split an input by the hash of its ids (a shard) calls
:meth:`RowSource.select` instead: the same pass also marks the rows whose id hashes to
it, in a :class:`Selection` (a bit a row), and :meth:`RowSource.rows` then skips the
other rows before decoding them: a JSONL line is not parsed, a Parquet batch is turned
into Python objects for the selected rows only.
"""

from __future__ import annotations

import bz2
import contextlib
import csv
import gzip
import hashlib
import io
import lzma
import os
import sys
import zlib
from abc import ABC, abstractmethod
from array import array
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import IO, Any, cast

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from llm_annotator.errors import InputError
from llm_annotator.jobs.files import check_input_file, open_input_file, shown_path
from llm_annotator.jobs.ids import (
    INT64_BOUND,
    RowId,
    content_hash,
    hash_id,
    id_problem,
    output_form,
)

PARQUET_BATCH_ROWS = 1024
"""Rows decoded at a time from a Parquet file."""
_BLOCK_BYTES = 1 << 20
"""About how much of a JSONL file is read at a time."""
_BOM = b"\xef\xbb\xbf"
"""UTF-8's byte order mark, dropped before a file's first line."""

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")
CSV_SUFFIXES = (".csv",)
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow",)
"""Arrow IPC files (stream or file format), as ``datasets.Dataset.save_to_disk`` writes."""
COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")
"""The compressions a JSONL or CSV input may have, by suffix (``data.jsonl.zst``): gzip,
Zstandard (the ``zstandard`` package), bzip2 and xz; read as a stream, never whole."""

_CSV_FIELD_LIMIT = 2**31 - 1
_UTF8_CHECK = "\x1f"
_NO_ID = "pass id_column=None to number the rows by position"
# A record as a reader yields it: its position, where it is, its columns (None when
# unreadable), the error.
_Record = tuple[int, str, "dict[str, Any] | None", "str | None"]


@dataclass(frozen=True, slots=True)
class Row:
    """One input row.

    Attributes:
        id: The row's position (0-based) or the value of its id column.
        values: The row's columns; empty when ``error`` is set.
        where: Where the row is, for messages: ``"data.jsonl line 18"``,
            ``"data.parquet row 17"``, ``"data.csv line 19"``, ``"list item 17"``,
            ``"dataset row 17"``.
        error: Why the row could not be read (the message names where and what), or None.
        unit: In a corpus, the index of the unit (a file, or part of one) the row
            belongs to; None for a single input.
    """

    id: RowId
    values: dict[str, Any]
    where: str
    error: str | None = None
    unit: int | None = None

    def content(self) -> int:
        """A hash of what the row holds (its columns, or why it could not be read), so
        that a resumed job knows which rows changed since their answers were made."""
        if self.error is not None:
            return content_hash({"\x00unreadable": self.error})
        return content_hash(self.values)


@dataclass(frozen=True, slots=True)
class Selection:
    """The rows of an input that one of ``count`` parts of it takes: those whose id
    hashes to ``index`` (``hash_id(id) % count == index``), from :meth:`RowSource.select`.

    Attributes:
        index: The part's index.
        count: How many parts the input is split into.
        rows: The input's rows (as :meth:`RowSource.scan` counts them).
        taken: How many of them the part takes.
        bits: A bit a row, set where the row is taken: position ``p`` is bit ``p & 7``
            of byte ``p >> 3`` (1.25 MB for 10^7 rows).

    Examples:
        >>> part = open_input([{"id": f"r{i}"} for i in range(10)], id_column="id").select(1, 3)
        >>> part.rows, part.taken == sum(1 for p in range(10) if p in part)
        (10, True)
        >>> [p for p in range(10) if p in part] == [
        ...     p for p in range(10) if hash_id(f"r{p}") % 3 == 1]
        True
    """

    index: int
    count: int
    rows: int
    taken: int
    bits: bytes

    def __contains__(self, position: int) -> bool:
        """Whether the row at ``position`` is taken (none beyond the rows counted)."""
        byte = position >> 3
        return byte < len(self.bits) and bool(self.bits[byte] >> (position & 7) & 1)

    def offsets(self, start: int, stop: int) -> np.ndarray[Any, np.dtype[np.intp]]:
        """The taken positions from ``start`` up to ``stop``, less ``start``."""
        first, last = start >> 3, min((stop + 7) >> 3, len(self.bits))
        if first >= last:
            return np.flatnonzero(np.zeros(0, dtype=np.bool_))
        packed = np.frombuffer(self.bits, dtype=np.uint8, count=last - first, offset=first)
        bits = np.unpackbits(packed, bitorder="little")
        return np.flatnonzero(bits[start & 7 : (start & 7) + stop - start])

    @classmethod
    def of(cls, hashes: np.ndarray[Any, np.dtype[np.uint64]], index: int, count: int) -> Selection:
        """The part ``index`` of ``count`` of the rows whose ids have these hashes."""
        if not 0 <= index < count:
            raise ValueError(f"part {index} of {count} does not exist")
        taken = hashes % np.uint64(count) == np.uint64(index)
        bits = np.packbits(taken, bitorder="little").tobytes()
        return cls(index, count, len(hashes), int(np.count_nonzero(taken)), bits)


class RowSource(ABC):
    """Rows from one input, streamed; iterating again reads the input again.

    Attributes:
        description: What the input is, for messages: the path, or ``"a list of 3 rows"``.
        columns: The input's columns when known up front: a Parquet or CSV file's and a
            Dataset's columns; for JSONL and lists, the keys of the first row (later rows
            may differ), or None when that row cannot be read or there is none.
        id_column: The column that holds the row ids, or None for positions.
    """

    description: str
    columns: tuple[str, ...] | None
    id_column: str | None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description!r} id_column={self.id_column!r}>"

    @abstractmethod
    def _records(self, chosen: Selection | None = None) -> Iterator[_Record]:
        """Every row of the input, in order, read or not; with ``chosen``, only its rows
        (the others skipped before they are decoded, where the format allows)."""

    def _id_records(self) -> Iterator[_Record]:
        """Rows with at least the id column; readers that can read less override this."""
        return self._records()

    def _count(self) -> int:
        """The number of rows; readers that know it without a pass override this."""
        return sum(1 for _ in self._records())

    def __iter__(self) -> Iterator[Row]:
        """Stream the rows (:meth:`rows`)."""
        return self.rows()

    def rows(self, chosen: Selection | None = None, *, unit: int | None = None) -> Iterator[Row]:
        """Stream the rows, or only those ``chosen`` (from :meth:`select` of this input).

        Args:
            chosen: The rows to stream, or None for all.
            unit: The corpus unit the rows are marked with (:attr:`Row.unit`).

        Raises:
            InputError: With an id column, a row has no valid id (:meth:`scan` finds
                these, and duplicates, before any row is used).
        """
        return self._rows(self._records(chosen), unit)

    def _rows(self, records: Iterator[_Record], unit: int | None) -> Iterator[Row]:
        if self.id_column is None:
            for position, where, values, error in records:
                yield Row(position, values if values is not None else {}, where, error, unit)
            return
        for _, where, values, error in records:
            row_id = self._checked_id(where, values, error)
            yield Row(row_id, values if values is not None else {}, where, None, unit)

    def ids(self) -> Iterator[RowId]:
        """Every row's id, in order (positions without an id column), checked as by
        :meth:`scan`, which must have run."""
        if self.id_column is None:
            return iter(range(self.identity.rows))
        return (
            self._checked_id(where, values, error) for _, where, values, error in self._id_records()
        )

    def select(self, index: int, count: int) -> Selection:
        """:meth:`scan`, and which rows part ``index`` of ``count`` takes: those whose id
        (the position without an id column) hashes to it, each id hashed once.

        Raises:
            InputError: As :meth:`scan`.
            ValueError: There is no part ``index`` of ``count``.
        """
        return Selection.of(self._survey(), index, count)

    def scan(self) -> int:
        """One pass over the input: count the rows and, with an id column, check the ids.

        It also takes the input's :attr:`identity`.

        Returns:
            The number of rows (unreadable rows included; blank lines are not rows).

        Raises:
            InputError: The input cannot be read, or with an id column: a row cannot be
                read, its id is missing, null, not an int or a str, beyond 64 bits, not
                unique, or the same in the output as another's (``1`` and ``"1"``). The
                message names the input, the line or row, the id and the field.
        """
        return len(self._survey())

    @property
    def identity(self) -> InputIdentity:
        """What identifies the input, from its :meth:`scan` (or :meth:`select`).

        Raises:
            InputError: Neither has run yet.
        """
        identity: InputIdentity | None = getattr(self, "_identity", None)
        if identity is None:
            raise InputError(f"{self.description}: scan() the input before asking its identity")
        return identity

    def _survey(self) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """Each row's id hashed, in order (ids checked, unique), and the identity kept."""
        if self.id_column is None:
            rows, content = self._count_and_digest()
            hashes = np.fromiter(map(hash_id, range(rows)), dtype=np.uint64, count=rows)
            self._identity = InputIdentity.of(self.description, hashes, content)
            return hashes
        hashes = self._id_hashes()
        self._identity = InputIdentity.of(self.description, hashes, None)
        return hashes

    def _count_and_digest(self) -> tuple[int, str]:
        """The number of rows and a digest of the input's content (rows numbered by
        position are identified by what they hold). Readers override this where the
        content can be hashed cheaper than row by row."""
        digest, rows = hashlib.blake2b(digest_size=16), 0
        for _, _, values, error in self._records():
            digest.update(_row_bytes(values, error))
            rows += 1
        return rows, digest.hexdigest()

    def _id_hashes(self) -> np.ndarray[Any, np.dtype[np.uint64]]:
        """Each row's id hashed, in order, once every id is checked and found unique."""
        self._kinds: set[type] = set()
        hashes = self._hashes()
        self._check_unique(hashes)
        if len(self._kinds) > 1:  # ints and strs: the output holds both as text
            self._check_unique_in_output()
        return np.frombuffer(hashes, dtype=np.uint64)

    def _hashes(self) -> array[int]:
        """Each row's id, checked and hashed; readers that can do it faster override this
        (noting each kind of id they see in ``_kinds``)."""
        hashes, kinds = array("Q"), self._kinds
        for _, where, values, error in self._id_records():
            row_id = self._checked_id(where, values, error)
            kinds.add(str if isinstance(row_id, str) else int)
            hashes.append(hash_id(row_id))
        return hashes

    def _checked_id(self, where: str, values: dict[str, Any] | None, error: str | None) -> RowId:
        column = self.id_column
        if error is not None or values is None:
            raise InputError(
                f"{error}; with id_column={column!r} this row cannot be given an id: "
                f"fix or remove it, or {_NO_ID}"
            )
        if column not in values:
            raise InputError(
                f"{where} has no {column!r} field (id_column={column!r}); "
                f"every row needs one, or {_NO_ID}"
            )
        value = values[column]
        problem = id_problem(value)
        if problem is None:
            return cast(RowId, value)
        raise InputError(f"{where}: the id in field {column!r} {problem}; fix it, or {_NO_ID}")

    def _check_unique(self, hashes: array[int] | np.ndarray[Any, np.dtype[np.uint64]]) -> None:
        """Find repeated ids: sort the 64-bit hashes, then re-check equal hashes exactly."""
        candidates = _repeated(hashes)
        if not candidates:
            return
        first_seen: dict[RowId, str] = {}  # only ids whose hash is repeated
        for _, where, values, error in self._id_records():
            row_id = self._checked_id(where, values, error)
            if hash_id(row_id) not in candidates:
                continue
            if row_id in first_seen:
                raise InputError(
                    f"{self.description}: the id {row_id!r} (field {self.id_column!r}) appears "
                    f"more than once: at {first_seen[row_id]} and at {where}; ids must be "
                    f"unique: fix the input, or {_NO_ID}"
                )
            first_seen[row_id] = where

    def _check_unique_in_output(self) -> None:
        """With int and str ids both, find two that the output's id column (text, then)
        would hold as one: ``1`` and ``"1"``. One more pass, for such inputs only."""
        forms = array("Q")
        for _, where, values, error in self._id_records():
            forms.append(hash_id(output_form(self._checked_id(where, values, error))))
        candidates = _repeated(forms)
        if not candidates:
            return
        first_seen: dict[str, tuple[RowId, str]] = {}
        for _, where, values, error in self._id_records():
            row_id = self._checked_id(where, values, error)
            form = output_form(row_id)
            if hash_id(form) not in candidates:
                continue
            if form in first_seen:
                other, at = first_seen[form]
                raise InputError(
                    f"{self.description}: the ids {other!r} (at {at}) and {row_id!r} (at "
                    f"{where}) in field {self.id_column!r} are one id in the output, whose id "
                    "column holds ints and strings alike as text: make the ids all ints or "
                    f"all strings, and unique as text, or {_NO_ID}"
                )
            first_seen[form] = (row_id, where)


@dataclass(frozen=True, slots=True)
class InputIdentity:
    """What identifies an input, so that a run directory made over one input is not
    resumed over another (their results would mix).

    Attributes:
        where: The input, for messages (a path, or ``"a list of 3 rows"``).
        rows: Its number of rows.
        digest: With an id column, a digest of its set of ids (independent of their
            order); without one, of the rows' content (rows are numbered by position,
            so what they hold identifies them).

    Examples:
        >>> a = open_input([{"id": 1}, {"id": 2}], id_column="id")
        >>> b = open_input([{"id": 2}, {"id": 1}], id_column="id")
        >>> a.scan(), b.scan(), a.identity.digest == b.identity.digest
        (2, 2, True)
        >>> c = open_input([{"text": "x"}]); d = open_input([{"text": "y"}])
        >>> c.scan(), d.scan(), c.identity.digest == d.identity.digest
        (1, 1, False)
    """

    where: str
    rows: int
    digest: str

    @classmethod
    def of(
        cls, where: str, hashes: np.ndarray[Any, np.dtype[np.uint64]], content: str | None
    ) -> InputIdentity:
        digest = hashlib.blake2b(digest_size=16)
        digest.update(b"rows:%d;" % len(hashes))
        if content is None:  # the ids: their sum and xor (mod 2**64), in any order
            total = int(np.add.reduce(hashes, dtype=np.uint64)) if len(hashes) else 0
            xor = int(np.bitwise_xor.reduce(hashes)) if len(hashes) else 0
            digest.update(b"ids:%d:%d" % (total, xor))
        else:
            digest.update(b"content:" + content.encode())
        return cls(where, len(hashes), digest.hexdigest())

    def to_json(self) -> dict[str, Any]:
        """The identity as ``job.json`` records it."""
        return {"where": self.where, "rows": self.rows, "digest": self.digest}


def _repeated(hashes: array[int] | np.ndarray[Any, np.dtype[np.uint64]]) -> set[int]:
    """The hashes that occur more than once."""
    if len(hashes) < 2:
        return set()
    ordered = np.array(hashes, dtype=np.uint64)
    ordered.sort()
    repeated = ordered[1:][ordered[1:] == ordered[:-1]]
    return set(np.unique(repeated).tolist()) if repeated.size else set()


def _row_bytes(values: dict[str, Any] | None, error: str | None) -> bytes:
    """A row's content as bytes, for a digest (values of any type)."""
    if values is None:
        return b"\x00" + (error or "").encode("utf-8", "backslashreplace")
    try:
        return b"\x01" + orjson.dumps(
            values,
            option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY,
        )
    except TypeError:
        return b"\x02" + repr(values).encode("utf-8", "backslashreplace")


def open_input(
    data: str | os.PathLike[str] | Sequence[Mapping[str, Any]] | Any,
    *,
    id_column: str | None = None,
    peek: bool = True,
) -> RowSource:
    """A streaming reader for ``data``.

    Args:
        data: A path to a ``.jsonl`` (also ``.ndjson``, ``.jsonlines``), ``.parquet`` or
            ``.csv`` file (JSONL and CSV may be compressed, :data:`COMPRESSIONS`:
            ``data.jsonl.gz``, ``data.csv.zst``); a list of dicts; or a
            ``datasets.Dataset`` (anything with ``column_names`` and ``__len__`` that
            iterates as dicts), or a ``pyarrow.Table``. CSV values are strings.
        id_column: The column holding each row's id; None numbers rows by position.
        peek: Read a JSONL file's first row now, for its columns (and to refuse a file
            that cannot be read at once); False reads nothing before the rows
            (``columns`` is then None), as a corpus's unit does.

    Returns:
        The rows' source; call :meth:`RowSource.scan` before using the rows.

    Raises:
        InputError: The file is missing, unreadable or of an unknown kind, the input is
            of an unsupported type, or ``id_column`` is not among known columns.

    Examples:
        >>> source = open_input([{"id": "a", "text": "good"}, {"id": "b", "text": "bad"}],
        ...                     id_column="id")
        >>> source.scan()
        2
        >>> [(row.id, row.where) for row in source]
        [('a', 'list item 0'), ('b', 'list item 1')]
    """
    if id_column is not None and not isinstance(id_column, str):
        raise InputError(f"id_column must be a column name (a str), not {id_column!r}")
    if isinstance(data, str | os.PathLike):
        source: RowSource = _open_file(os.fspath(data), id_column, peek)
    elif hasattr(data, "column_names") and hasattr(data, "__len__"):
        source = _DatasetSource(data, id_column)
    elif isinstance(data, Sequence) and not isinstance(data, bytes | bytearray):
        source = _ListSource(data, id_column)
    else:
        raise InputError(
            f"cannot read input of type {type(data).__name__}: pass a path to a .jsonl, "
            ".parquet or .csv file, a list of dicts, a datasets.Dataset or a pyarrow.Table "
            "(for a pandas DataFrame: df.to_dict('records'), or df.to_parquet(path) first)"
        )
    known = isinstance(source, _CsvSource | _ParquetSource | _ArrowSource | _DatasetSource)
    if known and id_column is not None and id_column not in (source.columns or ()):
        raise InputError(
            f"{source.description} has no column {id_column!r} (id_column); its columns: "
            f"{', '.join(source.columns or ()) or '(none)'}; name one of them, or {_NO_ID}"
        )
    return source


def _open_file(path: str, id_column: str | None, peek: bool = True) -> RowSource:
    name = path.lower()
    compressed = next((suffix for suffix in COMPRESSIONS if name.endswith(suffix)), None)
    base = name.removesuffix(compressed) if compressed else name
    if base.endswith(JSONL_SUFFIXES):
        kind = "jsonl"
    elif base.endswith(CSV_SUFFIXES):
        kind = "csv"
    elif base.endswith(PARQUET_SUFFIXES) and compressed is None:
        kind = "parquet"
    elif base.endswith(ARROW_SUFFIXES) and compressed is None:
        kind = "arrow"
    else:
        hint = " (a .json file: write one JSON object per line and name it .jsonl)" * (
            base.endswith(".json")
        ) or " (Parquet compresses inside the file: give it uncompressed)" * (
            base.endswith(PARQUET_SUFFIXES)
        )
        raise InputError(
            f"{shown_path(path)}: unknown input format{hint}; use .jsonl/.ndjson (one JSON "
            "object per line), .parquet, .csv or .arrow; JSONL and CSV may be compressed "
            f"({', '.join(COMPRESSIONS)}: data.jsonl.zst, data.csv.gz)"
        )
    open_input_file(path).close()  # a regular file, readable: refused now otherwise
    if kind == "jsonl":
        return _JsonlSource(path, id_column, compressed, peek=peek)
    if kind == "csv":
        return _CsvSource(path, id_column, compressed)
    if kind == "arrow":
        return _ArrowSource(path, id_column)
    return _ParquetSource(path, id_column)


@contextlib.contextmanager
def _binary(path: str, compressed: str | None) -> Iterator[IO[bytes]]:
    """An input file's bytes, decompressed by its suffix ``compressed`` (one of
    :data:`COMPRESSIONS`; see :func:`open_input_file`)."""
    with open_input_file(path) as raw:
        if compressed is None:
            yield raw
        elif compressed == ".gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as file:
                yield cast(IO[bytes], file)
        else:
            with io.BufferedReader(_Streams(raw, compressed), _READ) as file:
                yield cast(IO[bytes], file)


_READ = 1 << 17
"""Bytes of a compressed input read from the file at a time."""
_ZSTD_FEED = 1 << 12
"""Bytes of a ``.zst`` input decompressed at a time: zstd's decompressor takes no bound
on its output, so a small input bounds it (text expands ~5-10x; the worst case, a
run of one byte, about 32,000x: 128 MiB)."""
_ZSTD_WINDOW = 1 << 31
"""The largest window a ``.zst`` frame may need (``zstd --long`` writes up to 2 GiB)."""


class _Streams(io.RawIOBase):
    """A bzip2, xz or zstd file's content, one or more streams (frames) in a row as
    ``pbzip2``, ``pixz`` or ``pzstd`` write them, decompressed a bounded piece at a time.

    Stricter than the standard library's readers, which stop quietly at a damaged
    second stream (and the ``zstandard`` package's, which stops quietly at a cut): a
    file that ends inside a stream raises :class:`EOFError`, and anything after a stream
    that is not another one raises the decompressor's error. Either way no row is lost
    without a word.
    """

    def __init__(self, raw: IO[bytes], compressed: str) -> None:
        self._raw = raw
        self._new: Any
        if compressed == ".bz2":
            self._new = bz2.BZ2Decompressor
        elif compressed == ".xz":
            self._new = lzma.LZMADecompressor
        else:
            import zstandard  # only for .zst inputs

            self._new = zstandard.ZstdDecompressor(max_window_size=_ZSTD_WINDOW).decompressobj
        self._zstd = compressed == ".zst"
        self._unit = self._new()
        self._fed = False
        """Whether the current stream was given any input (a file may end only between
        streams)."""
        self._input = memoryview(b"")
        """Input read from the file and not yet given to a decompressor."""
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        while not self._out:
            if self._unit.eof:  # the next stream begins with what this one left
                self._input = memoryview(self._unit.unused_data + self._input.tobytes())
                self._unit, self._fed = self._new(), False
                continue
            if not self._input and (self._zstd or self._unit.needs_input):
                self._input = memoryview(self._raw.read(_READ))
                if not self._input:
                    if self._fed:
                        raise EOFError(
                            "Compressed file ended before the end-of-stream marker was reached"
                        )
                    return 0
                continue
            self._out = memoryview(self._step(max(len(target), io.DEFAULT_BUFFER_SIZE)))
        count = min(len(target), len(self._out))
        target[:count] = self._out[:count]
        self._out = self._out[count:]
        return count

    def _step(self, at_most: int) -> bytes:
        """Decompress a bounded piece (``at_most`` bytes out, for bzip2 and xz)."""
        if self._zstd:
            piece, self._input = self._input[:_ZSTD_FEED], self._input[_ZSTD_FEED:]
            self._fed = True
            return bytes(self._unit.decompress(piece))
        data = memoryview(b"")
        if self._unit.needs_input:
            data, self._input = self._input, memoryview(b"")
            self._fed = self._fed or bool(data)
        return bytes(self._unit.decompress(data, at_most))


def _unreadable(*also: type[BaseException]) -> tuple[type[BaseException], ...]:
    """What reading a damaged or cut-off input raises: :class:`OSError` (gzip, bz2),
    :class:`EOFError` (a stream that ends early), zlib's, LZMA's and zstd's own errors,
    and ``also``."""
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error, lzma.LZMAError, *also]
    zstandard = sys.modules.get("zstandard")
    if zstandard is not None:
        errors.append(zstandard.ZstdError)
    return tuple(errors)


class _JsonlSource(RowSource):
    def __init__(
        self, path: str, id_column: str | None, compressed: str | None, *, peek: bool = True
    ) -> None:
        self._path = path
        self.description = shown_path(path)
        self.id_column = id_column
        self._compressed = compressed
        self.columns = None
        if peek:
            with closing(self._records()) as records:
                first = next(records, None)
            if first is not None and first[2] is not None:
                self.columns = tuple(first[2])

    @contextlib.contextmanager
    def _open(self) -> Iterator[IO[bytes]]:
        try:
            with _binary(self._path, self._compressed) as file:
                yield file
        except _unreadable() as exc:
            raise InputError(f"cannot read {self.description}: {exc}") from exc

    def _blocks(self) -> Generator[tuple[int, list[bytes]], None, None]:
        """The file's lines about a MiB at a time, each block with its first line's number
        (the first line alone, which is all that finding the columns reads; a UTF-8 byte
        order mark before it dropped)."""
        with self._open() as file:
            try:
                if block := file.readlines(1):
                    block[0] = block[0].removeprefix(b"\xef\xbb\xbf")
                number = 1
                while block:
                    yield number, block
                    number += len(block)
                    block = file.readlines(_BLOCK_BYTES)
            except _unreadable() as exc:
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

    def _records(self, chosen: Selection | None = None) -> Generator[_Record, None, None]:
        path, loads = self.description, orjson.loads
        for position, number, line in self._lines(chosen):
            where = f"{path} line {number}"
            try:
                values = loads(line)
            except orjson.JSONDecodeError:
                values = None
            if type(values) is dict:
                yield position, where, values, None
            else:  # decoded again, to say why not
                yield position, where, *_decoded(line, where)

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

    def _span_records(self, span: tuple[int, int]) -> Iterator[_Record]:
        start, end = span
        path, loads = self.description, orjson.loads
        with self._open() as file:
            try:
                if start > 0:  # a line that begins before the span is the span before's
                    file.seek(start - 1)
                    file.readline()
                offset = file.tell()
                while offset < end:
                    block = file.readlines(_BLOCK_BYTES)
                    if not block:
                        return
                    for line in block:
                        if offset >= end:
                            return
                        at, offset = offset, offset + len(line)
                        if at == 0:  # the file's first line: without a byte order mark
                            line = line.removeprefix(_BOM)
                        if not line.strip():
                            continue
                        where = f"{path} byte {at}"
                        try:
                            values = loads(line)
                        except orjson.JSONDecodeError:
                            values = None
                        if type(values) is dict:
                            yield at, where, values, None
                        else:
                            yield at, where, *_decoded(line, where)
            except _unreadable() as exc:
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


class _CsvSource(RowSource):
    def __init__(self, path: str, id_column: str | None, compressed: str | None) -> None:
        self._path = path
        self.description = shown_path(path)
        self.id_column = id_column
        self._compressed = compressed
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
                _binary(self._path, self._compressed) as binary,
                io.TextIOWrapper(
                    binary, encoding="utf-8-sig", errors="surrogateescape", newline=""
                ) as file,
            ):
                yield file
        except _unreadable() as exc:
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
        except _unreadable(csv.Error) as exc:
            raise InputError(f"{self.description} line {reader.line_num + 1}: {exc}") from exc

    def _records(self, chosen: Selection | None = None) -> Iterator[_Record]:
        return self._read(chosen, None)

    def _id_records(self) -> Iterator[_Record]:
        return self._read(None, self.id_column)

    def _read(self, chosen: Selection | None, only: str | None) -> Iterator[_Record]:
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


class _ParquetSource(RowSource):
    def __init__(self, path: str, id_column: str | None) -> None:
        self._path = path
        self.description = shown_path(path)
        self.id_column = id_column
        try:
            with self._file() as file:
                self.columns = tuple(file.schema_arrow.names)
                self._num_rows = int(file.metadata.num_rows)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise InputError(f"cannot read {path} as Parquet: {exc}") from exc

    def _file(self) -> pq.ParquetFile:
        """The file, opened by pyarrow once it is seen to be a regular one (pyarrow's
        own open would wait on a FIFO)."""
        check_input_file(self._path)
        return pq.ParquetFile(self._path)

    def _count(self) -> int:
        return self._num_rows

    def _count_and_digest(self) -> tuple[int, str]:
        """The rows from the metadata, and a digest of the file's footer (the schema and
        each row group's sizes, offsets and statistics): no pass over the data."""
        with _binary(self._path, None) as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - 8))
            tail = file.read(8)
            length = int.from_bytes(tail[:4], "little") if len(tail) == 8 else 0
            file.seek(max(0, size - 8 - length))
            footer = file.read(length + 8)
        digest = hashlib.blake2b(b"size:%d;" % size, digest_size=16)
        digest.update(footer)
        return self._num_rows, digest.hexdigest()

    def _records(self, chosen: Selection | None = None) -> Iterator[_Record]:
        return self._read(None, chosen)

    def _id_records(self) -> Iterator[_Record]:
        assert self.id_column is not None
        return self._read([self.id_column], None)

    def _read(
        self,
        columns: list[str] | None,
        chosen: Selection | None,
        groups: tuple[int, int] | None = None,
        first: int = 0,
    ) -> Iterator[_Record]:
        try:
            with self._file() as file:
                batches = file.iter_batches(
                    batch_size=PARQUET_BATCH_ROWS,
                    columns=columns,
                    row_groups=range(*groups) if groups is not None else None,
                )
                yield from _batch_records(batches, f"{self.description} row", chosen, first)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise InputError(f"cannot read {self.description} as Parquet: {exc}") from exc

    def group_rows(self, groups: tuple[int, int], first: int, unit: int | None) -> Iterator[Row]:
        """The rows of the row groups ``groups`` (from, to: a half-open range), the first
        of them at position ``first`` of the file."""
        return self._rows(self._read(None, None, groups, first), unit)


class _ArrowSource(RowSource):
    """An Arrow IPC file, in the stream format (``datasets``' ``save_to_disk``) or the
    file format, memory-mapped: a batch is copied only as its rows are read."""

    def __init__(self, path: str, id_column: str | None) -> None:
        self._path = path
        self.description = shown_path(path)
        self.id_column = id_column
        with self._reader() as reader:
            self.columns = tuple(reader.schema.names)

    @contextlib.contextmanager
    def _reader(self) -> Iterator[Any]:
        check_input_file(self._path)
        try:
            with pa.memory_map(self._path) as source:
                try:
                    reader: Any = pa.ipc.open_stream(source)
                except pa.ArrowInvalid:
                    source.seek(0)
                    reader = pa.ipc.open_file(source)
                yield reader
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise InputError(f"cannot read {self.description} as Arrow: {exc}") from exc

    def _batches(self, reader: Any) -> Iterator[pa.RecordBatch]:
        if isinstance(reader, pa.ipc.RecordBatchFileReader):
            return (reader.get_batch(i) for i in range(reader.num_record_batches))
        return iter(reader)

    def _count(self) -> int:
        with self._reader() as reader:
            return sum(batch.num_rows for batch in self._batches(reader))

    def _records(self, chosen: Selection | None = None) -> Iterator[_Record]:
        with self._reader() as reader:
            yield from _batch_records(self._batches(reader), f"{self.description} row", chosen)


class _ListSource(RowSource):
    def __init__(self, data: Sequence[Any], id_column: str | None) -> None:
        self._data = data
        self.description = f"a list of {len(data)} rows"
        self.id_column = id_column
        first = data[0] if len(data) else None
        self.columns = tuple(first) if isinstance(first, Mapping) else None

    def _count(self) -> int:
        return len(self._data)

    def _records(self, chosen: Selection | None = None) -> Iterator[_Record]:
        return _items(self._data, "list item", chosen)


class _DatasetSource(RowSource):
    def __init__(self, data: Any, id_column: str | None) -> None:
        names = data.column_names
        if not isinstance(names, list | tuple):
            raise InputError(
                f"cannot read a {type(data).__name__} whose column_names is not a list "
                "(a DatasetDict?): pass one split, e.g. data['train']"
            )
        self._data = data
        self._label = "table row" if isinstance(data, pa.Table) else "dataset row"
        self.description = f"a {self._label.split()[0]} of {len(data)} rows"
        self.id_column = id_column
        self.columns = tuple(str(name) for name in names)

    def _count(self) -> int:
        return len(self._data)

    def _records(self, chosen: Selection | None = None) -> Iterator[_Record]:
        if isinstance(self._data, pa.Table):
            batches = self._data.to_batches(max_chunksize=PARQUET_BATCH_ROWS)
            return _batch_records(batches, self._label, chosen)
        return _items(self._data, self._label, chosen)

    def _id_records(self) -> Iterator[_Record]:
        if isinstance(self._data, pa.Table):
            table = self._data.select([self.id_column])
            return _batch_records(table.to_batches(max_chunksize=PARQUET_BATCH_ROWS), self._label)
        return self._records()


def _items(data: Any, label: str, chosen: Selection | None) -> Iterator[_Record]:
    for position, item in enumerate(data):
        if chosen is not None and position not in chosen:
            continue
        where = f"{label} {position}"
        if type(item) is dict:
            yield position, where, item, None
        elif isinstance(item, Mapping):
            yield position, where, dict(item), None
        else:
            problem = f"is a {type(item).__name__}, not a mapping of column names to values"
            yield position, where, None, f"{where}: {problem}"


def _batch_records(
    batches: Iterable[pa.RecordBatch], label: str, chosen: Selection | None = None, start: int = 0
) -> Iterator[_Record]:
    """The rows of Arrow record batches, numbered from ``start``; with ``chosen``, only
    its rows are turned into Python objects."""
    for batch in batches:
        size = batch.num_rows
        positions: Iterable[int] = range(start, start + size)
        if chosen is not None:
            offsets = chosen.offsets(start, start + size)
            batch = batch.take(pa.array(offsets))
            positions = (offsets + start).tolist()
        for position, values in zip(positions, batch.to_pylist(), strict=True):
            yield position, f"{label} {position}", values, None
        start += size
