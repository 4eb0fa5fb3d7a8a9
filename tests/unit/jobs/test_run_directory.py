"""The one reader of run directories: each kind of job told apart, and its output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from llm_annotator.errors import InputError, RunDirectoryError
from llm_annotator.jobs import RunDirectory
from tests.unit.conftest import FakeServer, completion
from tests.unit.helpers import pool_of, write_jsonl


def test_each_kind_of_job_and_its_output(tmp_path: Path, fake_server: FakeServer) -> None:
    async def short(_: dict[str, Any]) -> web.StreamResponse:
        return completion("ok")

    fake_server.handler = short
    rows = [{"id": f"r{r}", "text": f"row {r}"} for r in range(6)]
    write_jsonl(tmp_path / "one.jsonl", rows)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", rows[:3])
    write_jsonl(corpus / "b.jsonl", rows[3:])
    runs = {name: tmp_path / name for name in ("file", "shards", "corpus", "claims")}
    assert RunDirectory.open(runs["file"]).kind == "none"  # not made yet
    with pool_of([fake_server]) as pool:

        def annotate(data: Path, run: Path, **job: Any) -> None:
            pool.annotate(data, "Label: {text}", run, progress=False, id_column="id", **job)

        annotate(tmp_path / "one.jsonl", runs["file"])
        annotate(tmp_path / "one.jsonl", runs["shards"], shard=(0, 2))
        first_shard = RunDirectory.open(runs["shards"])
        merged_after_one = first_shard.has_output()
        annotate(tmp_path / "one.jsonl", runs["shards"], shard=(1, 2))
        annotate(corpus, runs["corpus"])
        annotate(tmp_path / "one.jsonl", runs["claims"], shard="claim")

    file = RunDirectory.open(runs["file"])
    assert (file.kind, file.output.name, file.has_output()) == ("file", "annotations.parquet", True)
    assert list(file.output_files()) == [(None, file.output)]
    assert (first_shard.kind, first_shard.shards, merged_after_one) == ("shards", 2, False)
    shards = RunDirectory.open(runs["shards"])
    assert (shards.kind, shards.has_output()) == ("shards", True)
    whole = RunDirectory.open(runs["corpus"])
    assert (whole.kind, whole.corpus_mode(), whole.output.name) == (
        "corpus",
        "whole",
        "annotations",
    )
    assert [unit for unit, _ in whole.output_files()] == ["a.jsonl", "b.jsonl"]
    assert (whole.manifest() or {})["complete"] is True
    claims = RunDirectory.open(runs["claims"])
    assert (claims.kind, claims.corpus_mode()) == ("corpus", "claim")
    worker = next(runs["claims"].glob("worker-*"))
    assert RunDirectory.open(worker).part_of == runs["claims"]


def test_no_output_yet_and_a_planted_record_are_said(tmp_path: Path) -> None:
    empty = RunDirectory.open(tmp_path)
    assert (empty.kind, empty.has_output()) == ("none", False)
    with pytest.raises(InputError, match="holds no output yet"):
        list(empty.output_files())
    (tmp_path / "corpus.json").symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(RunDirectoryError):
        RunDirectory.open(tmp_path)


def test_static_shards_take_byte_ranges_only_and_a_refused_claim_writes_nothing(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """A large JSONL file with an id column runs as units under static shards; a Parquet
    file of many row groups keeps one store (its ids checked whole before any request).
    A claim run refused in a directory of one-store shards leaves it as it was."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llm_annotator.errors import ConfigurationError
    from llm_annotator.jobs.corpus import runs_as_units
    from llm_annotator.jobs.spec import JobSpec

    rows = [{"id": f"r{r}", "text": "lorem ipsum " * 50} for r in range(2000)]
    write_jsonl(tmp_path / "big.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "big.parquet", row_group_size=100)

    def spec(data: str, run: str, shard: Any) -> JobSpec:
        job: Any = {"id_column": "id", "shard": shard, "unit_size": "64K"}
        return JobSpec.of(str(tmp_path / data), "{text}", tmp_path / run, job)

    assert runs_as_units(spec("big.jsonl", "a", (0, 2)))
    assert not runs_as_units(spec("big.parquet", "b", (0, 2)))
    assert not runs_as_units(spec("big.jsonl", "c", None))

    async def short(_: dict[str, Any]) -> web.StreamResponse:
        return completion("ok")

    fake_server.handler = short
    write_jsonl(tmp_path / "small.jsonl", rows[:10])
    with pool_of([fake_server]) as pool:
        pool.annotate(tmp_path / "small.jsonl", "{text}", tmp_path / "s", shard=(0, 2))
        with pytest.raises(ConfigurationError, match="split into 2 shards"):
            pool.annotate(tmp_path / "small.jsonl", "{text}", tmp_path / "s", shard="claim")
    assert RunDirectory.open(tmp_path / "s").kind == "shards"
    assert not (tmp_path / "s" / "corpus.json").exists()
