"""The result store: each id once, resumable after a kill, one run per directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson
import pytest
import structlog

from llm_annotator.errors import (
    FingerprintMismatchError,
    JobError,
    OutputWriteError,
    RunDirectoryError,
)
from llm_annotator.jobs.rundir.consolidate import consolidate
from llm_annotator.jobs.rundir.store import ResultStore, shard_paths

SETTINGS = {"prompt_template": "Classify: {text}", "model": "m"}


def write(directory: Path, records: list[dict[str, Any]], **options: Any) -> Path:
    """Open a store, append the records, close it; return the shard written."""
    with ResultStore.open(directory, SETTINGS, **options) as store:
        for record in records:
            store.append(record)
        return store.shard_path


def write_shard(directory: Path, number: int, lines: list[bytes]) -> Path:
    """A shard written by hand, as a killed or corrupted run may leave it."""
    path = directory / "shards" / f"part-20240101T000000000000Z-1-{number:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(lines))
    return path


def line(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record) + b"\n"


def test_new_directory_records_the_fingerprint(tmp_path: Path) -> None:
    """job.json holds the canonical fingerprint, its digest, times and the format."""
    write(tmp_path / "run", [])
    job = orjson.loads((tmp_path / "run" / "job.json").read_bytes())
    assert job["fingerprint"] == {"model": "m", "prompt_template": "Classify: {text}"}
    assert len(job["digest"]) == 64
    assert job["format_version"] == 1
    assert job["created"] == job["updated"]
    assert job["history"] == []


def test_other_settings_are_refused_with_what_changed(tmp_path: Path) -> None:
    """Resuming with another template fails, names the change, and frees the directory."""
    write(tmp_path, [{"id": 0}])
    with pytest.raises(FingerprintMismatchError) as caught:
        ResultStore.open(tmp_path, {**SETTINGS, "prompt_template": "Label: {text}"})
    assert caught.value.changes == ["prompt_template: 'Classify: {text}' -> 'Label: {text}'"]
    assert "force=True" in str(caught.value)
    assert "--force" in str(caught.value)
    with ResultStore.open(tmp_path, SETTINGS) as store:  # the lock was released
        assert store.is_done(0)


def test_force_resumes_and_keeps_the_fingerprint_history(tmp_path: Path) -> None:
    """With force the run resumes (done ids stay done) and job.json keeps the old one."""
    write(tmp_path, [{"id": 0}])
    changed = {**SETTINGS, "model": "n"}
    with (
        structlog.testing.capture_logs() as logs,
        ResultStore.open(tmp_path, changed, force=True) as store,
    ):
        assert store.is_done(0)
        assert store.fingerprint["model"] == "n"
    assert any(log["log_level"] == "warning" and "changes" in log for log in logs)
    job = orjson.loads((tmp_path / "job.json").read_bytes())
    assert job["fingerprint"]["model"] == "n"
    assert [entry["fingerprint"]["model"] for entry in job["history"]] == ["m"]
    with ResultStore.open(tmp_path, changed):  # the new fingerprint is now the recorded one
        pass


def test_a_broken_job_record_needs_force(tmp_path: Path) -> None:
    """An unreadable job.json is not overwritten unless forced."""
    write(tmp_path, [{"id": 0}])
    (tmp_path / "job.json").write_bytes(b"{not json")
    with pytest.raises(JobError, match="job record"):
        ResultStore.open(tmp_path, SETTINGS)
    with ResultStore.open(tmp_path, SETTINGS, force=True) as store:
        assert store.is_done(0)


def test_a_second_store_on_the_directory_is_refused(tmp_path: Path) -> None:
    """While one store is open, another open fails naming the pid; after close it works."""
    store = ResultStore.open(tmp_path, SETTINGS)
    try:
        with pytest.raises(JobError, match=r"another run \(pid \d+\) is using it"):
            ResultStore.open(tmp_path, SETTINGS)
    finally:
        store.close()
    ResultStore.open(tmp_path, SETTINGS).close()


def test_another_process_holding_the_directory_is_named(tmp_path: Path) -> None:
    """A run in another process blocks this one; the error gives that process's pid."""
    script = (
        "import sys\n"
        "from llm_annotator.jobs.rundir.store import ResultStore\n"
        f"store = ResultStore.open(sys.argv[1], {SETTINGS!r})\n"
        "print('ready', file=sys.stderr, flush=True)\n"
        "sys.stdin.read()\n"
        "store.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,  # the child's log lines
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stderr is not None
        assert child.stderr.readline().strip() == "ready"
        with pytest.raises(JobError, match=rf"another run \(pid {child.pid}\)"):
            ResultStore.open(tmp_path, SETTINGS)
    finally:
        child.communicate("", timeout=30)
    assert child.returncode == 0
    ResultStore.open(tmp_path, SETTINGS).close()


def test_every_open_writes_a_new_shard(tmp_path: Path) -> None:
    """A resumed run never appends to an old shard; shards are numbered in order."""
    first = write(tmp_path, [{"id": 0}])
    before = first.read_bytes()
    second = write(tmp_path, [{"id": 1}])
    assert second != first
    assert first.read_bytes() == before
    assert shard_paths(tmp_path) == [first, second]
    assert first.name.endswith("-000001.jsonl")
    assert second.name.endswith("-000002.jsonl")


def test_opening_without_writing_leaves_no_shard(tmp_path: Path) -> None:
    """Opening and closing without results does not pile up empty shards."""
    write(tmp_path, [])
    write(tmp_path, [])
    assert shard_paths(tmp_path) == []


def test_truncated_last_line_is_cut_and_its_id_runs_again(tmp_path: Path) -> None:
    """A half-written last record (no newline) is truncated away on open."""
    good = line({"id": 0, "r": "a"}) + line({"id": 1, "r": "b"})
    shard = write_shard(tmp_path, 1, [good, b'{"id": 2, "r": "c'])
    with structlog.testing.capture_logs() as logs, ResultStore.open(tmp_path, SETTINGS) as store:
        assert shard.read_bytes() == good
        assert store.is_done(1)
        assert not store.is_done(2)
        assert store.num_done == 2
        store.append({"id": 2, "r": "c"})
    assert any(log["event"] == "truncated_line_repaired" for log in logs)


def test_unparsable_last_line_is_cut_too(tmp_path: Path) -> None:
    """A last line that ends in a newline but is not a record is also a cut-short write."""
    good = line({"id": 0})
    shard = write_shard(tmp_path, 1, [good, b'{"id": 1, "r": \n'])
    with ResultStore.open(tmp_path, SETTINGS) as store:
        assert shard.read_bytes() == good
        assert not store.is_done(1)


def test_corrupt_middle_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    """A bad line between good ones is left in place, named in a warning, its id re-run."""
    content = line({"id": 0}) + b'{"id": 1, "r\x00\x00\n' + line({"id": 2})
    shard = write_shard(tmp_path, 1, [content])
    with structlog.testing.capture_logs() as logs, ResultStore.open(tmp_path, SETTINGS) as store:
        assert store.is_done(0)
        assert not store.is_done(1)
        assert store.is_done(2)
    assert shard.read_bytes() == content
    warnings = [log for log in logs if log["event"] == "shard_line_skipped"]
    assert [(w["shard"], w["line"]) for w in warnings] == [(str(shard), 2)]


@pytest.mark.parametrize(
    "bad", [{"id": None}, {"id": 1.5}, {"id": True}, {"no_id": 1}, [1, 2], "text", 7]
)
def test_a_json_line_without_a_valid_id_is_skipped(tmp_path: Path, bad: Any) -> None:
    """A line that is JSON but not a record with an int or str id is skipped like a
    corrupt one (its row runs again); the records around it count."""
    content = line({"id": 0}) + orjson.dumps(bad) + b"\n" + line({"id": 2})
    write_shard(tmp_path, 1, [content])
    with structlog.testing.capture_logs() as logs, ResultStore.open(tmp_path, SETTINGS) as store:
        assert (store.is_done(0), store.is_done(2), store.num_done) == (True, True, 2)
    assert [log["line"] for log in logs if log["event"] == "shard_line_skipped"] == [2]


def test_files_in_shards_that_are_not_shards_are_left_alone(tmp_path: Path) -> None:
    """Other files and folders under shards/ (an editor's backup, a folder) are neither
    read nor touched."""
    write_shard(tmp_path, 1, [line({"id": 0})])
    shards = tmp_path / "shards"
    (shards / "notes.txt").write_bytes(line({"id": 5}))
    (shards / "part-20240101T000000000000Z-1-000002.jsonl.bak").write_bytes(line({"id": 6}))
    (shards / "old").mkdir()
    with ResultStore.open(tmp_path, SETTINGS) as store:
        assert store.num_done == 1
        assert not store.is_done(5) and not store.is_done(6)
    assert (shards / "notes.txt").read_bytes() == line({"id": 5})
    assert consolidate(tmp_path).num_rows == 1


@pytest.mark.parametrize("kind", ["directory", "link", "fifo"])
def test_an_entry_with_a_shard_name_that_is_not_a_file_is_refused(
    tmp_path: Path, kind: str
) -> None:
    """A folder, a link or a FIFO under a shard's name is refused by name: never read
    through, never "repaired" (a link's target would be cut), never waited on."""
    write_shard(tmp_path, 1, [line({"id": 0})])
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(line({"id": 9}) + b'{"id": 1')  # a torn last line
    planted = tmp_path / "shards" / "part-20240101T000000000000Z-1-000003.jsonl"
    if kind == "directory":
        planted.mkdir()
    elif kind == "link":
        planted.symlink_to(outside)
    else:
        os.mkfifo(planted)
    with pytest.raises(RunDirectoryError, match=re.escape(str(planted))):
        ResultStore.open(tmp_path, SETTINGS)
    assert outside.read_bytes() == line({"id": 9}) + b'{"id": 1'


def test_a_directory_that_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    """An output directory under a file: an OutputWriteError naming the path, not a
    traceback from deep inside."""
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(OutputWriteError, match="a-file"):
        ResultStore.open(tmp_path / "a-file" / "run", SETTINGS)


def test_an_id_is_written_once_per_store(tmp_path: Path) -> None:
    """Appending the same id twice is refused, and the shard holds it once."""
    with ResultStore.open(tmp_path, SETTINGS) as store:
        store.append({"id": "a", "r": 1})
        with pytest.raises(JobError, match="already has a result"):
            store.append({"id": "a", "r": 2})
        assert store.num_written == 1
    assert store.shard_path.read_bytes() == line({"id": "a", "r": 1})


def test_an_id_done_in_an_earlier_run_is_refused(tmp_path: Path) -> None:
    """Exactly once across runs: a resumed store refuses an id already on disk."""
    write(tmp_path, [{"id": 5}])
    with ResultStore.open(tmp_path, SETTINGS) as store, pytest.raises(JobError):
        store.append({"id": 5})


@pytest.mark.parametrize("record", [{"r": 1}, {"id": True}, {"id": 1.5}, {"id": None}])
def test_a_record_without_a_valid_id_is_refused(tmp_path: Path, record: dict[str, Any]) -> None:
    """The id must be an int or a str."""
    with ResultStore.open(tmp_path, SETTINGS) as store, pytest.raises(JobError, match="'id'"):
        store.append(record)


def test_a_record_that_is_not_json_is_refused_and_not_marked(tmp_path: Path) -> None:
    """A failed serialization leaves the id free to be written."""
    with ResultStore.open(tmp_path, SETTINGS) as store:
        with pytest.raises(JobError, match="JSON"):
            store.append({"id": 1, "r": object()})
        assert not store.is_done(1)
        store.append({"id": 1, "r": "ok"})


def test_resume_counts_done_errors_and_written(tmp_path: Path) -> None:
    """Counts come from the shards; an id written twice across shards counts once."""
    write_shard(tmp_path, 1, [line({"id": 0}), line({"id": 1, "error": "x"}), line({"id": 2})])
    write_shard(tmp_path, 2, [line({"id": 2, "error": "late"}), line({"id": "s"})])
    with ResultStore.open(tmp_path, SETTINGS) as store:
        assert (store.num_done, store.num_errors, store.num_written) == (4, 1, 0)
        assert store.is_done(1)  # an error row is done unless retry_errors
        store.append({"id": 3})
        store.append({"id": 4, "error": "boom"})
        assert (store.num_done, store.num_errors, store.num_written) == (6, 2, 2)
    with ResultStore.open(tmp_path, SETTINGS) as store:
        assert (store.num_done, store.num_errors, store.num_written) == (6, 2, 0)


def test_retry_errors_sends_error_rows_again(tmp_path: Path) -> None:
    """With retry_errors, error-only ids are not done; once retried they are."""
    write(tmp_path, [{"id": 0}, {"id": 1, "error": "x"}, {"id": 2, "error": "y"}])
    with ResultStore.open(tmp_path, SETTINGS, retry_errors=True) as store:
        assert store.is_done(0)
        assert not store.is_done(1)
        assert not store.is_done(2)
        assert (store.num_done, store.num_errors) == (1, 2)
        store.append({"id": 1, "r": "fixed"})
        store.append({"id": 2, "error": "again"})
        store.append({"id": 3, "error": "new"})
        assert store.is_done(1)
        assert store.is_done(2)
        assert store.is_done(3)
        assert (store.num_done, store.num_errors) == (4, 2)
        for row_id in (1, 2, 3):
            with pytest.raises(JobError):
                store.append({"id": row_id})
    with ResultStore.open(tmp_path, SETTINGS) as store:
        assert (store.num_done, store.num_errors) == (4, 2)
    with ResultStore.open(tmp_path, SETTINGS, retry_errors=True) as store:
        assert (store.num_done, store.num_errors) == (2, 2)


def test_flush_writes_whole_lines_and_close_writes_the_rest(tmp_path: Path) -> None:
    """Nothing is on disk before flush; after it, only complete lines."""
    store = ResultStore.open(tmp_path, SETTINGS)
    store.append({"id": 0})
    assert store.shard_path.read_bytes() == b""
    store.flush()
    assert store.shard_path.read_bytes() == line({"id": 0})
    store.append({"id": 1})
    store.sync()
    assert store.shard_path.read_bytes() == line({"id": 0}) + line({"id": 1})
    store.append({"id": 2})
    store.close()
    store.close()  # idempotent
    assert store.shard_path.read_bytes().count(b"\n") == 3
    with pytest.raises(JobError, match="closed"):
        store.append({"id": 3})


def test_sync_on_another_thread_while_appending_loses_nothing(tmp_path: Path) -> None:
    """flush/sync may run in a worker thread while the loop thread appends."""
    store = ResultStore.open(tmp_path, SETTINGS)
    stop = threading.Event()

    def syncing() -> None:
        while not stop.is_set():
            store.sync()

    worker = threading.Thread(target=syncing)
    worker.start()
    try:
        for i in range(20_000):
            store.append({"id": i, "text": "x" * 50})
    finally:
        stop.set()
        worker.join(timeout=60)
        store.close()
    lines = store.shard_path.read_bytes().splitlines()
    assert [orjson.loads(raw)["id"] for raw in lines] == list(range(20_000))


def test_big_batches_are_written_before_flush(tmp_path: Path) -> None:
    """Past the buffer size, records go to the file without waiting for flush()."""
    with ResultStore.open(tmp_path, SETTINGS) as store:
        for i in range(3_000):
            store.append({"id": i, "text": "y" * 1_000})
        on_disk = store.shard_path.read_bytes()
        assert on_disk
        assert on_disk.endswith(b"\n")


def test_repr_shows_the_state(tmp_path: Path) -> None:
    """The repr says open or closed and the counts."""
    store = ResultStore.open(tmp_path, SETTINGS)
    store.append({"id": 0})
    assert "open" in repr(store)
    assert "written=1" in repr(store)
    store.close()
    assert "closed" in repr(store)
    assert store.output_dir == tmp_path
