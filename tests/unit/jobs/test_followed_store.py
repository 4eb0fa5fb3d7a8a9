"""A store followed as it writes: consolidated from what it held in memory, reading
back only the records it did not hold; what else the directory holds is read from its
shards. Bytes counted by the process's ``rchar``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llm_annotator.errors import JobError
from llm_annotator.jobs.ids import CONTENT_FIELD, content_text
from llm_annotator.jobs.rundir import loading
from llm_annotator.jobs.rundir.consolidate import consolidate
from llm_annotator.jobs.rundir.loading import HoldBudget, Written
from llm_annotator.jobs.rundir.store import ResultStore
from tests.unit.jobs.test_read_once import IO, rchar

pytestmark = pytest.mark.skipif(not IO.exists(), reason="needs /proc/self/io (Linux)")


def records(count: int) -> list[dict[str, Any]]:
    """Records of a store: str ids, errors, a column of clashing types, nested values,
    long texts, and the content hash of each row."""
    out: list[dict[str, Any]] = []
    for i in range(count):
        record: dict[str, Any] = {
            "id": f"r{(i * 7919) % count:05d}",
            "text": f"row {i} " + "x" * 3000,
            "label": i if i % 5 else "five",
            "nested": {"a": i, "tags": ["t"] * (i % 3)},
            CONTENT_FIELD: content_text(i + 1),
        }
        if i % 11 == 0:
            record.update(error="boom", error_type="server_error")
        out.append(record)
    return out


def write_followed(directory: Path, rows: list[dict[str, Any]], budget: HoldBudget) -> Written:
    """A store opened afresh in ``directory`` writes ``rows``, followed."""
    with ResultStore.open(directory, {"model": "m"}) as store:
        assert store.is_fresh
        written = Written(store.shard_path, budget)
        store.follow(written)
        for row in rows:
            store.append(row)
    return written


def table(path: Path) -> pa.Table:
    return pq.read_table(path)


@pytest.fixture
def warm(tmp_path: Path) -> None:
    """One consolidation first: what it imports (pyarrow's and pandas' modules, read
    once a process) is not counted."""
    written = write_followed(tmp_path / "warm", records(3), HoldBudget(1 << 20))
    consolidate(tmp_path / "warm", written=written)


@pytest.mark.parametrize("held", [1.0, 0.5, 0.0])
@pytest.mark.usefixtures("warm")
def test_a_followed_store_is_consolidated_reading_back_only_what_it_did_not_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: float
) -> None:
    """Consolidated from what its store followed, a directory gives the same file as
    from its shard; all held: nothing read back; half held or none: only the records not
    held, once each (without following, the shard is read twice). The records not held
    are learnt a few at a time as they are written."""
    monkeypatch.setattr(loading, "CHUNK", 7)
    rows = records(400)
    shard_bytes = sum(len(orjson.dumps(r)) + 1 for r in rows)
    budget = HoldBudget(int(shard_bytes * held))
    written = write_followed(tmp_path / "run", rows, budget)
    not_held = written.size - len(written.held)
    assert written.covers([written.shard])

    before = rchar()
    followed = consolidate(tmp_path / "run", target=tmp_path / "followed.parquet", written=written)
    read = rchar() - before
    written.release()
    assert budget.used == 0

    assert read <= not_held + 4096  # + this reading of /proc/self/io
    if held == 1.0:
        assert read < 4096
    before = rchar()
    plain = consolidate(tmp_path / "run", target=tmp_path / "plain.parquet")
    assert rchar() - before >= 2 * shard_bytes  # the two passes over the shard
    assert table(followed.parquet_path).equals(table(plain.parquet_path))
    schema = followed.schema
    assert schema is not None and schema == plain.schema == pq.read_schema(plain.parquet_path)
    assert CONTENT_FIELD not in schema.names
    assert schema.field("label").type == pa.string()  # 1 and "five" clash
    assert (followed.num_rows, followed.num_failed) == (400, len(range(0, 400, 11)))


def test_what_else_the_directory_holds_is_read_from_its_shards(tmp_path: Path) -> None:
    """A shard beside the one followed (another writer's), or a store that found
    records at open, is not taken from memory: the consolidation reads the shards."""
    rows = records(40)
    written = write_followed(tmp_path, rows[:20], HoldBudget(1 << 30))
    with ResultStore.open(tmp_path, {"model": "m"}) as later:
        assert not later.is_fresh
        with pytest.raises(JobError, match="a sink would miss them"):
            later.follow(Written(later.shard_path, HoldBudget(1 << 30)))
        for row in rows[20:]:
            later.append(row)
    assert not written.covers(sorted((tmp_path / "shards").iterdir()))
    result = consolidate(tmp_path, written=written)
    assert result.num_rows == 40


def test_a_shard_cut_short_is_not_taken_for_what_was_followed(tmp_path: Path) -> None:
    """A write that did not reach the shard whole (a full disk) leaves it shorter than
    what was followed: the shard, not the memory, is consolidated."""
    written = write_followed(tmp_path, records(10), HoldBudget(1 << 30))
    with written.shard.open("r+b") as file:
        file.truncate(written.size - 10)
    assert not written.covers([written.shard])
    assert consolidate(tmp_path, written=written).num_rows == 9
