"""A run directory that fills up or cannot be written: one clear error, nothing lost, and
the same command resumes exactly.

The full disk is real: a small tmpfs mounted for the test (as root), grown afterwards
with a remount so that the resume runs on the very same files.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from llm_annotator import OutputWriteError, VLLMQueueAnnotator
from tests.cli import run_job
from tests.conftest import REQUIRE_VLLM_ENV
from tests.unit.conftest import FakeServer

ROWS = 400


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs; ``remount(size)`` grows it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        message = f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}"
        if os.environ.get(REQUIRE_VLLM_ENV):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield mount
    finally:
        with contextlib.suppress(OSError):
            subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


def grow(mount: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=8m", str(mount)], check=True)


def rows(tmp_path: Path) -> Path:
    """Rows of about 600 bytes each: 400 of them do not fit in 64 KiB."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(
        b"".join(
            orjson.dumps({"id": i, "text": f"row {i} " + "x" * 600}) + b"\n" for i in range(ROWS)
        )
    )
    return path


def test_a_full_disk_stops_the_job_with_one_error_and_the_resume_is_exact(
    fake_server: FakeServer, small_disk: Path, tmp_path: Path
) -> None:
    """The job stops with OutputWriteError naming the file, the cause and the fix; what
    was written stays readable; after space is freed the same job writes every row once
    and sends only the rows that had no result."""
    data = rows(tmp_path)
    run = small_disk / "run"
    with VLLMQueueAnnotator([fake_server.base_url], batch_size=16) as pool:
        with pytest.raises(OutputWriteError) as caught:
            pool.annotate(data, "Label: {text}", run, id_column="id", progress=False)
        message = str(caught.value)
        assert "No space left on device" in message
        assert str(run) in message
        assert "run the same command again" in message
        assert caught.value.path.startswith(str(run))
        written = [
            orjson.loads(line)
            for shard in (run / "shards").glob("*.jsonl")
            for line in shard.read_bytes().splitlines()
            if line.endswith(b"}")
        ]
        assert 0 < len(written) < ROWS
        first_sent = len(fake_server.requests)

        grow(small_disk)
        result = pool.annotate(data, "Label: {text}", run, id_column="id", progress=False)
    table = pq.read_table(result.output_path).to_pylist()
    assert sorted(r["id"] for r in table) == list(range(ROWS))
    assert result.num_failed == 0
    assert result.num_resumed >= len(written) - 1  # a cut-off last line is sent again
    assert result.num_sent == ROWS - result.num_resumed
    assert len(fake_server.requests) == first_sent + result.num_sent


def test_the_command_on_a_full_disk_exits_1_without_a_traceback(
    fake_server: FakeServer, small_disk: Path, tmp_path: Path
) -> None:
    """`llm-annotator run` says what happened in one error line and exits 1."""
    done = run_job(fake_server.base_url, rows(tmp_path), small_disk / "run", timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("llm-annotator run:")]
    assert len(errors) == 1
    assert "No space left on device" in errors[0] and "run the same command again" in errors[0]


def test_an_output_directory_that_cannot_be_made_fails_before_any_request(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """An output directory below a file fails at once, before a server is asked."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x", encoding="utf-8")
    with (
        VLLMQueueAnnotator([fake_server.base_url]) as pool,
        pytest.raises(OutputWriteError, match="cannot write") as caught,
    ):
        pool.annotate(rows(tmp_path), "{text}", blocker / "run", progress=False)
    assert "Not a directory" in str(caught.value) or "File exists" in str(caught.value)
    assert fake_server.requests == []
