"""A corpus job against fake servers: many files in, one Parquet file per unit out,
exactly once, resumable, split over static shards by unit."""

from __future__ import annotations

import gzip
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import duckdb
import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from llm_annotator.errors import ConfigurationError, InputError, RunDirectoryError
from llm_annotator.jobs.rows.corpus import FILE_COLUMN
from llm_annotator.jobs.rundir.partitions import (
    ANNOTATIONS_DIR,
    MANIFEST_FILE,
    read_manifest,
)
from tests.cli import COMMAND
from tests.unit.conftest import FakeServer
from tests.unit.helpers import command, pool_of, sent_texts, write_jsonl

TEMPLATE = "Label: {text}"


def make_corpus(folder: Path, files: int = 6, rows: int = 25) -> dict[str, list[str]]:
    """A corpus of JSONL, gzip JSONL, CSV and Parquet files; each file's texts."""
    folder.mkdir(parents=True, exist_ok=True)
    texts: dict[str, list[str]] = {}
    for f in range(files):
        records = [{"text": f"f{f}-r{r}", "n": r} for r in range(rows + f)]
        kind = f % 4
        if kind == 0:
            name = f"part-{f:03d}.jsonl"
            write_jsonl(folder / name, records)
        elif kind == 1:
            name = f"part-{f:03d}.jsonl.gz"
            (folder / name).write_bytes(
                gzip.compress(b"".join(orjson.dumps(r) + b"\n" for r in records))
            )
        elif kind == 2:
            name = f"sub/part-{f:03d}.csv"
            (folder / "sub").mkdir(exist_ok=True)
            lines = ["text,n", *(f"{r['text']},{r['n']}" for r in records)]
            (folder / name).write_text("\n".join(lines) + "\n")
        else:
            name = f"part-{f:03d}.parquet"
            pq.write_table(pa.Table.from_pylist(records), folder / name)
        texts[name] = [str(r["text"]) for r in records]
    return texts


def output_rows(run: Path) -> list[dict[str, Any]]:
    return ds.dataset(run / ANNOTATIONS_DIR, format="parquet").to_table().to_pylist()  # type: ignore[no-any-return]


def test_a_directory_is_annotated_unit_by_unit_into_one_file_per_unit_each_row_once(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Every file under the directory (JSONL, gzip, CSV in a subfolder, Parquet) is
    read; each row is sent once and lands once, in its unit's Parquet file, with its
    file's name; pyarrow.dataset and DuckDB read the folder as one dataset."""
    texts = make_corpus(tmp_path / "corpus")
    (tmp_path / "corpus" / "README.md").write_text("not data")
    (tmp_path / "corpus" / "_SUCCESS").write_text("")
    run = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        result = pool.annotate(tmp_path / "corpus", TEMPLATE, run, progress=False)
    expected = sum(len(t) for t in texts.values())
    assert result.num_rows == expected and result.num_failed == 0
    assert result.output_path == run / ANNOTATIONS_DIR
    assert result.merged_path == run / ANNOTATIONS_DIR
    rows = output_rows(run)
    assert Counter((r[FILE_COLUMN], r["text"]) for r in rows) == Counter(
        (name, text) for name, file_texts in texts.items() for text in file_texts
    )
    assert all(r["response"] == f"Label: {r['text']}" for r in rows)
    assert sent_texts([fake_server]) == Counter(
        f"Label: {t}" for file_texts in texts.values() for t in file_texts
    )
    outputs = sorted(p.name for p in (run / ANNOTATIONS_DIR).glob("*.parquet"))
    assert outputs == sorted(name.replace("/", "%2F") + ".parquet" for name in texts)
    count = duckdb.sql(
        f"select count(*), count(distinct (input_file, id)) from "
        f"read_parquet('{run / ANNOTATIONS_DIR}/*.parquet')"
    ).fetchone()
    assert count == (expected, expected)
    manifest = read_manifest(run)
    assert manifest is not None and manifest["complete"] and manifest["rows"] == expected
    assert manifest["units_done"] == len(texts) and not manifest["waiting"]


def test_a_corpus_job_resumes_without_reading_finished_units_again(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Run again, the job sends nothing: every unit is finished and is not read (a
    finished unit's file may even become unreadable in between... but not changed)."""
    make_corpus(tmp_path / "corpus", files=4)
    run = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        first = pool.annotate(tmp_path / "corpus", TEMPLATE, run, progress=False)
        sent = len(fake_server.requests)
        again = pool.annotate(tmp_path / "corpus", TEMPLATE, run, progress=False)
    assert again.num_sent == 0 and again.num_resumed == first.num_rows
    assert len(fake_server.requests) == sent
    assert again.num_rows == first.num_rows


def test_a_changed_file_is_refused_on_resume_by_name(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    make_corpus(tmp_path / "corpus", files=3)
    run = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        pool.annotate(tmp_path / "corpus", TEMPLATE, run, progress=False)
        with (tmp_path / "corpus" / "part-000.jsonl").open("ab") as file:
            file.write(b'{"text": "new"}\n')
        with pytest.raises(InputError, match=r"part-000\.jsonl changed"):
            pool.annotate(tmp_path / "corpus", TEMPLATE, run, progress=False)


def test_static_shards_split_a_corpus_by_unit_and_the_last_writes_the_manifest(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    texts = make_corpus(tmp_path / "corpus", files=7)
    run = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        results = [
            pool.annotate(tmp_path / "corpus", TEMPLATE, run, progress=False, shard=(i, 3))
            for i in range(3)
        ]
    assert sum(r.num_rows for r in results) == sum(len(t) for t in texts.values())
    assert [r.merged_path is not None for r in results] == [False, False, True]
    rows = output_rows(run)
    assert len(rows) == len({(r[FILE_COLUMN], r["id"]) for r in rows})
    assert sent_texts([fake_server]) == Counter(
        f"Label: {t}" for file_texts in texts.values() for t in file_texts
    )
    assert (run / ANNOTATIONS_DIR / MANIFEST_FILE).is_file()


def test_a_glob_and_a_list_of_paths_are_corpora(tmp_path: Path, fake_server: FakeServer) -> None:
    texts = make_corpus(tmp_path / "corpus", files=4)
    with pool_of([fake_server]) as pool:
        by_glob = pool.annotate(
            str(tmp_path / "corpus" / "*.jsonl*"), TEMPLATE, tmp_path / "g", progress=False
        )
        listed = [tmp_path / "corpus" / "part-000.jsonl", tmp_path / "corpus" / "part-003.parquet"]
        by_list = pool.annotate(listed, TEMPLATE, tmp_path / "l", progress=False)
    assert by_glob.num_rows == len(texts["part-000.jsonl"]) + len(texts["part-001.jsonl.gz"])
    assert by_list.num_rows == len(texts["part-000.jsonl"]) + len(texts["part-003.parquet"])


def test_a_bad_file_is_refused_before_any_request_or_skipped_when_asked(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    make_corpus(tmp_path / "corpus", files=2)
    bad = tmp_path / "corpus" / "broken.parquet"
    bad.write_bytes(b"not parquet at all")
    with pool_of([fake_server]) as pool:
        with pytest.raises(InputError, match=r"broken\.parquet"):
            pool.annotate(tmp_path / "corpus", TEMPLATE, tmp_path / "run", progress=False)
        assert not fake_server.requests
        result = pool.annotate(
            tmp_path / "corpus", TEMPLATE, tmp_path / "run2", progress=False, skip_bad_files=True
        )
    assert result.num_rows == 25 + 26
    manifest = read_manifest(tmp_path / "run2")
    assert manifest is not None
    assert [entry[0] for entry in manifest["skipped_files"]] == ["broken.parquet"]


def test_a_corpus_job_refuses_options_it_does_not_take(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    make_corpus(tmp_path / "corpus", files=2)
    with pool_of([fake_server]) as pool:
        with pytest.raises(ConfigurationError, match="trial run"):
            pool.annotate(tmp_path / "corpus", TEMPLATE, tmp_path / "r", limit=3, progress=False)
        with pytest.raises(ConfigurationError, match="corpus"):
            pool.annotate(
                tmp_path / "corpus" / "part-000.jsonl",
                TEMPLATE,
                tmp_path / "r",
                skip_bad_files=True,
                progress=False,
            )
    assert not fake_server.requests


def test_the_command_takes_several_inputs_and_status_and_merge_read_the_records(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """``run --input A B`` is a corpus job; ``status`` reads its records (JSON and for
    people), ``merge`` checks every unit and writes the manifest without rewriting a
    unit's file; datasets' Parquet loader reads the output as one dataset."""
    texts = make_corpus(tmp_path / "corpus", files=4)
    run = tmp_path / "run"
    first, second = (
        tmp_path / "corpus" / "part-000.jsonl",
        tmp_path / "corpus" / "part-001.jsonl.gz",
    )
    argv = command(fake_server, first, run, "--shard", "0/2")
    argv.insert(argv.index(str(first)) + 1, str(second))
    done = subprocess.run(
        argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr
    assert f"annotations: {run / ANNOTATIONS_DIR}" in done.stdout
    waiting = subprocess.run(
        [COMMAND, "merge", str(run)], capture_output=True, text=True, timeout=60
    )
    assert waiting.returncode == 1
    assert "1 of its 2 units are not finished (part-001.jsonl.gz.parquet)" in waiting.stderr
    status = subprocess.run(
        [COMMAND, "status", str(run), "--json"], capture_output=True, text=True, timeout=60
    )
    said = orjson.loads(status.stdout)
    assert (said["units"], said["units_done"], said["rows"]) == (2, 1, len(texts["part-000.jsonl"]))
    assert [p["where"] for p in said["processes"]] == ["shard-0000-of-0002"]
    argv[argv.index("0/2")] = "1/2"
    assert subprocess.run(argv, capture_output=True, timeout=120).returncode == 0
    files = {p: p.stat().st_mtime_ns for p in (run / ANNOTATIONS_DIR).glob("*.parquet")}
    merged = subprocess.run(
        [COMMAND, "merge", str(run)], capture_output=True, text=True, timeout=60
    )
    assert merged.returncode == 0, merged.stderr
    assert {p: p.stat().st_mtime_ns for p in (run / ANNOTATIONS_DIR).glob("*.parquet")} == files
    people = subprocess.run(
        [COMMAND, "status", str(run)], capture_output=True, text=True, timeout=60
    )
    assert "in 2 units: all finished" in people.stdout
    drawn = subprocess.run(
        [COMMAND, "report", str(run)], capture_output=True, text=True, timeout=120
    )
    assert drawn.returncode == 0, drawn.stderr
    page = (run / "report.html").read_text()
    assert "A corpus job of 2 files in 2 units: all finished" in page
    assert "shard-0001-of-0002" in page and "<svg" in page  # each process, drawn
    loaded = datasets.load_dataset(
        "parquet",
        data_files=str(run / ANNOTATIONS_DIR / "*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "hf-cache"),
    )
    expected = len(texts["part-000.jsonl"]) + len(texts["part-001.jsonl.gz"])
    assert loaded.num_rows == expected
    assert len({(r[FILE_COLUMN], r["id"]) for r in loaded}) == expected


def test_an_empty_file_writes_no_unit_file_and_hides_no_column(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """An empty file (sorted first) is a finished unit of no rows with no Parquet file
    of its own: the dataset of the others keeps every column."""
    texts = make_corpus(tmp_path / "corpus", files=2)
    (tmp_path / "corpus" / "a-empty.jsonl").write_bytes(b"")
    with pool_of([fake_server]) as pool:
        result = pool.annotate(tmp_path / "corpus", TEMPLATE, tmp_path / "run", progress=False)
    assert result.num_rows == sum(len(t) for t in texts.values())
    assert not (tmp_path / "run" / ANNOTATIONS_DIR / "a-empty.jsonl.parquet").exists()
    rows = output_rows(tmp_path / "run")
    assert {"text", "n", "response", FILE_COLUMN} <= set(rows[0])
    manifest = read_manifest(tmp_path / "run")
    assert manifest is not None and manifest["complete"] and manifest["units_done"] == 3


def test_a_link_planted_as_a_units_folder_is_refused_not_written_through(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    make_corpus(tmp_path / "corpus", files=1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run" / "units").mkdir(parents=True)
    (tmp_path / "run" / "units" / "part-000.jsonl").symlink_to(elsewhere)
    with pool_of([fake_server]) as pool, pytest.raises(RunDirectoryError, match="symbolic link"):
        pool.annotate(tmp_path / "corpus", TEMPLATE, tmp_path / "run", progress=False)
    assert not list(elsewhere.iterdir())
    assert not fake_server.requests


def test_merge_removes_what_workers_killed_while_writing_left_once_every_unit_is_done(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Temporaries of a unit's Parquet file, of its record and of its store's job.json
    (a worker killed while it wrote them) are removed by ``merge`` once every unit is
    finished and they went a lease unmodified, as the manifest's temporaries; while a
    unit is not finished, its store is locked by a live writer (a retry), or they are
    fresh (a retry that let go of the lock renames its file now), they are kept."""
    import os
    import tempfile

    from llm_annotator.errors import JobError
    from llm_annotator.jobs.rundir.store import DirectoryLock
    from llm_annotator.jobs.shards.merge import merge

    make_corpus(tmp_path / "corpus", files=2)
    run = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        pool.annotate(tmp_path / "corpus", TEMPLATE, run, progress=False)
    annotations = run / ANNOTATIONS_DIR

    def left_by_a_kill(folder: Path, name: str) -> Path:
        fd, path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        os.close(fd)
        return Path(path)

    unit = "part-000.jsonl.parquet"
    left = [
        left_by_a_kill(annotations, f".{unit}.new"),
        left_by_a_kill(annotations / "_units", f"{unit}.json"),
        left_by_a_kill(run / "units" / "part-000.jsonl", "job.json"),
        annotations / f".{unit}.new",
    ]
    left[-1].write_bytes(b"PAR1")
    for path in left:
        os.utime(path, (path.stat().st_mtime - 3600,) * 2)
    fresh = left_by_a_kill(annotations / "_units", f"{unit}.json")  # being written now
    old_manifest = left_by_a_kill(annotations, MANIFEST_FILE)
    os.utime(old_manifest, (old_manifest.stat().st_mtime - 3600,) * 2)
    fresh_manifest = left_by_a_kill(annotations, MANIFEST_FILE)
    files = {p: p.stat().st_mtime_ns for p in annotations.glob("*.parquet")}

    record = annotations / "_units" / "part-001.jsonl.gz.parquet.json"
    saved = record.read_bytes()
    record.unlink()  # a unit not finished: its holder may still be writing
    with pytest.raises(JobError, match="not finished"):
        merge(run)
    assert all(path.exists() for path in [*left, old_manifest, fresh_manifest])
    record.write_bytes(saved)
    retried = run / "units" / "part-001.jsonl.gz"
    being_written = left_by_a_kill(annotations, ".part-001.jsonl.gz.parquet.new")
    lock = DirectoryLock.acquire(retried, "retry")  # a live writer retries that unit
    try:
        merge(run)
    finally:
        lock.release()
    assert [path for path in [*left, old_manifest] if path.exists()] == []
    assert fresh_manifest.exists()  # a worker writing the manifest now may own it
    assert being_written.exists() and fresh.exists()
    assert {p: p.stat().st_mtime_ns for p in annotations.glob("*.parquet")} == files
    assert len(output_rows(run)) == 25 + 26


def test_one_jsonl_file_is_cut_into_byte_ranges_each_row_once_whatever_the_bounds(
    tmp_path: Path,
) -> None:
    """A JSONL file's byte ranges hold each line once, for any unit size: a byte order
    mark, blank lines, CRLF ends and a last line without a newline included; each row
    says where it is by byte offset."""
    from llm_annotator.jobs.rows.corpus import byte_spans, list_corpus

    body = [orjson.dumps({"id": i, "text": "x" * (i % 37)}) for i in range(300)]
    lines = [line + (b"\r\n" if i % 5 == 0 else b"\n") for i, line in enumerate(body)]
    lines[10:10] = [b"\n", b"   \n"]
    data = tmp_path / "one.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + b"".join(lines)[:-1])  # no newline at the end
    size = data.stat().st_size
    for unit_bytes in (1, 2, 7, 64, 1000, size - 1, size, size + 1):
        corpus = list_corpus(data, unit_bytes=unit_bytes, split_lines=True)
        expected = byte_spans(size, unit_bytes) if size > unit_bytes else [None]
        assert [unit.span for unit in corpus.units] == expected
        rows = [row for unit in corpus.units for row in unit.read("id")]
        assert [row.id for row in rows] == list(range(300)), unit_bytes
        if unit_bytes == 64:
            assert rows[0].where == f"{data} byte 0", rows[0].where
            assert rows[1].where.startswith(f"{data} byte ")
    whole = list_corpus(data, unit_bytes=7)  # without split_lines: one unit
    assert [unit.span for unit in whole.units] == [None]
    gz = tmp_path / "one.jsonl.gz"
    gz.write_bytes(gzip.compress(data.read_bytes()))
    assert len(list_corpus(gz, unit_bytes=7, split_lines=True).units) == 1  # no seeking


def test_workers_claim_one_files_byte_ranges_and_a_run_keeps_how_it_was_cut(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """One JSONL file with shard="claim" is a corpus of one file: with an id column its
    byte ranges are units, each row sent once; run again with another unit size, it
    keeps the cut it began with and sends nothing. Rows in memory cannot be claimed."""
    records = [{"id": f"r{i}", "text": f"t{i}"} for i in range(120)]
    data = write_jsonl(tmp_path / "one.jsonl", records)
    run = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        result = pool.annotate(
            data, TEMPLATE, run, id_column="id", shard="claim", unit_size=512, progress=False
        )
        assert result.num_rows == 120
        units = sorted(p.name for p in (run / ANNOTATIONS_DIR).glob("*.parquet"))
        assert len(units) == -(-data.stat().st_size // 512) and units[0].startswith("one.jsonl#b")
        assert sent_texts([fake_server]) == Counter(f"Label: t{i}" for i in range(120))
        assert sorted(r["id"] for r in output_rows(run)) == sorted(r["id"] for r in records)
        sent = len(fake_server.requests)
        again = pool.annotate(
            data, TEMPLATE, run, id_column="id", shard="claim", unit_size=64, progress=False
        )
        assert again.num_sent == 0 and len(fake_server.requests) == sent
        assert len(list((run / ANNOTATIONS_DIR).glob("*.parquet"))) == len(units)
        with pytest.raises(ConfigurationError, match="rows in memory are one job"):
            pool.annotate(records, TEMPLATE, tmp_path / "mem", shard="claim", progress=False)


def test_an_id_in_two_byte_ranges_of_a_file_is_refused_by_name(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Each range checks its own ids as it reads them; an id repeated in another range of
    the same file is found once every unit is written, and the job ends with one error
    naming the file and the ids, not with a silent duplicate."""
    records = [{"id": i % 30, "text": f"t{i}"} for i in range(60)]
    data = write_jsonl(tmp_path / "one.jsonl", records)
    with (
        pool_of([fake_server]) as pool,
        pytest.raises(InputError, match=r"one\.jsonl: 30 ids stand in more than one of its byte"),
    ):
        pool.annotate(
            data,
            TEMPLATE,
            tmp_path / "run",
            id_column="id",
            shard="claim",
            unit_size=256,
            progress=False,
        )
