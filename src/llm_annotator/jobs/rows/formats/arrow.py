"""Arrow IPC files, in the stream format, as ``datasets.Dataset.save_to_disk`` writes
them, or the file format.

The file is memory-mapped: a batch is copied only as its rows are read. The schema says
the columns, and the batch headers the number of rows, without a row being read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from llm_annotator.errors import InputError
from llm_annotator.jobs.files import check_input_file
from llm_annotator.jobs.rows.formats.base import Record, RowSource, Selection, batch_records


class ArrowSource(RowSource):
    """An Arrow IPC file, in the stream format (``datasets``' ``save_to_disk``) or the
    file format, memory-mapped: a batch is copied only as its rows are read."""

    columns_up_front = True
    rows_up_front = True

    def __init__(
        self, path: str, id_column: str | None, *, compressed: str | None = None, peek: bool = True
    ) -> None:
        self._take_file(path, id_column)
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

    def _records(self, chosen: Selection | None = None) -> Iterator[Record]:
        with self._reader() as reader:
            yield from batch_records(self._batches(reader), f"{self.description} row", chosen)
