"""What a consolidation learns of the records before it writes any: each record's id,
success and place, and each column's type.

:class:`Loader` learns it from records read from the shards, a chunk at a time.
:class:`Written` learns it as a store writes them (see
:meth:`~llm_annotator.jobs.rundir.store.ResultStore.follow`) and keeps the records
themselves in memory while a :class:`HoldBudget` allows: a directory whose one shard
was written whole by that store is consolidated without reading it back, and the
records that did not fit in the budget are read back once, by their place.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import structlog

from llm_annotator.jobs.ids import CONTENT_FIELD, content_of
from llm_annotator.jobs.rundir.store import is_error_record

log = structlog.get_logger(__name__)

CHUNK = 1 << 14
"""Records parsed into Python dicts at a time before they become Arrow arrays."""
CHUNK_BYTES = 8 << 20
"""Fewer records at a time when they hold more bytes than this."""

Entry = tuple[int, int, dict[str, Any]]
"""A record and its place in its shard: ``(byte offset, line length, record)``."""


class HoldBudget:
    """Bytes of records that may be held in memory at once, shared by the
    :class:`Written` of several stores (the units of a corpus job in progress); taken
    on the job's thread, given back on another.

    Examples:
        >>> budget = HoldBudget(10)
        >>> budget.take(6), budget.take(6), budget.take(4)
        (True, False, True)
        >>> budget.give(6); budget
        <HoldBudget used=4 limit=10>
    """

    __slots__ = ("_lock", "limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<HoldBudget used={self.used} limit={self.limit}>"

    def take(self, size: int) -> bool:
        """Take ``size`` bytes if that many are left; whether it did."""
        with self._lock:
            if self.used + size > self.limit:
                return False
            self.used += size
            return True

    def give(self, size: int) -> None:
        """Give back ``size`` bytes taken before."""
        with self._lock:
            self.used -= size


class Written:
    """The records one store writes into its new shard, followed as it writes them.

    Each record's line is held in memory while the budget allows; from the first one
    it does not, the lines are no longer held (those held are the shard's first bytes)
    and each chunk of them is parsed as it fills, to learn its keys and types. So the
    memory is the budget's, plus a chunk, plus about 40 bytes a record for the keys of
    the lines not held (a consolidation from the shard holds those of every record).

    Args:
        shard: The shard the store writes (:attr:`~llm_annotator.jobs.rundir.store.
            ResultStore.shard_path`).
        budget: Where the bytes held come from.
    """

    def __init__(self, shard: Path, budget: HoldBudget) -> None:
        self.shard = shard
        self.size = 0
        """Bytes of the shard written (or buffered) so far."""
        self._budget = budget
        self._held = bytearray()
        self._holding = True
        self._released = False
        self._tail = Loader()
        """Keys and types of the records not held, as their chunks fill."""
        self._pending: list[tuple[int, bytes]] = []
        self._pending_bytes = 0

    def __repr__(self) -> str:
        return (
            f"<Written {self.shard.name!r} size={self.size} held={len(self._held)} "
            f"released={self._released}>"
        )

    @property
    def held(self) -> bytearray:
        """The lines held: the shard's first bytes."""
        return self._held

    def add(self, line: bytes) -> None:
        """One record as the store writes it: its JSON, before the newline."""
        length = len(line) + 1
        if self._holding and self._budget.take(length):
            self._held += line
            self._held += b"\n"
        else:
            self._holding = False
            self._pending.append((self.size, line))
            self._pending_bytes += length
            if len(self._pending) >= CHUNK or self._pending_bytes >= CHUNK_BYTES:
                self._learn()
        self.size += length

    def _learn(self) -> None:
        """Learn the keys and types of the pending lines (not held), then drop them."""
        entries = ((at, len(line) + 1, orjson.loads(line)) for at, line in self._pending)
        self._tail.read(0, entries)
        self._pending, self._pending_bytes = [], 0

    def covers(self, shards: Sequence[Path]) -> bool:
        """Whether ``shards`` are what this followed and nothing else: its one shard,
        as long as it saw it written (nothing lost in a failed write, no shard of
        another writer beside it)."""
        if self._released:
            return False
        if not self.size:
            return not shards
        if [path.name for path in shards] != [self.shard.name]:
            return False
        try:
            return os.stat(shards[0]).st_size == self.size
        except OSError:
            return False

    def loaded(self, chunk: int = CHUNK) -> Loader:
        """What the records say, as a :class:`Loader` reading the shard would learn it
        (once: the keys are handed over)."""
        self._learn()
        loader = Loader(chunk)
        loader.read(0, _lines(self._held))
        loader.extend(self._tail)
        self._tail = Loader()
        return loader

    def release(self) -> None:
        """Let go of the lines held, giving their bytes back to the budget; idempotent."""
        if not self._released:
            self._released = True
            self._holding = False
            self._budget.give(len(self._held))
            self._held = bytearray()
            self._pending, self._pending_bytes = [], 0


def _lines(data: bytearray) -> Iterator[Entry]:
    """The records of a shard's bytes held in memory, with their places."""
    start = 0
    while start < len(data):
        end = data.index(b"\n", start) + 1
        yield start, end - start, orjson.loads(data[start:end])
        start = end


class Loader:
    """Each record's id, success and place, and each column's type.

    Records are turned into Arrow a chunk at a time only to learn their columns'
    types; the data itself is not kept.

    Args:
        chunk: Records at a time (fewer when they hold more than :data:`CHUNK_BYTES`).
    """

    def __init__(self, chunk: int = CHUNK) -> None:
        self.names: dict[str, None] = {}  # every key seen, in first-seen order
        self.stringified: set[str] = set()
        self._chunk = chunk
        self._types: dict[str, list[pa.DataType]] = {}
        self._keys: list[pa.Table] = []

    def read(self, index: int, entries: Iterable[Entry]) -> None:
        """Learn the records of shard ``index``, in the order written."""
        records: list[dict[str, Any]] = []
        places: list[tuple[int, int]] = []
        size = 0
        for offset, length, record in entries:
            records.append(record)
            places.append((offset, length))
            size += length
            if len(records) >= self._chunk or size >= CHUNK_BYTES:
                self._add(index, records, places)
                records, places, size = [], [], 0
        if records:
            self._add(index, records, places)

    def extend(self, other: Loader) -> None:
        """Learn what ``other`` learnt of the records that follow these."""
        self.names.update(other.names)
        self.stringified |= other.stringified
        for name, types in other._types.items():
            self._types.setdefault(name, []).extend(types)
        self._keys += other._keys

    def _add(
        self, index: int, records: list[dict[str, Any]], places: list[tuple[int, int]]
    ) -> None:
        names = dict.fromkeys(name for record in records for name in record)
        names.pop(CONTENT_FIELD, None)  # bookkeeping, never an output column
        self.names.update(names)
        for name in names:
            if name != "id" and name not in self.stringified:
                array = self._array(name, [record.get(name) for record in records])
                if array is not None:
                    self._types.setdefault(name, []).append(array.type)
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
                content=[content_of(record) for record in records],
            )
        )

    def _array(self, name: str, values: list[Any]) -> pa.Array | None:
        try:
            return pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            self.stringified.add(name)
            return None

    def keys(self) -> pa.Table:
        """Every record's bookkeeping columns, in reading order (once: handed over)."""
        if not self._keys:
            empty: list[Any] = []
            return _key_table(empty, empty, empty, empty, empty, empty, empty, empty)
        chunks, self._keys = self._keys, []  # the caller holds the only reference
        return pa.concat_tables(chunks)

    def fields(self, types: Mapping[str, pa.DataType]) -> dict[str, pa.Field]:
        """One Parquet field per data column: the chunks' types unified, or string; a
        column of nulls only takes its type from ``types`` when it names one."""
        fields: dict[str, pa.Field] = {}
        for name in self.names:
            if name == "id":
                continue
            data_type = None if name in self.stringified else self._unified(name)
            if data_type is not None and pa.types.is_null(data_type) and name in types:
                data_type = types[name]
            if data_type is None:
                self.stringified.add(name)
                log.warning("column_stored_as_strings", column=name)
                data_type = pa.string()
            fields[name] = pa.field(name, data_type)
        return fields

    def _unified(self, name: str) -> pa.DataType | None:
        """The one type the chunks' types for a column unify into, if Parquet can
        store it."""
        types = self._types.get(name, [])
        distinct = list(dict.fromkeys(t for t in types if not pa.types.is_null(t)))
        try:
            schema = pa.unify_schemas(
                [pa.schema([(name, t)]) for t in distinct] or [pa.schema([(name, pa.null())])],
                promote_options="permissive",
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, NotImplementedError):
            return None
        data_type = schema.field(name).type
        return data_type if _storable(data_type) else None


def _key_table(
    kind: Sequence[int],
    int_id: Sequence[int],
    str_id: Sequence[str],
    ok: Sequence[bool],
    shard: Sequence[int],
    offset: Sequence[int],
    length: Sequence[int],
    content: Sequence[int],
) -> pa.Table:
    """The bookkeeping columns of some records: id, success, where each record sits,
    the content hash of its row (0: not recorded)."""
    return pa.table(
        {
            "kind": pa.array(kind, pa.int8()),  # 0 for an int id, 1 for a str id
            "int_id": pa.array(int_id, pa.int64()),
            "str_id": pa.array(str_id, pa.string()),
            "ok": pa.array(ok, pa.bool_()),
            "shard": pa.array(shard, pa.int32()),
            "offset": pa.array(offset, pa.int64()),
            "length": pa.array(length, pa.int64()),
            "content": pa.array(content, pa.uint64()),
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
