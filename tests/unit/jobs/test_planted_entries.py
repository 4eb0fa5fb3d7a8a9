"""The run directory is the job's own: a link, a FIFO or a folder planted under one of
the names a job writes (the lock, job.json, status.json, the timeline, the outputs, the
report, a store file) is refused before any request with one line naming it, and the
link's target is never truncated, overwritten or appended to."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from llm_annotator import RunDirectoryError, VLLMQueueAnnotator
from llm_annotator.jobs.annotate import RUN_FILES
from tests.cli import COMMAND
from tests.unit.conftest import FakeServer
from tests.unit.helpers import FAST, write_rows

OUTSIDE = b"a file outside the run directory\n"


def plant(entry: Path, kind: str, outside: Path) -> None:
    if kind == "link":
        entry.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(entry)
    else:
        entry.mkdir()


@pytest.mark.parametrize("kind", ["link", "fifo", "directory"])
@pytest.mark.parametrize("name", RUN_FILES)
def test_an_entry_planted_under_a_job_file_is_refused_before_any_request(
    fake_server: FakeServer, tmp_path: Path, name: str, kind: str
) -> None:
    """Run in a thread joined with a timeout: a FIFO that is waited on fails the test
    instead of hanging it."""
    data = write_rows(tmp_path / "data.jsonl", 5)
    out = tmp_path / "run"
    out.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_bytes(OUTSIDE)
    plant(out / name, kind, outside)
    outcome: list[BaseException | object] = []

    def attempt() -> None:
        try:
            with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
                outcome.append(pool.annotate(data, "Label: {text}", out, progress=False))
        except BaseException as error:
            outcome.append(error)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(30)
    assert outcome, f"the job blocked on a planted {kind} {name}"
    assert isinstance(outcome[0], RunDirectoryError), outcome
    assert str(out / name) in str(outcome[0])
    assert fake_server.requests == []
    assert outside.read_bytes() == OUTSIDE


def test_a_link_planted_in_shards_is_refused_and_its_target_not_cut(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A store file that is a link to an outside file whose last line is torn: the
    repair of a torn last line would have truncated the target."""
    data = write_rows(tmp_path / "data.jsonl", 5)
    out = tmp_path / "run"
    with VLLMQueueAnnotator([fake_server.base_url], **FAST) as pool:
        pool.annotate(data, "Label: {text}", out, progress=False)
        outside = tmp_path / "outside.jsonl"
        outside.write_bytes(b'{"id": 99}\n{"id": 100, "respo')
        (out / "shards" / "part-20200101T000000000000Z-1-000000.jsonl").symlink_to(outside)
        with pytest.raises(RunDirectoryError, match="is a symbolic link"):
            pool.annotate(data, "Label: {text}", out, progress=False)
    assert outside.read_bytes() == b'{"id": 99}\n{"id": 100, "respo'


def test_the_command_says_one_line_and_exits_1(fake_server: FakeServer, tmp_path: Path) -> None:
    data = write_rows(tmp_path / "data.jsonl", 3)
    out = tmp_path / "run"
    out.mkdir()
    (out / "timeline.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    done = subprocess.run(
        [
            COMMAND,
            "run",
            "--servers",
            fake_server.base_url,
            "--input",
            str(data),
            "--prompt-template",
            "Label: {text}",
            "--output-dir",
            str(out),
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        check=False,
    )
    err = done.stderr.decode()
    assert done.returncode == 1, err[-2000:]
    assert "Traceback" not in err
    assert f"{out / 'timeline.jsonl'} is a symbolic link" in err
    assert not (tmp_path / "elsewhere.jsonl").exists()
