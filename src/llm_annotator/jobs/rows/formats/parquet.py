"""Parquet: columns in row groups, compressed inside the file.

Rows are decoded a batch at a time, only the columns asked for; the footer says the
columns and the number of rows without a row being read, and a large file can be read
in runs of its row groups (:meth:`ParquetSource.group_runs`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from llm_annotator.errors import InputError
from llm_annotator.jobs.files import check_input_file, open_input_file, shown_path
from llm_annotator.jobs.rows.formats.base import (
    PARQUET_BATCH_ROWS,
    GroupRun,
    Record,
    Row,
    RowSource,
    Selection,
    batch_records,
)


class ParquetSource(RowSource):
    """A Parquet file."""

    columns_up_front = True
    rows_up_front = True

    def __init__(
        self, path: str, id_column: str | None, *, compressed: str | None = None, peek: bool = True
    ) -> None:
        self._take_file(path, id_column)
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
        with open_input_file(self._path) as file:
            size = file.seek(0, os.SEEK_END)
            file.seek(max(0, size - 8))
            tail = file.read(8)
            length = int.from_bytes(tail[:4], "little") if len(tail) == 8 else 0
            file.seek(max(0, size - 8 - length))
            footer = file.read(length + 8)
        digest = hashlib.blake2b(b"size:%d;" % size, digest_size=16)
        digest.update(footer)
        return self._num_rows, digest.hexdigest()

    def _records(self, chosen: Selection | None = None) -> Iterator[Record]:
        return self._read(None, chosen)

    def _id_records(self) -> Iterator[Record]:
        assert self.id_column is not None
        return self._read([self.id_column], None)

    def _read(
        self,
        columns: list[str] | None,
        chosen: Selection | None,
        groups: tuple[int, int] | None = None,
        first: int = 0,
    ) -> Iterator[Record]:
        try:
            with self._file() as file:
                batches = file.iter_batches(
                    batch_size=PARQUET_BATCH_ROWS,
                    columns=columns,
                    row_groups=range(*groups) if groups is not None else None,
                )
                yield from batch_records(batches, f"{self.description} row", chosen, first)
        except (OSError, ValueError, pa.ArrowException) as exc:
            raise InputError(f"cannot read {self.description} as Parquet: {exc}") from exc

    def group_rows(self, groups: tuple[int, int], first: int, unit: int | None) -> Iterator[Row]:
        """The rows of the row groups ``groups`` (from, to: a half-open range), the first
        of them at position ``first`` of the file."""
        return self._rows(self._read(None, None, groups, first), unit)

    @classmethod
    def group_runs(cls, path: str, size: int, unit_bytes: int) -> list[GroupRun]:
        """The file's row groups in runs of about ``unit_bytes``: each run's groups,
        first row, rows and bytes (one run of None when the file has one group)."""
        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as error:  # pyarrow raises many kinds for a damaged footer
            raise InputError(f"cannot read {shown_path(path)} as Parquet: {error}") from None
        groups = meta.num_row_groups
        if groups <= 1:
            return [(None, 0, meta.num_rows, size)]
        parts: list[GroupRun] = []
        start, first, rows, stored_bytes = 0, 0, 0, 0
        position = 0
        for index in range(groups):
            group = meta.row_group(index)
            stored = sum(group.column(c).total_compressed_size for c in range(group.num_columns))
            if index > start and stored_bytes + stored > unit_bytes:
                parts.append(((start, index), first, rows, stored_bytes))
                start, first, rows, stored_bytes = index, position, 0, 0
            rows += group.num_rows
            stored_bytes += stored
            position += group.num_rows
        parts.append(((start, groups), first, rows, stored_bytes))
        return parts
