"""Listing a corpus (directory, glob, list, save_to_disk folder, compressions), cutting
it into units, reading a unit, and the static split of units over shards."""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

import datasets
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from llm_annotator.errors import InputError
from llm_annotator.jobs.rows.corpus import CorpusFile, Unit, is_corpus, list_corpus
from llm_annotator.jobs.shards.split import shard_of_units, units_of_shard


def jsonl(records: Sequence[Mapping[str, object]]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def texts_of(units: list[Unit], id_column: str | None = None) -> list[object]:
    return [row.values["text"] for unit in units for row in unit.read(id_column)]


def test_a_directory_lists_its_supported_files_at_any_depth_in_name_order(tmp_path: Path) -> None:
    """Names beginning with . or _ are data lakes' own files and are skipped, as is any
    file of no known format; the rest are sorted by their path in the corpus."""
    for name in ("b/x.jsonl", "a.csv", "b/a.parquet", "c.jsonl.gz", "notes.txt", "_SUCCESS",
                 ".hidden.jsonl", "_tmp/z.jsonl"):  # fmt: skip
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"text": ["p"]}), path)
        elif name.endswith(".gz"):
            path.write_bytes(gzip.compress(jsonl([{"text": "g"}])))
        elif name.endswith(".csv"):
            path.write_text("text\nc\n")
        else:
            path.write_bytes(jsonl([{"text": "j"}]))
    corpus = list_corpus(tmp_path)
    assert [f.name for f in corpus.files] == ["a.csv", "b/a.parquet", "b/x.jsonl", "c.jsonl.gz"]
    assert texts_of(list(corpus.units)) == ["c", "p", "j", "g"]
    assert corpus.root == str(tmp_path)


@pytest.mark.parametrize(
    ("suffix", "compress"),
    [
        (".gz", gzip.compress),
        (".zst", zstandard.ZstdCompressor().compress),
        (".bz2", bz2.compress),
        (".xz", lzma.compress),
    ],
)
def test_each_compression_of_a_corpus_file_reads_the_same_rows(
    tmp_path: Path, suffix: str, compress: object
) -> None:
    records = [{"text": f"t{i}"} for i in range(300)]
    (tmp_path / f"a.jsonl{suffix}").write_bytes(compress(jsonl(records)))  # type: ignore[operator]
    lines = "text\n" + "".join(f"t{i}\n" for i in range(300))
    (tmp_path / f"b.csv{suffix}").write_bytes(compress(lines.encode()))  # type: ignore[operator]
    corpus = list_corpus(tmp_path)
    assert len(corpus.units) == 2
    assert texts_of(list(corpus.units)) == [f"t{i}" for i in range(300)] * 2


def test_a_glob_a_list_and_a_mix_name_the_same_files(tmp_path: Path) -> None:
    for i in range(4):
        (tmp_path / f"p{i}.jsonl").write_bytes(jsonl([{"text": str(i)}]))
    by_glob = list_corpus(str(tmp_path / "p[12].jsonl"))
    by_list = list_corpus([tmp_path / "p2.jsonl", tmp_path / "p1.jsonl"])
    assert (
        [f.name for f in by_glob.files]
        == [f.name for f in by_list.files]
        == [
            "p1.jsonl",
            "p2.jsonl",
        ]
    )
    assert is_corpus(str(tmp_path / "*.jsonl")) and is_corpus(tmp_path)
    assert not is_corpus(tmp_path / "p1.jsonl")


def test_a_saved_dataset_folder_reads_its_arrow_files_in_order(tmp_path: Path) -> None:
    rows = [{"id": i, "text": f"t{i}"} for i in range(50)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"), num_shards=3)
    corpus = list_corpus(tmp_path / "saved")
    assert len(corpus.units) == 3
    assert [row.id for u in corpus.units for row in u.read("id")] == list(range(50))
    assert [u.known_rows(u.source(None)) for u in corpus.units] == [17, 17, 16]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "dict")
    )
    with pytest.raises(InputError, match=r"DatasetDict.*train"):
        list_corpus(tmp_path / "dict")


def test_what_cannot_be_a_corpus_is_refused_naming_the_path(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(jsonl([{"text": "x"}]))
    with pytest.raises(InputError, match="matches no file"):
        list_corpus(str(tmp_path / "*.parquet"))
    with pytest.raises(InputError, match="no such file"):
        list_corpus([tmp_path / "a.jsonl", tmp_path / "missing.jsonl"])
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match=r"notes\.txt: of no known format.*--skip-bad-files"):
        list_corpus([tmp_path / "a.jsonl", tmp_path / "notes.txt"])
    skipped = list_corpus([tmp_path / "a.jsonl", tmp_path / "notes.txt"], skip_bad_files=True)
    assert [f.name for f in skipped.files] == ["a.jsonl"]
    assert skipped.skipped[0][0].endswith("notes.txt")
    os.symlink(tmp_path / "a.jsonl", tmp_path / "link.jsonl")
    with pytest.raises(InputError, match="one file named twice"):
        list_corpus(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no input file"):
        list_corpus(empty)
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(InputError, match="not a regular file"):
        list_corpus([tmp_path / "a.jsonl", tmp_path / "pipe.jsonl"])


def test_a_repeated_id_within_a_file_stops_the_read_naming_both_places(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(jsonl([{"id": 1, "text": "x"}, {"id": 1, "text": "y"}]))
    (tmp_path / "b.jsonl").write_bytes(jsonl([{"id": 1, "text": "z"}]))  # another file: fine
    corpus = list_corpus(tmp_path)
    assert [r.id for r in corpus.units[1].read("id")] == [1]
    with pytest.raises(InputError, match=r"line 1 and at .*line 2"):
        list(corpus.units[0].read("id"))


def test_a_large_parquet_file_is_cut_by_row_groups_keeping_its_row_positions(
    tmp_path: Path,
) -> None:
    """Three large files still split over 8 shards: each is cut into runs of whole row
    groups; positions stay those of the file, and every row is in one unit."""
    for f in range(3):
        table = pa.table({"text": [f"f{f}-{i}" for i in range(4000)]})
        pq.write_table(table, tmp_path / f"big{f}.parquet", row_group_size=500)
    corpus = list_corpus(tmp_path, unit_bytes=4000)
    assert len(corpus.units) > 8
    assert {u.groups is not None for u in corpus.units} == {True}
    rows = [(u.file.name, row.id, row.values["text"]) for u in corpus.units for row in u.read(None)]
    assert rows == [(f"big{f}.parquet", i, f"f{f}-{i}") for f in range(3) for i in range(4000)]
    shards = [units_of_shard(corpus.units, i, 8) for i in range(8)]
    assert all(shards), [len(s) for s in shards]
    names = [u.output_name for u in corpus.units]
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("count", range(1, 10))
def test_every_unit_goes_to_exactly_one_shard_with_bytes_within_one_unit_of_an_even_share(
    count: int,
) -> None:
    generator = random.Random(count)
    for _ in range(30):
        sizes = [generator.choice([0, 1, 10, 1000, 10**6]) for _ in range(generator.randint(1, 40))]
        owners = shard_of_units(sizes, count)
        assert len(owners) == len(sizes) and all(0 <= o < count for o in owners)
        assert owners == sorted(owners)  # contiguous runs
        total = sum(s + 1 for s in sizes)
        for shard in range(count):
            taken = sum(s + 1 for s, o in zip(sizes, owners, strict=True) if o == shard)
            assert taken <= total / count + max(sizes) + 1


def test_the_split_is_the_same_whatever_the_order_the_paths_were_given_in(tmp_path: Path) -> None:
    for i in range(9):
        (tmp_path / f"p{i}.jsonl").write_bytes(jsonl([{"text": "x" * (i * 37)}]))
    paths = [tmp_path / f"p{i}.jsonl" for i in range(9)]
    shuffled = paths[:]
    random.Random(3).shuffle(shuffled)
    one, two = list_corpus(paths), list_corpus(shuffled)
    for index in range(4):
        assert [u.name for u in units_of_shard(one.units, index, 4)] == [
            u.name for u in units_of_shard(two.units, index, 4)
        ]
    assert one.digest() == two.digest()


def test_output_names_are_one_flat_file_per_unit_that_dataset_readers_do_not_skip() -> None:
    names = ["a/b.jsonl", "a%2Fb.jsonl", "a#b.jsonl", "_x.jsonl", ".y.csv"]
    units = [Unit(i, CorpusFile(n, n, 1, 0)) for i, n in enumerate(names)]
    units.append(Unit(9, CorpusFile("a#b.parquet", "x", 1, 0), (0, 2)))
    outputs = [u.output_name for u in units]
    assert len(set(outputs)) == len(outputs)
    assert not any("/" in o or o.startswith((".", "_")) for o in outputs)
