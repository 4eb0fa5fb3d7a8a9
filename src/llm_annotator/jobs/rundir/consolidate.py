"""The end of a job: every shard's records merged into one table, one row per id.

``consolidate`` works in two passes so that its memory does not grow with the run's
data: the first reads every shard a chunk of records at a time and keeps only each
record's id, success and place (about 40 bytes) and each column's type
(:class:`~llm_annotator.jobs.rundir.loading.Loader`); the second reads the winning
records back by their place, one row group in id order at a time, and writes them. A
directory whose one shard a store wrote in this process, followed as it wrote it
(:class:`~llm_annotator.jobs.rundir.loading.Written`), skips the first pass, and the
second reads back only the records not held in memory. ``annotations.parquet`` (and, if
asked, ``annotations.jsonl``) lands at the top of the run directory by an atomic rename,
so a reader never sees half a file.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import structlog

from llm_annotator.errors import JobError, RunDirectoryError
from llm_annotator.jobs.files import open_binary, read_run_file
from llm_annotator.jobs.ids import hash_id, mix_hashes
from llm_annotator.jobs.rundir.loading import Loader, Written
from llm_annotator.jobs.rundir.store import (
    DirectoryLock,
    atomic_write,
    read_shard,
    shard_paths,
)

log = structlog.get_logger(__name__)

PARQUET_FILE = "annotations.parquet"
JSONL_FILE = "annotations.jsonl"
INPUT_IDS_FILE = "input_ids.u64"
"""Beside a consolidation that kept only some ids (a directory of mixed inputs): the
hashes of the ids kept, sorted, as little-endian 64-bit integers. ``merge`` reads it
to keep the same rows of a shard."""
STALE_FILE = "stale_records.u64"
"""Beside a consolidation that left out stale records (rows whose input changed since):
their keys (:func:`~llm_annotator.jobs.ids.mix_hashes`), sorted, as
little-endian 64-bit integers; ``merge`` reads it to leave out the same records."""
_CHUNK = 1 << 14
"""Records parsed into Python dicts at a time before they become Arrow arrays."""
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
        left_out: Ids with a result in the shards that were not written, because they
            are not among the ids to ``keep`` (rows of another input).
        schema: The Parquet file's columns, as written.
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
    left_out: int = 0
    schema: pa.Schema | None = None


def consolidate(
    output_dir: str | os.PathLike[str],
    *,
    jsonl: bool = False,
    column_order: Sequence[str] | None = None,
    keep: np.ndarray[Any, np.dtype[np.uint64]] | None = None,
    target: Path | None = None,
    constants: Mapping[str, str] | None = None,
    types: Mapping[str, pa.DataType] | None = None,
    stale: np.ndarray[Any, np.dtype[np.uint64]] | None = None,
    written: Written | None = None,
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
    :class:`~llm_annotator.jobs.rundir.store.ResultStore` first.

    Args:
        output_dir: The run directory.
        jsonl: Also write ``annotations.jsonl``: the same rows and columns, each value
            as the record held it (no type conversions).
        column_order: Columns to put first, in this order; the others follow in the
            order they were first seen. Names no record has are left out, unless
            ``types`` gives their type.
        keep: Write only the ids whose :func:`~llm_annotator.jobs.ids.hash_id` is in
            this sorted array (the current input's ids, when the directory may hold
            results of another input); the others are counted in ``left_out``. The
            array is also written to :data:`INPUT_IDS_FILE`.
        target: Where the Parquet file goes instead of ``annotations.parquet`` in the
            directory (a corpus job's unit goes to its file in ``annotations/``).
        constants: Columns of one value on every row, added last (a corpus unit's
            file name).
        types: The type of a column that no record gives a value (all null), so that
            the files of a corpus job agree: an answer column, say.
        stale: Keys (:func:`~llm_annotator.jobs.ids.mix_hashes` of id and content
            hashes, sorted) of records to leave out: made from rows whose content has
            changed since (see :mod:`~llm_annotator.jobs.rundir.changes`). Also written
            to :data:`STALE_FILE`.
        written: What the directory's store wrote, followed as it wrote it: if its
            shard is all the directory holds, the records are not read again (only
            those it did not hold in memory, once, by their place); otherwise the
            shards are read as without it.

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
        if keep is not None:
            with atomic_write(directory / INPUT_IDS_FILE) as file:
                file.write(keep.astype("<u8", copy=False).tobytes())
        if stale is not None:
            with atomic_write(directory / STALE_FILE) as file:
                file.write(stale.astype("<u8", copy=False).tobytes())
        return _consolidate(
            directory,
            jsonl=jsonl,
            column_order=column_order or (),
            keep=keep,
            target=target,
            constants=constants or {},
            types=types or {},
            stale=stale if stale is not None else read_stale(directory),
            written=written,
        )
    finally:
        lock.release()


def read_input_ids(directory: Path) -> np.ndarray[Any, np.dtype[np.uint64]] | None:
    """The id hashes a consolidation of ``directory`` kept (:data:`INPUT_IDS_FILE`),
    or None if it wrote none.

    Raises:
        RunDirectoryError: The file is a link, not a regular file, cannot be read, or
            is not a sorted list of 64-bit hashes.
    """
    return _read_hashes(directory / INPUT_IDS_FILE, "id hashes")


def read_stale(directory: Path) -> np.ndarray[Any, np.dtype[np.uint64]] | None:
    """The keys of the stale records a consolidation of ``directory`` left out
    (:data:`STALE_FILE`), or None if it wrote none.

    Raises:
        RunDirectoryError: The file is a link, not a regular file, cannot be read, or
            is not a sorted list of 64-bit keys.
    """
    return _read_hashes(directory / STALE_FILE, "record keys")


def _read_hashes(path: Path, what: str) -> np.ndarray[Any, np.dtype[np.uint64]] | None:
    """A sorted list of 64-bit hashes the job wrote, or None if there is none."""
    data = read_run_file(path)
    if data is None:
        return None
    again = "run the job in it again to write it anew"
    if len(data) % 8:
        raise RunDirectoryError(
            f"{path} is not a list of {what} ({len(data)} bytes, not a multiple of 8); {again}",
            path=str(path),
        )
    hashes = np.frombuffer(data, dtype="<u8").astype(np.uint64)
    if len(hashes) > 1 and bool(np.any(hashes[1:] < hashes[:-1])):
        raise RunDirectoryError(f"{path} is not a sorted list of {what}; {again}", path=str(path))
    return hashes


def _without_stale(keys: pa.Table, stale: np.ndarray[Any, np.dtype[np.uint64]]) -> pa.Table:
    """The records whose (id, content) key is not among the ``stale`` ones."""
    contents = keys["content"].to_numpy()
    recorded = np.flatnonzero(contents != 0)
    if not len(recorded) or not len(stale):
        return keys
    kinds = keys["kind"].take(recorded).to_pylist()
    ints = keys["int_id"].take(recorded).to_pylist()
    strs = keys["str_id"].take(recorded).to_pylist()
    ids = np.fromiter(
        (hash_id(t if k else n) for k, n, t in zip(kinds, ints, strs, strict=True)),
        dtype=np.uint64,
        count=len(recorded),
    )
    mixed = mix_hashes(ids, contents[recorded])
    at = np.minimum(np.searchsorted(stale, mixed), len(stale) - 1)
    drop = np.zeros(keys.num_rows, dtype=bool)
    drop[recorded[stale[at] == mixed]] = True
    return keys.filter(pa.array(~drop)) if drop.any() else keys


def _consolidate(
    directory: Path,
    *,
    jsonl: bool,
    column_order: Sequence[str],
    shards: list[Path] | None = None,
    keep: np.ndarray[Any, np.dtype[np.uint64]] | None = None,
    kept_in: frozenset[int] | None = None,
    target: Path | None = None,
    constants: Mapping[str, str] | None = None,
    types: Mapping[str, pa.DataType] | None = None,
    stale: np.ndarray[Any, np.dtype[np.uint64]] | None = None,
    written: Written | None = None,
) -> Consolidated:
    """Consolidate ``shards`` (the directory's own by default) into ``directory``;
    ``keep`` applies to the records of the shards at the indexes ``kept_in`` (all by
    default), the others are written whole; ``written``, when it covers the shards,
    stands in for reading them."""
    if shards is None:
        shards = shard_paths(directory)
    held = bytearray()
    followed = written if written is not None and written.covers(shards) else None
    if followed is not None:
        loaded = followed.loaded(_CHUNK)
        held = followed.held
    else:
        loaded = Loader(_CHUNK)
        for index, path in enumerate(shards):
            loaded.read(index, read_shard(path))
    keys = loaded.keys()
    types = types or {}
    names = [name for name in column_order if name in loaded.names or name in types]
    names += [name for name in loaded.names if name not in names]
    if "id" not in names:  # no records at all
        names.insert(0, "id")

    if stale is not None:
        keys = _without_stale(keys, stale)
    winners = _winners(keys)
    keys = keys.take(winners)
    left_out = 0
    if keep is not None:
        keys, left_out = _kept(keys, keep, kept_in)
        if left_out:
            log.warning("results_left_out", output_dir=str(directory), rows=left_out)
    constants = constants or {}
    names = [name for name in names if name not in constants] + list(constants)
    ids = _id_column(keys)
    fields = loaded.fields(types)
    fields.update({n: pa.field(n, types[n]) for n in names if n not in fields and n in types})
    fields["id"] = pa.field("id", ids.type)
    fields.update({name: pa.field(name, pa.string()) for name in constants})
    schema = pa.schema([fields[name] for name in names])
    summary = _Summary()
    parquet_path = target if target is not None else directory / PARQUET_FILE
    footer: list[pq.FileMetaData] = []  # the file's, once written: its schema as stored
    with (
        atomic_write(parquet_path) as file,
        pq.ParquetWriter(file, schema, metadata_collector=footer) as writer,
        _Reader(shards, held) as reader,
    ):
        for start in range(0, keys.num_rows, _ROW_GROUP):  # one row group at a time
            end = min(start + _ROW_GROUP, keys.num_rows)
            chunks = []
            for at in range(start, end, _CHUNK):
                size = min(_CHUNK, end - at)  # a chunk never runs into the next group
                records = reader.records(keys.slice(at, size))  # few dicts at a time
                columns = {
                    name: ids.slice(at, size)
                    if name == "id"
                    else pa.repeat(constants[name], size)
                    if name in constants
                    else _column(records, name, schema.field(name).type, name in loaded.stringified)
                    for name in names
                }
                chunks.append(pa.table(columns, schema=schema))
            part = pa.concat_tables(chunks)
            writer.write_table(part, row_group_size=_ROW_GROUP)
            summary.add(part, keys["ok"].slice(start, end - start))
        read_back = reader.read_back
    jsonl_path = None
    if jsonl:
        jsonl_path = directory / JSONL_FILE
        with atomic_write(jsonl_path) as file:
            _write_jsonl(file, shards, keys, names, held)
    stored = footer[0].schema.to_arrow_schema() if footer else schema
    result = summary.result(parquet_path, jsonl_path, left_out, stored)
    log.info(
        "results_consolidated",
        output_dir=str(directory),
        rows=result.num_rows,
        succeeded=result.num_succeeded,
        failed=result.num_failed,
        shards=len(shards),
        followed=followed is not None,
        read_back=read_back,
    )
    return result


def _kept(
    keys: pa.Table, keep: np.ndarray[Any, np.dtype[np.uint64]], kept_in: frozenset[int] | None
) -> tuple[pa.Table, int]:
    """The winners' rows whose id hashes into ``keep`` (or that come from a shard not
    in ``kept_in``, when given), and how many were not."""
    if not keys.num_rows:
        return keys, 0
    kinds = keys["kind"].to_numpy()
    int_ids = keys["int_id"].to_pylist()
    str_ids = keys["str_id"].to_pylist()
    hashes = np.fromiter(
        (
            hash_id(text if kind else number)
            for kind, number, text in zip(kinds.tolist(), int_ids, str_ids, strict=True)
        ),
        dtype=np.uint64,
        count=keys.num_rows,
    )
    at = np.minimum(np.searchsorted(keep, hashes), max(len(keep) - 1, 0))
    mask = keep[at] == hashes if len(keep) else np.zeros(len(hashes), dtype=bool)
    if kept_in is not None:
        mask |= ~np.isin(keys["shard"].to_numpy(), np.fromiter(kept_in, dtype=np.int64))
    kept = int(np.count_nonzero(mask))
    return keys.filter(pa.array(mask)), keys.num_rows - kept


def _column(
    records: list[dict[str, Any]], name: str, data_type: pa.DataType, as_text: bool
) -> pa.Array:
    values = [record.get(name) for record in records]
    if as_text:
        return _texts(values)
    return pa.array(values, data_type)


class _Reader:
    """Records read back from the shards by their place (shard, offset, length), or
    taken from ``held``, the first bytes of the first shard, where it holds them."""

    def __init__(self, shards: list[Path], held: bytearray | None = None) -> None:
        self.shards = shards
        self.held = held if held is not None else bytearray()
        self.handles: dict[int, Any] = {}
        self.read_back = 0
        """Bytes read back from the shards."""

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles.values():
            handle.close()
        self.handles.clear()

    def records(self, places: pa.Table) -> list[dict[str, Any]]:
        out = []
        for shard, offset, length in zip(
            places["shard"].to_pylist(),
            places["offset"].to_pylist(),
            places["length"].to_pylist(),
            strict=True,
        ):
            if shard == 0 and offset + length <= len(self.held):
                out.append(orjson.loads(self.held[offset : offset + length]))
                continue
            out.append(orjson.loads(os.pread(self._fd(shard), length, offset)))
            self.read_back += length
        return out

    def _fd(self, shard: int) -> int:
        handle = self.handles.get(shard)
        if handle is None:
            if len(self.handles) >= 64:
                self.__exit__()
            handle = self.handles[shard] = open_binary(self.shards[shard])
        return int(handle.fileno())


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

    def result(
        self, parquet_path: Path, jsonl_path: Path | None, left_out: int, schema: pa.Schema
    ) -> Consolidated:
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
            left_out=left_out,
            schema=schema,
        )


def _texts(values: Iterable[Any]) -> pa.Array:
    """Values as strings: str kept, None null, anything else JSON-encoded."""
    return pa.array(
        [
            value if value is None or isinstance(value, str) else orjson.dumps(value).decode()
            for value in values
        ],
        pa.string(),
    )


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
    log.warning("id_column_stored_as_strings", column="id")
    return pc.if_else(is_str, keys["str_id"], pc.cast(keys["int_id"], pa.string()))


def _write_jsonl(
    file: Any, shards: list[Path], keys: pa.Table, names: list[str], held: bytearray
) -> None:
    """Each winning record read back from its shard (or taken from ``held``), its keys
    in ``names`` order."""
    with _Reader(shards, held) as reader:
        for start in range(0, keys.num_rows, _ROW_GROUP):
            for record in reader.records(keys.slice(start, _ROW_GROUP)):
                file.write(orjson.dumps({name: record.get(name) for name in names}))
                file.write(b"\n")


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
