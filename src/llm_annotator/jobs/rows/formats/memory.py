"""Rows in memory: a list (any sequence) of dicts, one a row.

An item that is not a mapping is an unreadable row; the columns are the first row's
keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from llm_annotator.jobs.rows.formats.base import Record, RowSource, Selection, mapping_records


class ListSource(RowSource):
    """A list of dicts (or of other mappings).

    Examples:
        >>> source = ListSource([{"text": "a"}, {"text": "b"}], None)
        >>> source.description, source.columns, [row.where for row in source]
        ('a list of 2 rows', ('text',), ['list item 0', 'list item 1'])
    """

    def __init__(
        self,
        data: Sequence[Any],
        id_column: str | None,
        *,
        compressed: str | None = None,
        peek: bool = True,
    ) -> None:
        self._data = data
        self.description = f"a list of {len(data)} rows"
        self.id_column = id_column
        first = data[0] if len(data) else None
        self.columns = tuple(first) if isinstance(first, Mapping) else None

    @classmethod
    def holds(cls, data: Any) -> bool:
        """Whether ``data`` is a sequence (not text or bytes, not read once).

        Examples:
            >>> ListSource.holds([{"t": 1}]), ListSource.holds(x for x in [1])
            (True, False)
        """
        return isinstance(data, Sequence) and not isinstance(data, str | bytes | bytearray)

    def _count(self) -> int:
        return len(self._data)

    def _records(self, chosen: Selection | None = None) -> Iterator[Record]:
        return mapping_records(self._data, "list item", chosen)
