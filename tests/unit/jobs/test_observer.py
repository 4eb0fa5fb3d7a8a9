"""The one observer loop of a running job: what it feeds, how often, and how it ends."""

from __future__ import annotations

import asyncio
import io
import os
import socket
from pathlib import Path
from typing import Any

import orjson
import pytest

from llm_annotator import VLLMOnlineClient
from llm_annotator.errors import RunDirectoryError
from llm_annotator.jobs.watch.observer import Observer
from llm_annotator.jobs.watch.progress import Progress
from llm_annotator.jobs.watch.status import STATUS_FILE, STATUS_INTERVAL, StatusFile
from llm_annotator.jobs.watch.timeline import SAMPLE_INTERVAL, TIMELINE_FILE, RunWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def observer_of(run: Path, clock: Clock) -> tuple[Observer, Progress]:
    progress = Progress(10, 0, healthy=lambda: 1, stream=io.StringIO(), bar=False, clock=clock)
    client = VLLMOnlineClient(model="m", base_url="http://127.0.0.1:9/v1")  # never called
    watch = RunWatch(run, progress, client, 0, clock=clock, wall=clock)
    return Observer(StatusFile(run, 10), watch, progress.figures), progress


def events(run: Path) -> list[str]:
    lines = (run / TIMELINE_FILE).read_bytes().splitlines()
    return [orjson.loads(line)["e"] for line in lines]


def paced(observer: Observer, progress: Progress, clock: Clock, looks: int) -> asyncio.Event:
    """Give the observer a sleep that moves the clock on and does a row each time, and
    return an event set once it has looked ``looks`` times (its loop then waits)."""
    done = asyncio.Event()

    async def sleep(seconds: float) -> None:
        assert seconds == SAMPLE_INTERVAL
        if observer.writing is not None:
            await observer.writing  # as a second's sleep would let it land
        clock.now += seconds
        progress.add(rows=1)
        if observer.looks == looks:
            done.set()
            await asyncio.Event().wait()

    observer._sleep = sleep
    return done


async def test_one_loop_ticks_the_timeline_every_second_and_writes_status_every_fifth(
    tmp_path: Path,
) -> None:
    clock = Clock()
    observer, progress = observer_of(tmp_path, clock)
    written: list[int] = []
    status_observe = observer.status.observe

    async def spy(figures: dict[str, Any]) -> None:
        written.append(figures["done"])
        await status_observe(figures)

    observer.status.observe = spy  # type: ignore[method-assign]
    looks = 12
    done = paced(observer, progress, clock, looks)
    async with observer.kept():
        await asyncio.wait_for(done.wait(), 30)
    every = round(STATUS_INTERVAL / SAMPLE_INTERVAL)
    assert written == [look for look in range(looks) if look % every == 0]
    assert events(tmp_path) == ["start", *["tick"] * looks, "tick", "end"]
    status = orjson.loads((tmp_path / STATUS_FILE).read_bytes())
    assert (status["state"], status["done"]) == ("finished", looks)


async def test_a_cancelled_job_is_interrupted_in_status_json_and_the_timeline(
    tmp_path: Path,
) -> None:
    clock = Clock()
    observer, progress = observer_of(tmp_path, clock)
    done = paced(observer, progress, clock, 3)

    async def job() -> None:
        async with observer.kept():
            await asyncio.wait_for(done.wait(), 30)
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        await job()
    status = orjson.loads((tmp_path / STATUS_FILE).read_bytes())
    end = orjson.loads((tmp_path / TIMELINE_FILE).read_bytes().splitlines()[-1])
    assert status["state"] == end["state"] == "interrupted"


async def test_a_job_does_not_start_over_a_planted_status_file(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / STATUS_FILE)
    observer, _ = observer_of(tmp_path, Clock())
    with pytest.raises(RunDirectoryError, match=r"status\.json is a FIFO"):
        async with observer.kept():
            pytest.fail("the block ran")
    assert not (tmp_path / TIMELINE_FILE).exists()


async def test_a_planted_timeline_stops_the_job_and_status_json_says_it_failed(
    tmp_path: Path,
) -> None:
    (tmp_path / TIMELINE_FILE).symlink_to(tmp_path / "elsewhere")
    earlier = {"state": "interrupted", "pid": os.getpid() + 1, "host": socket.gethostname()}
    (tmp_path / STATUS_FILE).write_bytes(orjson.dumps(earlier))  # an earlier job's
    observer, _ = observer_of(tmp_path, Clock())
    with pytest.raises(RunDirectoryError, match=r"timeline\.jsonl is a symbolic link"):
        async with observer.kept():
            pytest.fail("the block ran")
    status = orjson.loads((tmp_path / STATUS_FILE).read_bytes())
    assert status["state"] == "failed" and "timeline.jsonl" in status["error"]
    assert not (tmp_path / "elsewhere").exists()


async def test_a_timeline_that_fails_to_close_still_leaves_status_json_saying_how_it_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    observer, _ = observer_of(tmp_path, Clock())
    assert observer.watch.file is not None

    def broken_close() -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"):
        async with observer.kept():
            monkeypatch.setattr(observer.watch.file, "close", broken_close)
    status = orjson.loads((tmp_path / STATUS_FILE).read_bytes())
    assert status["state"] == "failed" and "Input/output error" in status["error"]
