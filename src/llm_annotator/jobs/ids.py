"""Row ids: stable 64-bit hashes, so sets of 10^7 ids stay small."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from hashlib import blake2b
from typing import Any, TypeGuard, cast

import numpy as np
import orjson

from llm_annotator._validate import positive_int

RowId = int | str
"""A row's id: its position in the input, or the value of the id column."""


def hash_id(row_id: RowId) -> int:
    """A stable 64-bit hash of a row id; an int and its decimal string differ.

    Examples:
        >>> hash_id(7) == hash_id(7)
        True
        >>> hash_id(7) == hash_id("7")
        False
        >>> 0 <= hash_id("row-1") < 2**64
        True
    """
    kind = type(row_id)
    if kind is int:  # the common kinds first, without building a str
        tagged = b"i:%d" % cast(int, row_id)
    elif kind is str:
        tagged = ("s:" + cast(str, row_id)).encode("utf-8", "surrogatepass")
    elif isinstance(row_id, bool) or not isinstance(row_id, int | str):
        raise TypeError(f"a row id is an int or a str, not {kind.__name__}")
    else:  # a subclass of int or str
        text = f"i:{row_id}" if isinstance(row_id, int) else f"s:{row_id}"
        tagged = text.encode("utf-8", "surrogatepass")
    return int.from_bytes(blake2b(tagged, digest_size=8).digest(), "little")


CONTENT_FIELD = "_input_hash"
"""The record field that holds :func:`content_hash` of the row it was made from (16
hex digits), so that a resumed job knows which rows changed since; never an output
column."""
_CONTENT_OPTIONS = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def _as_text(value: object) -> str:
    return f"{type(value).__name__}:{value!r}"


def content_hash(values: Mapping[str, Any]) -> int:
    """A stable 64-bit hash of a row's content, in any order of its columns; never 0
    (which stands for "not recorded").

    Examples:
        >>> content_hash({"a": 1, "b": "x"}) == content_hash({"b": "x", "a": 1})
        True
        >>> content_hash({"a": 1}) == content_hash({"a": 2})
        False
        >>> content_hash({"a": 1}) == content_hash({"a": "1"})
        False
    """
    try:
        data = orjson.dumps(values, option=_CONTENT_OPTIONS, default=_as_text)
    except TypeError:  # text orjson refuses (a lone surrogate): a slower, stable form
        data = ascii(sorted(values.items(), key=lambda item: str(item[0]))).encode()
    return int.from_bytes(blake2b(data, digest_size=8).digest(), "little") or 1


def content_text(content: int) -> str:
    """A content hash as records hold it (:data:`CONTENT_FIELD`).

    Examples:
        >>> content_text(255)
        '00000000000000ff'
        >>> content_of({CONTENT_FIELD: content_text(255)})
        255
    """
    return f"{content:016x}"


def content_of(record: Mapping[str, Any]) -> int:
    """The content hash a record holds, or 0 if it holds none (written before contents
    were recorded) or one that is not 16 hex digits."""
    text = record.get(CONTENT_FIELD)
    if type(text) is not str or len(text) != 16:
        return 0
    try:
        return int(text, 16)
    except ValueError:
        return 0


def mix_hashes(
    ids: np.ndarray[Any, np.dtype[np.uint64]], contents: np.ndarray[Any, np.dtype[np.uint64]]
) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """One 64-bit key per (id hash, content hash) pair, elementwise.

    Examples:
        >>> a = np.array([1, 2], dtype=np.uint64)
        >>> [int(x) for x in mix_hashes(a, a)] == [int(x) for x in mix_hashes(a, a)]
        True
        >>> bool(mix_hashes(a, a[::-1])[0] != mix_hashes(a, a)[0])
        True
    """
    spread = contents.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    mixed: np.ndarray[Any, np.dtype[np.uint64]] = np.bitwise_xor(ids.astype(np.uint64), spread)
    return mixed


_MIN_BITMAP_BITS = 1 << 23
"""The bitmap may always cover ids below this (1 MiB), however few ids it holds."""
_BITS_PER_ID = 64
"""Beyond that, the bitmap grows only while it costs at most 64 bits (8 bytes, the price
of one hash) per id held: ids at least 1/64 dense are cheaper as bits than as hashes."""
_MERGE_THRESHOLD = 1 << 16
"""Recent hashes are merged into the sorted array when more than this many wait, or more
than 1/32 of the array, whichever is larger (so merging stays linear overall)."""


def _is_position(row_id: object) -> bool:
    return type(row_id) is int and row_id >= 0


class IdSet:
    """A compact set of row ids, for knowing which of 10^7 or more rows are done.

    Non-negative int ids (row positions) live in a growable bitmap, one bit an id, as
    long as they are dense enough for that to be cheaper than hashing them (at least
    one id in 64 of the range covered; the first 2^23 positions are always bits).
    Every other id (str ids, negative or far-apart ints) is kept as its 64-bit
    :func:`hash_id` in a sorted numpy ``uint64`` array, about 8 bytes an id with
    O(log n) lookups, plus a small Python set of recent hashes that is merged into
    the array as it grows. Int and str ids mix freely; ``7`` and ``"7"`` are different.

    Hashes can collide: two distinct hashed ids share a hash with probability about
    ``n**2 / 2**65`` for ``n`` hashed ids (about 3e-8 for 10^6 ids, 3e-4 for 10^8). A
    collision makes the second id look present although it was never added, so a job
    would skip that row as done. Ids held in the bitmap never collide.

    Ids cannot be removed. The set is not thread-safe.

    Args:
        merge_threshold: How many recent hashes wait in the Python set before they are
            merged into the sorted array (at least; see above).

    Examples:
        >>> done = IdSet()
        >>> done.add(3), done.add("row-9"), done.add(3)
        (True, True, False)
        >>> 3 in done, "row-9" in done, "3" in done, 4 in done
        (True, True, False, False)
        >>> len(done)
        2
        >>> done.update(range(1000))
        999
    """

    __slots__ = ("_bits", "_merge_threshold", "_num_bits", "_recent", "_sorted")

    def __init__(self, *, merge_threshold: int = _MERGE_THRESHOLD) -> None:
        positive_int("merge_threshold", merge_threshold)
        self._merge_threshold = merge_threshold
        self._bits = bytearray()
        self._num_bits = 0
        self._sorted: np.ndarray[Any, np.dtype[np.uint64]] = np.empty(0, dtype=np.uint64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        return self._num_bits + len(self._sorted) + len(self._recent)

    def __contains__(self, row_id: object) -> bool:
        if _is_position(row_id):
            position = cast(int, row_id)
            byte = position >> 3
            if byte < len(self._bits) and self._bits[byte] >> (position & 7) & 1:
                return True
            if not self._recent and not len(self._sorted):
                return False
        return self._has_hash(hash_id(cast(RowId, row_id)))

    def __repr__(self) -> str:
        return (
            f"<IdSet ids={len(self)} bitmap_bytes={len(self._bits)} "
            f"hashed={len(self._sorted) + len(self._recent)}>"
        )

    @property
    def nbytes(self) -> int:
        """Roughly how much memory the set takes, in bytes."""
        return len(self._bits) + self._sorted.nbytes + 64 * len(self._recent)

    def add(self, row_id: RowId) -> bool:
        """Add one id.

        Returns:
            Whether the id was new.

        Raises:
            TypeError: If the id is neither an int nor a str.
        """
        if _is_position(row_id):
            position = cast(int, row_id)
            if self._bitmap_covers(position):
                return self._set_bit(position)
            if position in self:
                return False
        h = hash_id(row_id)
        if self._has_hash(h):
            return False
        self._recent.add(h)
        if len(self._recent) > max(self._merge_threshold, len(self._sorted) >> 5):
            self._merge()
        return True

    def update(self, row_ids: Iterable[RowId]) -> int:
        """Add many ids at once; faster than :meth:`add` one by one for hashed ids.

        Returns:
            How many of them were new.
        """
        added = 0
        hashes: list[int] = []
        for row_id in row_ids:
            if _is_position(row_id):
                added += self.add(row_id)
            else:
                hashes.append(hash_id(row_id))
        if hashes:
            self._merge()
            new = np.unique(np.array(hashes, dtype=np.uint64))
            new = new[~self._sorted_contains(new)]
            self._sorted = _merge_sorted(self._sorted, new)
            added += len(new)
        return added

    def _bitmap_covers(self, position: int) -> bool:
        """Whether the bitmap covers ``position``, growing it if that is worth it."""
        byte = position >> 3
        if byte < len(self._bits):
            return True
        if position >= max(_MIN_BITMAP_BITS, _BITS_PER_ID * (len(self) + 1)):
            return False
        size = max(byte + 1, 2 * len(self._bits), 1024)
        self._bits.extend(bytes(size - len(self._bits)))
        return True

    def _set_bit(self, position: int) -> bool:
        byte, mask = position >> 3, 1 << (position & 7)
        if self._bits[byte] & mask:
            return False
        if (self._recent or len(self._sorted)) and self._has_hash(hash_id(position)):
            return False  # hashed before the bitmap grew to cover it
        self._bits[byte] |= mask
        self._num_bits += 1
        return True

    def _has_hash(self, h: int) -> bool:
        if h in self._recent:
            return True
        array = self._sorted
        index = int(array.searchsorted(np.uint64(h)))
        return index < len(array) and int(array[index]) == h

    def _sorted_contains(
        self, hashes: np.ndarray[Any, np.dtype[np.uint64]]
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        array = self._sorted
        if not len(array):
            return np.zeros(len(hashes), dtype=np.bool_)
        index = np.minimum(np.searchsorted(array, hashes), len(array) - 1)
        return np.asarray(array[index] == hashes)

    def _merge(self) -> None:
        if self._recent:
            recent = np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent))
            recent.sort()
            self._sorted = _merge_sorted(self._sorted, recent)
            self._recent.clear()


def _merge_sorted(
    array: np.ndarray[Any, np.dtype[np.uint64]], new: np.ndarray[Any, np.dtype[np.uint64]]
) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """Two sorted arrays with no common element merged into one, in linear time."""
    if not len(array):
        return new
    return np.insert(array, np.searchsorted(array, new), new)


INT64_BOUND = 1 << 63
"""Ids that are ints lie in ``[-INT64_BOUND, INT64_BOUND)``: a signed 64-bit column."""


def id_problem(value: object) -> str | None:
    """Why ``value`` cannot be a row id, or None if it can: the one rule for ids, which
    the input's scan and the result store both apply, so every id a job sends is one
    it can store.

    An id is an int that fits a signed 64-bit column, or a non-empty str that is valid
    Unicode (no lone surrogates, which cannot be written as UTF-8).

    Examples:
        >>> id_problem(7), id_problem("row-7")
        (None, None)
        >>> id_problem(2**63)
        'is an int beyond 64 bits (ids must be from -2**63 to 2**63-1)'
        >>> id_problem("a\\udcff")
        'is a string with a lone surrogate (not valid Unicode): not storable as UTF-8'
        >>> id_problem(True)
        'is True, a bool; ids must be ints or strings'
        >>> id_problem(1.0)
        'is 1.0, a float; ids must be ints or strings'
    """
    kind = type(value)
    if kind is int:
        if -INT64_BOUND <= value < INT64_BOUND:  # type: ignore[operator]
            return None
        return "is an int beyond 64 bits (ids must be from -2**63 to 2**63-1)"
    if isinstance(value, str):
        text = str(value)
        if not text:
            return "is empty"
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return "is a string with a lone surrogate (not valid Unicode): not storable as UTF-8"
        return None
    if value is None:
        return "is null"
    if isinstance(value, int) and not isinstance(value, bool):
        return id_problem(int(value))
    return f"is {value!r:.80}, a {kind.__name__}; ids must be ints or strings"


def is_valid_id(value: object) -> TypeGuard[RowId]:
    """Whether ``value`` can be a row id (:func:`id_problem` finds nothing wrong).

    Examples:
        >>> is_valid_id(3), is_valid_id("a"), is_valid_id(True), is_valid_id(2**63)
        (True, True, False, False)
    """
    return id_problem(value) is None


def output_form(row_id: RowId) -> str:
    """An id as an output column of mixed int and str ids holds it: its text.

    Two ids with one output form (``1`` and ``"1"``) would be two rows with one id.

    Examples:
        >>> output_form(1) == output_form("1")
        True
    """
    return row_id if isinstance(row_id, str) else str(int(row_id))
