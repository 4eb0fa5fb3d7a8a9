"""Datasets in memory: a ``datasets.Dataset`` (anything with ``column_names`` and
``__len__`` that iterates as dicts) or a ``pyarrow.Table``; and the folders that
``datasets.Dataset.save_to_disk`` writes, whose Arrow files a corpus reads in order.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import orjson
import pyarrow as pa

from llm_annotator.errors import InputError
from llm_annotator.jobs.files import read_bytes, shown_path
from llm_annotator.jobs.rows.formats.base import (
    PARQUET_BATCH_ROWS,
    Record,
    RowSource,
    Selection,
    batch_records,
    mapping_records,
)

SAVED_STATE = "state.json"
"""The file that marks a folder written by ``datasets.Dataset.save_to_disk``."""


class DatasetSource(RowSource):
    """A ``datasets.Dataset`` or a ``pyarrow.Table``, a batch at a time for a table."""

    columns_up_front = True

    def __init__(
        self, data: Any, id_column: str | None, *, compressed: str | None = None, peek: bool = True
    ) -> None:
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

    @classmethod
    def holds(cls, data: Any) -> bool:
        """Whether ``data`` has ``column_names`` and a length."""
        return hasattr(data, "column_names") and hasattr(data, "__len__")

    def _count(self) -> int:
        return len(self._data)

    def _records(self, chosen: Selection | None = None) -> Iterator[Record]:
        if isinstance(self._data, pa.Table):
            batches = self._data.to_batches(max_chunksize=PARQUET_BATCH_ROWS)
            return batch_records(batches, self._label, chosen)
        return mapping_records(self._data, self._label, chosen)

    def _id_records(self) -> Iterator[Record]:
        if isinstance(self._data, pa.Table):
            table = self._data.select([self.id_column])
            return batch_records(table.to_batches(max_chunksize=PARQUET_BATCH_ROWS), self._label)
        return self._records()


def saved_files(folder: str) -> list[str] | None:
    """The Arrow files of a ``save_to_disk`` folder in their order, or None if the
    folder is not one.

    Raises:
        InputError: It is a ``DatasetDict``'s folder, or its ``state.json`` is not one.
    """
    if os.path.isfile(os.path.join(folder, "dataset_dict.json")):
        raise InputError(
            f"{shown_path(folder)} holds a DatasetDict (several splits): give one split's "
            f"folder, e.g. {shown_path(os.path.join(folder, 'train'))}"
        )
    data = read_bytes(os.path.join(folder, SAVED_STATE))
    if data is None:
        return None
    try:
        state = orjson.loads(data)
        names = [entry["filename"] for entry in state["_data_files"]]
    except (orjson.JSONDecodeError, KeyError, TypeError) as error:
        raise InputError(
            f"{shown_path(folder)}/{SAVED_STATE} is not a saved dataset's state ({error}); "
            "save the dataset again, or remove the file"
        ) from None
    return [os.path.join(folder, str(name)) for name in names]
