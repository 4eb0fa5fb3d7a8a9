"""The end of a job: every shard's records merged into one table, one row per id.

``consolidate`` reads the shards into Arrow a chunk of records at a time (never the
whole run as Python dicts), picks one record per id, sorts by id and writes
``annotations.parquet`` (and, if asked, ``annotations.jsonl``) at the top of the run
directory, each by an atomic rename, so a reader never sees half a file.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import structlog

from llm_annotator.errors import JobError
from llm_annotator.jobs.store import (
    DirectoryLock,
    atomic_write,
    is_error_record,
    read_shard,
    shard_paths,
)

logger = structlog.get_logger(__name__)

PARQUET_FILE = "annotations.parquet"
JSONL_FILE = "annotations.jsonl"
_CHUNK = 1 << 14
"""Records parsed into Python dicts at a time before they become Arrow arrays."""
_ROWS = "\x00rows"
"""A placeholder column in each chunk, so a chunk whose records hold only ids keeps its
row count (never written out; a record key of that name would just take its place)."""
_ROW_GROUP = 1 << 17
"""Rows gathered (copied) and written to Parquet at a time."""
_SORT_KEYS = [
    ("kind", "ascending"),  # 0 for int ids, 1 for str ids: ints first
    ("int_id", "ascending"),
    ("str_id", "ascending"),
    ("ok", "ascending"),  # a success after (so it beats) any error for the same id
    ("shard", "ascending"),  # then the last written wins
    ("offset", "ascending"),
]


@dataclass(frozen=True, slots=True)
class Consolidated:
    """What :func:`consolidate` wrote, and a summary of the results.

    Attributes:
        parquet_path: The Parquet file, one row per id sorted by id.
        jsonl_path: The JSON Lines file with the same rows, if one was asked for.
        num_rows: Rows written (distinct ids).
        num_succeeded: Rows whose record is not an error.
        num_failed: Rows whose record is an error (a truthy ``"error"`` field).
        by_finish_reason: Rows per ``finish_reason`` (rows without one not counted).
        by_error_type: Failed rows per ``error_type`` (``"unknown"`` when missing).
        prompt_tokens: The sum of ``num_prompt_tokens`` over the rows.
        output_tokens: The sum of ``num_output_tokens`` over the rows.
    """

    parquet_path: Path
    jsonl_path: Path | None
    num_rows: int
    num_succeeded: int
    num_failed: int
    by_finish_reason: dict[str, int]
    by_error_type: dict[str, int]
    prompt_tokens: int
    output_tokens: int


def consolidate(
    output_dir: str | os.PathLike[str],
    *,
    jsonl: bool = False,
    column_order: Sequence[str] | None = None,
) -> Consolidated:
    """Merge a run directory's shards into ``annotations.parquet``, one row per id.

    For an id with several records (an error, then a retry), a success beats an
    error, and among records of the same kind the last written wins. Rows are sorted
    by id: int ids numerically first, then str ids in code-point order. Records with
    different keys are fine (a missing key is null). A column whose values have
    conflicting types (an int here, a str there; dicts of different shapes) becomes a
    string column, non-str values JSON-encoded, with a warning naming it; the id
    column too when ids mix ints and strs.

    The directory's lock is taken for the duration: close the run's
    :class:`~llm_annotator.jobs.store.ResultStore` first.

    Args:
        output_dir: The run directory.
        jsonl: Also write ``annotations.jsonl``: the same rows and columns, each value
            as the record held it (no type conversions).
        column_order: Columns to put first, in this order; the others follow in the
            order they were first seen. Names no record has are left out.

    Returns:
        Where the files are, and counts over the rows.

    Raises:
        JobError: If the directory does not exist or another process is using it.
    """
    directory = Path(output_dir)
    if not directory.is_dir():
        raise JobError(f"cannot consolidate {directory}: no such run directory")
    lock = DirectoryLock.acquire(directory, "consolidate")
    try:
        return _consolidate(directory, jsonl=jsonl, column_order=column_order or ())
    finally:
        lock.release()


def _consolidate(directory: Path, *, jsonl: bool, column_order: Sequence[str]) -> Consolidated:
    shards = shard_paths(directory)
    loaded = _Loader()
    for index, path in enumerate(shards):
        loaded.read(index, path)
    data, keys = loaded.tables()
    names = [name for name in column_order if name in loaded.names]
    names += [name for name in loaded.names if name not in names]
    if "id" not in names:  # no records at all
        names.insert(0, "id")
    del loaded

    winners = _winners(keys)
    keys = keys.take(winners)
    ids = _id_column(keys)
    schema = data.schema.append(pa.field("id", ids.type))
    schema = pa.schema([schema.field(name) for name in names])
    summary = _Summary()
    parquet_path = directory / PARQUET_FILE
    with atomic_write(parquet_path) as file, pq.ParquetWriter(file, schema) as writer:
        for start in range(0, len(winners), _ROW_GROUP):  # one slice taken at a time
            part = data.take(winners.slice(start, _ROW_GROUP))
            part = part.append_column("id", ids.slice(start, _ROW_GROUP)).select(names)
            writer.write_table(part)
            summary.add(part, keys["ok"].slice(start, _ROW_GROUP))
    del data
    jsonl_path = None
    if jsonl:
        jsonl_path = directory / JSONL_FILE
        with atomic_write(jsonl_path) as file:
            _write_jsonl(file, shards, keys, names)
    result = summary.result(parquet_path, jsonl_path)
    logger.info(
        "results_consolidated",
        output_dir=str(directory),
        rows=result.num_rows,
        succeeded=result.num_succeeded,
        failed=result.num_failed,
        shards=len(shards),
    )
    return result


class _Summary:
    """Counts over the rows written, gathered a slice at a time."""

    def __init__(self) -> None:
        self.rows = 0
        self.succeeded = 0
        self.finish_reasons: Counter[str] = Counter()
        self.error_types: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.output_tokens = 0

    def add(self, part: pa.Table, ok: pa.ChunkedArray) -> None:
        self.rows += part.num_rows
        self.succeeded += int(pc.sum(ok).as_py() or 0)
        self.finish_reasons.update(_labels(part, "finish_reason"))
        self.error_types.update(_labels(part.filter(pc.invert(ok)), "error_type", "unknown"))
        self.prompt_tokens += _total(part, "num_prompt_tokens")
        self.output_tokens += _total(part, "num_output_tokens")

    def result(self, parquet_path: Path, jsonl_path: Path | None) -> Consolidated:
        return Consolidated(
            parquet_path=parquet_path,
            jsonl_path=jsonl_path,
            num_rows=self.rows,
            num_succeeded=self.succeeded,
            num_failed=self.rows - self.succeeded,
            by_finish_reason=_most_first(self.finish_reasons),
            by_error_type=_most_first(self.error_types),
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
        )


class _Loader:
    """Shard records turned into Arrow tables, a chunk at a time.

    Each chunk gives two tables of equal length: the data columns (every key but
    ``id``) and the bookkeeping ones (id, success, where the record sits).
    """

    def __init__(self) -> None:
        self.names: dict[str, None] = {}  # every key seen, in first-seen order
        self.stringified: set[str] = set()
        self._data: list[pa.Table] = []
        self._keys: list[pa.Table] = []

    def read(self, index: int, path: Path) -> None:
        records: list[dict[str, Any]] = []
        places: list[tuple[int, int]] = []
        for offset, length, record in read_shard(path):
            records.append(record)
            places.append((offset, length))
            if len(records) == _CHUNK:
                self._add(index, records, places)
                records, places = [], []
        if records:
            self._add(index, records, places)

    def _add(
        self, index: int, records: list[dict[str, Any]], places: list[tuple[int, int]]
    ) -> None:
        names = dict.fromkeys(name for record in records for name in record)
        self.names.update(names)
        columns = {_ROWS: pa.nulls(len(records))}  # keeps the row count, whatever the keys
        columns.update(
            (name, self._array(name, [record.get(name) for record in records]))
            for name in names
            if name != "id"
        )
        self._data.append(pa.table(columns))
        ids = [record["id"] for record in records]
        offsets, lengths = zip(*places, strict=True)
        self._keys.append(
            _key_table(
                kind=[int(isinstance(i, str)) for i in ids],
                int_id=[i if type(i) is int else 0 for i in ids],
                str_id=[i if isinstance(i, str) else "" for i in ids],
                ok=[not is_error_record(record) for record in records],
                shard=[index] * len(records),
                offset=offsets,
                length=lengths,
            )
        )

    def _array(self, name: str, values: list[Any]) -> pa.Array:
        try:
            array = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            self.stringified.add(name)
            return _texts(values)
        return array

    def tables(self) -> tuple[pa.Table, pa.Table]:
        """All chunks as one data table and one key table, types made to agree."""
        if not self._keys:
            empty: list[Any] = []
            keys = _key_table(empty, empty, empty, empty, empty, empty, empty)
            return pa.table({_ROWS: pa.nulls(0)}), keys
        for name in self.names:
            if name != "id" and not self._agree(name):
                self.stringified.add(name)
        for name in sorted(self.stringified):
            logger.warning("column_stored_as_strings", column=name)
            self._data = [_stringify(table, name) for table in self._data]
        data = pa.concat_tables(self._data, promote_options="permissive")
        return data, pa.concat_tables(self._keys)

    def _agree(self, name: str) -> bool:
        """Whether the chunks' types for a column unify into one Parquet can store."""
        types = [t.schema.field(name).type for t in self._data if name in t.column_names]
        distinct = list(dict.fromkeys(t for t in types if not pa.types.is_null(t)))
        try:
            schema = pa.unify_schemas(
                [pa.schema([(name, t)]) for t in distinct] or [pa.schema([(name, pa.null())])],
                promote_options="permissive",
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, NotImplementedError):
            return False
        return _storable(schema.field(name).type)


def _key_table(
    kind: Sequence[int],
    int_id: Sequence[int],
    str_id: Sequence[str],
    ok: Sequence[bool],
    shard: Sequence[int],
    offset: Sequence[int],
    length: Sequence[int],
) -> pa.Table:
    """The bookkeeping columns of some records: id, success, where each record sits."""
    return pa.table(
        {
            "kind": pa.array(kind, pa.int8()),  # 0 for an int id, 1 for a str id
            "int_id": pa.array(int_id, pa.int64()),
            "str_id": pa.array(str_id, pa.string()),
            "ok": pa.array(ok, pa.bool_()),
            "shard": pa.array(shard, pa.int32()),
            "offset": pa.array(offset, pa.int64()),
            "length": pa.array(length, pa.int64()),
        }
    )


def _storable(data_type: pa.DataType) -> bool:
    """Whether Parquet can hold the type (it has no struct without fields)."""
    if pa.types.is_struct(data_type):
        fields = [data_type.field(i) for i in range(data_type.num_fields)]
        return bool(fields) and all(_storable(field.type) for field in fields)
    if pa.types.is_list(data_type) or pa.types.is_large_list(data_type):
        return _storable(data_type.value_type)
    return True


def _texts(values: Iterable[Any]) -> pa.Array:
    """Values as strings: str kept, None null, anything else JSON-encoded."""
    return pa.array(
        [
            value if value is None or isinstance(value, str) else orjson.dumps(value).decode()
            for value in values
        ],
        pa.string(),
    )


def _stringify(table: pa.Table, name: str) -> pa.Table:
    if name not in table.column_names or pa.types.is_string(table.schema.field(name).type):
        return table
    index = table.column_names.index(name)
    return table.set_column(index, name, _texts(table[name].to_pylist()))


def _winners(keys: pa.Table) -> pa.Array:
    """The row of each id's winning record, in id order."""
    order = pc.sort_indices(keys, sort_keys=_SORT_KEYS)
    if len(order) < 2:
        return order
    kind = keys["kind"].take(order).to_numpy()
    ints = keys["int_id"].take(order).to_numpy()
    strs = keys["str_id"].take(order)
    same = (kind[1:] == kind[:-1]) & (ints[1:] == ints[:-1])
    same &= pc.equal(strs[1:], strs[:-1]).to_numpy()
    last = np.append(~same, True)
    return order.filter(pa.array(last))


def _id_column(keys: pa.Table) -> pa.ChunkedArray:
    """The ids as one column: int64, string, or strings for a mix (with a warning)."""
    is_str = pc.equal(keys["kind"], 1)
    strs = int(pc.sum(is_str).as_py() or 0)
    if strs == 0:
        return keys["int_id"]
    if strs == keys.num_rows:
        return keys["str_id"]
    logger.warning("id_column_stored_as_strings", column="id")
    return pc.if_else(is_str, keys["str_id"], pc.cast(keys["int_id"], pa.string()))


def _write_jsonl(file: Any, shards: list[Path], keys: pa.Table, names: list[str]) -> None:
    """Each winning record read back from its shard, its keys in ``names`` order."""
    handles: dict[int, Any] = {}
    try:
        for shard, offset, length in zip(
            keys["shard"].to_pylist(),
            keys["offset"].to_pylist(),
            keys["length"].to_pylist(),
            strict=True,
        ):
            handle = handles.get(shard)
            if handle is None:
                if len(handles) >= 64:
                    for open_handle in handles.values():
                        open_handle.close()
                    handles.clear()
                handle = handles[shard] = shards[shard].open("rb")
            record = orjson.loads(os.pread(handle.fileno(), length, offset))
            file.write(orjson.dumps({name: record.get(name) for name in names}))
            file.write(b"\n")
    finally:
        for handle in handles.values():
            handle.close()


def _labels(data: pa.Table, name: str, missing: str | None = None) -> list[str]:
    """A column's values as labels; nulls become ``missing`` or are left out."""
    values = data[name].to_pylist() if name in data.column_names else [None] * data.num_rows
    labels = [missing if value is None else str(value) for value in values]
    return [label for label in labels if label is not None]


def _most_first(counts: Counter[str]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def _total(data: pa.Table, name: str) -> int:
    """The sum of a numeric column (0 if it is missing or not numeric)."""
    if name not in data.column_names:
        return 0
    column = data[name]
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        return 0
    return int(pc.sum(column).as_py() or 0)
