"""Each byte read once: a corpus shard reads its part of the input once and its
units' stores not at all; bytes counted by the process's ``rchar``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from llm_annotator.jobs.rundir.partitions import ANNOTATIONS_DIR
from tests.unit.conftest import FakeServer, completion
from tests.unit.helpers import pool_of, write_jsonl

IO = Path("/proc/self/io")
pytestmark = pytest.mark.skipif(not IO.exists(), reason="needs /proc/self/io (Linux)")


def rchar() -> int:
    """Bytes this process has read so far, every thread and file (and pipe) counted."""
    fields = dict(line.split(b": ") for line in IO.read_bytes().splitlines())
    return int(fields[b"rchar"])


def test_a_corpus_shard_reads_its_part_of_the_corpus_once_and_no_store_back(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """A ``shard=(0, 2)`` run over rows of 6 KB reads, files and answers together, at
    most 1.5 times its half of the corpus: each row of its units once from the input,
    its stores not read back (they were: twice)."""

    async def short(_: dict[str, Any]) -> web.StreamResponse:
        return completion("ok")

    fake_server.handler = short
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(4):
        rows = [{"text": f"f{f} r{r} " + "lorem ipsum " * 500} for r in range(50)]
        write_jsonl(corpus / f"part-{f}.jsonl", rows)
    warm = tmp_path / "warm"
    warm.mkdir()
    write_jsonl(warm / "one.jsonl", [{"text": "warm"}])
    with pool_of([fake_server]) as pool:
        pool.annotate(warm, "Label: {text}", tmp_path / "warm-run", progress=False)
        before = rchar()
        result = pool.annotate(
            corpus, "Label: {text}", tmp_path / "run", progress=False, shard=(0, 2)
        )
        read = rchar() - before
    units = sorted((tmp_path / "run" / ANNOTATIONS_DIR).glob("*.parquet"))
    part = sum((corpus / p.name.removesuffix(".parquet")).stat().st_size for p in units)
    assert result.num_rows == 100 and len(units) == 2
    assert read <= 1.5 * part, f"{read:,} bytes read for a part of {part:,}"


def test_a_static_shard_of_one_large_file_reads_its_share_of_it(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """``shard=(i, 4)`` over one 6 MB JSONL file with an id column: each shard cuts the
    file into byte ranges and reads at most a quarter of it and one unit (it read all
    of it, hashing ids), and the four together hold every row once in ``annotations/``."""

    async def short(_: dict[str, Any]) -> web.StreamResponse:
        return completion("ok")

    fake_server.handler = short
    data = tmp_path / "big.jsonl"
    write_jsonl(
        data, [{"id": f"r{r}", "text": f"r{r} " + "lorem ipsum " * 500} for r in range(1000)]
    )
    size = data.stat().st_size
    warm = tmp_path / "warm.jsonl"
    write_jsonl(warm, [{"text": "warm"}])
    run = tmp_path / "run"
    reads, results = [], []
    with pool_of([fake_server]) as pool:
        pool.annotate(warm, "Label: {text}", tmp_path / "warm-run", progress=False)
        for index in range(4):
            before = rchar()
            results.append(
                pool.annotate(
                    data, "Label: {text}", run, progress=False, id_column="id", shard=(index, 4)
                )
            )
            reads.append(rchar() - before)
    unit = -(-size // 16)  # a quarter of a shard's share
    output = sum(path.stat().st_size for path in (run / ANNOTATIONS_DIR).iterdir())
    # the last also checks every range's ids in the output: ids unique across ranges
    assert all(read <= size / 4 + unit for read in reads[:-1]), (reads, size)
    assert reads[-1] <= size / 4 + unit + output, (reads, size, output)
    assert [r.num_sent for r in results] == [r.num_rows for r in results]
    assert sum(r.num_rows for r in results) == 1000
    assert results[-1].merged_path == run / ANNOTATIONS_DIR
    import pyarrow.dataset as ds

    ids = ds.dataset(run / ANNOTATIONS_DIR, format="parquet").to_table(columns=["id"])
    assert sorted(ids.column("id").to_pylist()) == sorted(f"r{r}" for r in range(1000))
