"""Row ids: stable 64-bit hashes, so sets of 10^7 ids stay small."""

from __future__ import annotations

import hashlib

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
    if isinstance(row_id, bool) or not isinstance(row_id, int | str):
        raise TypeError(f"a row id is an int or a str, not {type(row_id).__name__}")
    tagged = f"i:{row_id}" if isinstance(row_id, int) else f"s:{row_id}"
    digest = hashlib.blake2b(tagged.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little")
