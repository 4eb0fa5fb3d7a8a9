"""What every input format shares: the :class:`Row`, the :class:`RowSource` that each
format's reader is, the :class:`Selection` of one part's rows, and the
:class:`InputIdentity`.

A reader yields its rows as records (position, where, columns, error) from
:meth:`RowSource._records`; the generic part here makes them :class:`Row` objects,
checks the ids (present, an int or a str, unique, one in the output) and hashes them
for parts and for the input's identity. A row's id is its position (0-based, counting
rows, not blank lines) or the value of the id column.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import numpy as np
import orjson
import pyarrow as pa

from llm_annotator.errors import InputError
from llm_annotator.jobs.files import shown_path
from llm_annotator.jobs.ids import RowId, content_hash, hash_id, id_problem, output_form

PARQUET_BATCH_ROWS = 1024
"""Rows decoded at a time from a Parquet file, an Arrow table or any columnar input."""
NO_ID = "pass id_column=None to number the rows by position"
"""The way out that a message about an id offers."""

Record = tuple[int, str, "dict[str, Any] | None", "str | None"]
"""A row as a reader yields it: its position, where it is, its columns (None when
unreadable), the error."""
GroupRun = tuple["tuple[int, int] | None", int, int, int]
"""A run of a file's row groups: its groups (from, to: half-open; None for the whole
file), its first row, its rows and its bytes."""


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
        >>> from llm_annotator.jobs.rows.inputs import open_input
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

    Each input format's reader is one, named in the table of formats
    (:data:`~llm_annotator.jobs.rows.formats.FORMATS`). A reader opens its input in
    ``__init__`` and yields its rows from :meth:`_records`; it overrides what its format
    does faster (:meth:`_count`, :meth:`_id_records`, :meth:`_count_and_digest`,
    :meth:`_hashes`), and what its way of being cut into parts needs
    (:meth:`span_rows` for byte ranges; :meth:`group_runs` and :meth:`group_rows` for
    row groups).

    Attributes:
        description: What the input is, for messages: the path, or ``"a list of 3 rows"``.
        columns: The input's columns: all of them where :attr:`columns_up_front`; else
            the keys of the first row (later rows may differ), or None when that row
            cannot be read, there is none, or it was not read.
        id_column: The column that holds the row ids, or None for positions.
        columns_up_front: Whether the format says its columns before any row (a header,
            a schema), so that a missing id column is refused at once.
        rows_up_front: Whether the format says its number of rows without their being
            read (a footer, batch headers): :meth:`_count` reads no row.
    """

    description: str
    columns: tuple[str, ...] | None
    id_column: str | None
    columns_up_front: ClassVar[bool] = False
    rows_up_front: ClassVar[bool] = False

    @abstractmethod
    def __init__(
        self, data: Any, id_column: str | None, *, compressed: str | None = None, peek: bool = True
    ) -> None:
        """Open an input.

        Args:
            data: A file's path, for a file format; the object, for one in memory.
            id_column: The column holding each row's id; None numbers rows by position.
            compressed: The file's compression, for a format that may be compressed:
                one of :data:`~llm_annotator.jobs.rows.formats.compression.COMPRESSIONS`.
            peek: Whether a reader that learns the columns from the first row may read
                it now (to refuse a file that cannot be read at once).

        Raises:
            InputError: The input cannot be read.
        """

    def _take_file(self, path: str, id_column: str | None, compressed: str | None = None) -> None:
        """What every file reader keeps of its arguments: the path, how messages name
        it, the id column and the compression."""
        self._path = path
        self.description = shown_path(path)
        self.id_column = id_column
        self._compressed = compressed

    @classmethod
    def holds(cls, data: Any) -> bool:
        """For a format in memory: whether ``data`` is an object of it."""
        return False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.description!r} id_column={self.id_column!r}>"

    def span_rows(self, span: tuple[int, int], unit: int | None) -> Iterator[Row]:
        """The rows whose records begin within ``span`` (bytes, half-open), for a format
        cut into byte ranges."""
        raise NotImplementedError(f"{type(self).__name__} is not read in byte ranges")

    @classmethod
    def group_runs(cls, path: str, size: int, unit_bytes: int) -> list[GroupRun]:
        """A file of ``size`` bytes cut into runs of about ``unit_bytes`` of its row
        groups, for a format cut into row groups.

        Raises:
            InputError: The file's metadata cannot be read.
        """
        raise NotImplementedError(f"{cls.__name__} is not read in row groups")

    def group_rows(self, groups: tuple[int, int], first: int, unit: int | None) -> Iterator[Row]:
        """The rows of the row groups ``groups`` (from, to: a half-open range), the first
        of them at position ``first`` of the file."""
        raise NotImplementedError(f"{type(self).__name__} is not read in row groups")

    @abstractmethod
    def _records(self, chosen: Selection | None = None) -> Iterator[Record]:
        """Every row of the input, in order, read or not; with ``chosen``, only its rows
        (the others skipped before they are decoded, where the format allows)."""

    def _id_records(self) -> Iterator[Record]:
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

    def _rows(self, records: Iterator[Record], unit: int | None) -> Iterator[Row]:
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
                f"fix or remove it, or {NO_ID}"
            )
        if column not in values:
            raise InputError(
                f"{where} has no {column!r} field (id_column={column!r}); "
                f"every row needs one, or {NO_ID}"
            )
        value = values[column]
        problem = id_problem(value)
        if problem is None:
            return cast(RowId, value)
        raise InputError(f"{where}: the id in field {column!r} {problem}; fix it, or {NO_ID}")

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
                    f"unique: fix the input, or {NO_ID}"
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
                    f"all strings, and unique as text, or {NO_ID}"
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
        >>> from llm_annotator.jobs.rows.inputs import open_input
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


def mapping_records(data: Any, label: str, chosen: Selection | None) -> Iterator[Record]:
    """The rows of a sequence of mappings (``label`` and the position say where each
    is); an item that is not a mapping is an unreadable row."""
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


def batch_records(
    batches: Iterable[pa.RecordBatch], label: str, chosen: Selection | None = None, start: int = 0
) -> Iterator[Record]:
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
