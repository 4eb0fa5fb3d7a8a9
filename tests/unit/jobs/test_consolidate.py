"""Consolidation: one row per id, sorted, typed, written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import structlog

from llm_annotator.errors import JobError
from llm_annotator.jobs.rundir import consolidate as consolidate_module
from llm_annotator.jobs.rundir.consolidate import consolidate
from llm_annotator.jobs.rundir.store import ResultStore


def write_shard(directory: Path, number: int, records: list[dict[str, Any]]) -> Path:
    """A shard as a run leaves it: one JSON record a line."""
    path = directory / "shards" / f"part-20240101T000000000000Z-1-{number:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))
    return path


def rows(directory: Path) -> list[dict[str, Any]]:
    return list(pq.read_table(directory / "annotations.parquet").to_pylist())


def test_one_row_per_id_success_beats_error_last_wins(tmp_path: Path) -> None:
    """Per id: any success beats an error; among equals the later shard/line wins."""
    write_shard(
        tmp_path,
        1,
        [
            {"id": 1, "r": "first"},
            {"id": 2, "error": "e1"},
            {"id": 3, "r": None, "error": "e1"},
            {"id": 1, "r": "second"},
        ],
    )
    write_shard(
        tmp_path,
        2,
        [{"id": 1, "r": "third"}, {"id": 2, "r": "ok", "error": None}, {"id": 3, "error": "e2"}],
    )
    write_shard(tmp_path, 3, [{"id": 2, "error": "late"}])
    result = consolidate(tmp_path)
    assert [(row["id"], row["r"], row["error"]) for row in rows(tmp_path)] == [
        (1, "third", None),
        (2, "ok", None),
        (3, None, "e2"),
    ]
    assert (result.num_rows, result.num_succeeded, result.num_failed) == (3, 2, 1)


def test_int_ids_sort_numerically(tmp_path: Path) -> None:
    """10 comes after 9 and negative ids first: numeric, not text, order."""
    write_shard(tmp_path, 1, [{"id": i} for i in [10, 9, -3, 100, 0]])
    consolidate(tmp_path)
    table = pq.read_table(tmp_path / "annotations.parquet")
    assert table["id"].to_pylist() == [-3, 0, 9, 10, 100]
    assert table.schema.field("id").type == pa.int64()


def test_mixed_ids_put_ints_first_then_strs(tmp_path: Path) -> None:
    """Ints numerically, then strs; the id column is then strings, with a warning."""
    write_shard(tmp_path, 1, [{"id": "b"}, {"id": 10}, {"id": "a"}, {"id": 2}, {"id": "10"}])
    with structlog.testing.capture_logs() as logs:
        consolidate(tmp_path)
    assert [row["id"] for row in rows(tmp_path)] == ["2", "10", "10", "a", "b"]
    assert any(log.get("column") == "id" and log["log_level"] == "warning" for log in logs)


def test_missing_keys_are_null_and_columns_keep_first_seen_order(tmp_path: Path) -> None:
    """Records with other key sets fill the gaps with nulls."""
    write_shard(tmp_path, 1, [{"id": 1, "b": 1}, {"id": 0, "a": "x"}])
    consolidate(tmp_path)
    table = pq.read_table(tmp_path / "annotations.parquet")
    assert table.column_names == ["id", "b", "a"]
    assert table.to_pylist() == [{"id": 0, "b": None, "a": "x"}, {"id": 1, "b": 1, "a": None}]


def test_column_order_puts_named_columns_first(tmp_path: Path) -> None:
    """column_order comes first; unknown names are left out; the rest follow."""
    write_shard(tmp_path, 1, [{"id": 1, "text": "t", "response": "r", "extra": 1}])
    consolidate(tmp_path, column_order=["response", "nothing", "id"])
    table = pq.read_table(tmp_path / "annotations.parquet")
    assert table.column_names == ["response", "id", "text", "extra"]


def test_conflicting_types_become_a_string_column(tmp_path: Path) -> None:
    """An int in one row and a str in another: strings, non-str values JSON-encoded."""
    write_shard(
        tmp_path,
        1,
        [{"id": 0, "label": 1, "n": 1}, {"id": 1, "label": "two", "n": 2}, {"id": 2, "n": None}],
    )
    with structlog.testing.capture_logs() as logs:
        consolidate(tmp_path)
    table = pq.read_table(tmp_path / "annotations.parquet")
    assert table["label"].to_pylist() == ["1", "two", None]
    assert table.schema.field("n").type == pa.int64()
    warned = [log["column"] for log in logs if log["log_level"] == "warning"]
    assert warned == ["label"]


def test_conflicts_between_chunks_are_found_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Types that agree within each chunk but not across chunks still become strings."""
    monkeypatch.setattr(consolidate_module, "_CHUNK", 2)
    write_shard(
        tmp_path,
        1,
        [
            {"id": 0, "v": 1, "f": 1},
            {"id": 1, "v": 2, "f": 2},
            {"id": 2, "v": "x", "f": 0.5},
            {"id": 3, "v": {"k": 1}, "f": None},
        ],
    )
    consolidate(tmp_path)
    table = pq.read_table(tmp_path / "annotations.parquet")
    assert table["v"].to_pylist() == ["1", "2", "x", '{"k":1}']
    assert table["f"].to_pylist() == [1.0, 2.0, 0.5, None]


def test_nested_values_are_structs_when_consistent_json_when_not(tmp_path: Path) -> None:
    """Dicts of one shape stay structs; dicts whose fields clash become JSON text."""
    write_shard(
        tmp_path,
        1,
        [
            {"id": 0, "good": {"a": 1, "tags": ["x"]}, "bad": {"a": 1}, "empty": {}},
            {"id": 1, "good": {"a": 2, "tags": []}, "bad": {"a": "one"}, "empty": {}},
        ],
    )
    consolidate(tmp_path)
    table = pq.read_table(tmp_path / "annotations.parquet")
    assert pa.types.is_struct(table.schema.field("good").type)
    assert table["good"].to_pylist() == [{"a": 1, "tags": ["x"]}, {"a": 2, "tags": []}]
    assert table["bad"].to_pylist() == ['{"a":1}', '{"a":"one"}']
    assert table["empty"].to_pylist() == ["{}", "{}"]


@pytest.mark.parametrize(("row_group", "chunk"), [(8, 2), (5, 2), (3, 7)])
def test_many_row_groups_whatever_the_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row_group: int, chunk: int
) -> None:
    """Consolidation over several row groups, with a chunk size that divides the row
    group, one that does not, and one larger than it: every row once, in id order,
    the same in Parquet and JSONL, and the summary counts every group."""
    monkeypatch.setattr(consolidate_module, "_ROW_GROUP", row_group)
    monkeypatch.setattr(consolidate_module, "_CHUNK", chunk)
    records: list[dict[str, Any]] = [
        {"id": i, "label": f"l{i}", "finish_reason": "stop"}
        if i % 4
        else {"id": i, "error": "x", "error_type": "bad_request"}
        for i in range(23)
    ]
    write_shard(tmp_path, 1, records[::2])
    write_shard(tmp_path, 2, records[1::2])
    result = consolidate(tmp_path, jsonl=True)
    table = pq.ParquetFile(tmp_path / "annotations.parquet")
    assert table.metadata.num_row_groups == -(-23 // row_group)
    assert [r["id"] for r in rows(tmp_path)] == list(range(23))
    assert [r["label"] for r in rows(tmp_path)] == [r.get("label") for r in records]
    assert result.jsonl_path is not None
    lines = result.jsonl_path.read_bytes().splitlines()
    assert [orjson.loads(line)["id"] for line in lines] == list(range(23))
    assert (result.num_rows, result.num_succeeded, result.num_failed) == (23, 17, 6)
    assert result.by_finish_reason == {"stop": 17}


def test_jsonl_has_the_same_rows_with_original_values(tmp_path: Path) -> None:
    """annotations.jsonl: rows sorted by id, keys in column order, values as written."""
    write_shard(
        tmp_path,
        1,
        [{"id": 2, "label": "two"}, {"id": 1, "label": 1, "meta": {"k": [1]}}, {"id": 2}],
    )
    result = consolidate(tmp_path, jsonl=True, column_order=["label"])
    assert result.jsonl_path == tmp_path / "annotations.jsonl"
    lines = result.jsonl_path.read_bytes().splitlines()
    assert [orjson.loads(raw) for raw in lines] == [
        {"label": 1, "id": 1, "meta": {"k": [1]}},
        {"label": None, "id": 2, "meta": None},
    ]
    assert list(orjson.loads(lines[0])) == ["label", "id", "meta"]
    assert rows(tmp_path)[0]["label"] == "1"


def test_no_jsonl_unless_asked(tmp_path: Path) -> None:
    """By default only the Parquet file is written."""
    write_shard(tmp_path, 1, [{"id": 0}])
    assert consolidate(tmp_path).jsonl_path is None
    assert not (tmp_path / "annotations.jsonl").exists()


def test_counts_by_finish_reason_error_type_and_tokens(tmp_path: Path) -> None:
    """The summary counts the rows kept, not the records superseded."""
    write_shard(
        tmp_path,
        1,
        [
            {"id": 0, "finish_reason": "stop", "num_prompt_tokens": 5, "num_output_tokens": 2},
            {"id": 1, "finish_reason": "length", "num_prompt_tokens": 7, "num_output_tokens": 9},
            {"id": 2, "error": "HTTP 400", "error_type": "bad_request", "num_prompt_tokens": 3},
            {"id": 3, "error": "timed out"},
            {"id": 4, "error": "x", "error_type": "bad_request"},
            {"id": 4, "finish_reason": "stop", "num_prompt_tokens": 1, "num_output_tokens": 1},
        ],
    )
    result = consolidate(tmp_path)
    assert result.by_finish_reason == {"stop": 2, "length": 1}
    assert result.by_error_type == {"bad_request": 1, "unknown": 1}
    assert (result.prompt_tokens, result.output_tokens) == (16, 12)
    assert (result.num_rows, result.num_succeeded, result.num_failed) == (5, 3, 2)


def test_files_are_replaced_atomically_and_no_temp_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed write leaves the previous file whole and no temporary file behind."""
    write_shard(tmp_path, 1, [{"id": 0, "r": "old"}])
    consolidate(tmp_path, jsonl=True)
    before = (tmp_path / "annotations.parquet").read_bytes()
    write_shard(tmp_path, 2, [{"id": 1, "r": "new"}])

    def broken(self: pq.ParquetWriter, table: pa.Table, **_: Any) -> None:
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(pq.ParquetWriter, "write_table", broken)
        with pytest.raises(OSError, match="disk full"):
            consolidate(tmp_path)
    assert (tmp_path / "annotations.parquet").read_bytes() == before
    consolidate(tmp_path, jsonl=True)
    assert [row["id"] for row in rows(tmp_path)] == [0, 1]
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == [".lock", "annotations.jsonl", "annotations.parquet", "shards"]


def test_consolidating_while_a_store_is_open_is_refused(tmp_path: Path) -> None:
    """The directory lock keeps consolidation from reading a run still writing."""
    with ResultStore.open(tmp_path, {"model": "m"}) as store:
        store.append({"id": 0})
        with pytest.raises(JobError, match="close it first"):
            consolidate(tmp_path)
    assert consolidate(tmp_path).num_rows == 1


def test_a_truncated_last_line_is_ignored_not_repaired(tmp_path: Path) -> None:
    """Consolidation reads shards only: a cut-short line is skipped, the file untouched."""
    shard = write_shard(tmp_path, 1, [{"id": 0}])
    with shard.open("ab") as file:
        file.write(b'{"id": 1, "r')
    content = shard.read_bytes()
    assert consolidate(tmp_path).num_rows == 1
    assert shard.read_bytes() == content


def test_a_run_with_no_results_gives_an_empty_table(tmp_path: Path) -> None:
    """No shards: an empty annotations.parquet with an id column."""
    result = consolidate(tmp_path)
    assert result.num_rows == 0
    table = pq.read_table(result.parquet_path)
    assert table.num_rows == 0
    assert table.column_names == ["id"]


def test_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    """Consolidating a directory that does not exist says so."""
    with pytest.raises(JobError, match="no such run directory"):
        consolidate(tmp_path / "nope")


def test_store_records_round_trip(tmp_path: Path) -> None:
    """What a store writes across a retry run consolidates to the final answers."""
    with ResultStore.open(tmp_path, {"model": "m"}) as store:
        store.append({"id": "b", "response": "yes"})
        store.append({"id": "a", "error": "timeout", "error_type": "read_timeout"})
    with ResultStore.open(tmp_path, {"model": "m"}, retry_errors=True) as store:
        store.append({"id": "a", "response": "no"})
    result = consolidate(tmp_path)
    assert [(row["id"], row["response"]) for row in rows(tmp_path)] == [("a", "no"), ("b", "yes")]
    assert result.num_failed == 0
