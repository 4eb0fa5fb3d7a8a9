"""Every reader of a run directory checks what it reads, and nothing planted there is
written through: ``job.json``, ``status.json``, ``report.json``, ``timeline.jsonl``,
``sharding.json``, the shard folders and the reports written back.

A file of the wrong shape is one line naming it from ``llm-annotator status``,
``report`` and ``merge`` (or, for the advisory ``status.json`` and timeline, is ignored
field by field or line by line); a link, a FIFO or a folder under one of those names is
never followed, never written through and never waited on. Each attempt that could
wait on a FIFO runs in a daemon thread joined with a timeout (:func:`bounded`), so that
a reader that blocks fails the test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_annotator.cli.main import main
from llm_annotator.errors import ConfigurationError, JobError, RunDirectoryError
from llm_annotator.jobs.loop.summary import write_json
from llm_annotator.jobs.run_report import run_series, write_html_report
from llm_annotator.jobs.rundir.fingerprint import read_job_record
from llm_annotator.jobs.rundir.store import ResultStore
from llm_annotator.jobs.shards.merge import merge, shard_states
from llm_annotator.jobs.shards.shard import MAX_SHARDS, Shard, claim, read_sharding
from llm_annotator.jobs.watch.status import StatusFile, run_status
from llm_annotator.jobs.watch.timeline import (
    SERVER_FIELDS,
    TIMELINE_FILE,
    TimelineFile,
    last_servers,
    read_timeline,
)

T = TypeVar("T")

STATES = {"running", "consolidating", "finished", "interrupted", "failed", "stopped"}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def dump(path: Path, value: Any) -> None:
    path.write_bytes(orjson.dumps(value))


def make_run(directory: Path, rows: int = 2, fingerprint: dict[str, Any] | None = None) -> Path:
    """A run directory with ``rows`` answered rows and a finished status, made by hand."""
    with ResultStore.open(directory, fingerprint or {"model": "m"}) as store:
        for k in range(rows):
            store.append({"id": f"{directory.name}-{k}", "response": "a", "error": None})
    dump(directory / "status.json", {"state": "finished", "total": rows})
    return directory


def make_sharded(run: Path, count: int = 2) -> Path:
    """A sharded run directory whose ``count`` shards all finished."""
    run.mkdir(parents=True, exist_ok=True)
    dump(run / "sharding.json", {"count": count, "fingerprint": {"model": "m"}})
    for index in range(count):
        make_run(Shard(index, count).directory(run), fingerprint={"model": "m", "shard": index})
    return run


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the command, which must fail with one line (no traceback); that line."""
    assert main(list(argv)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("llm-annotator ")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"llm-annotator {argv[0]}: error: ")
    return lines[0]


def warnings_of(logs: Sequence[Mapping[str, Any]], event: str) -> list[Mapping[str, Any]]:
    return [entry for entry in logs if entry["event"] == event]


def bounded(action: Callable[[], T], fifo: Path | None = None, seconds: float = 20.0) -> T:
    """``action()`` run in a daemon thread: its result, or its exception raised here; a
    failure (not a hang) if it is still running after ``seconds`` (waiting on ``fifo``,
    which is then opened at both ends so that the thread can end)."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, action()))
        except BaseException as error:
            outcome.append((False, error))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:  # a FIFO opened read-write never blocks, and ends the wait
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_RDWR | os.O_NONBLOCK))
        pytest.fail(f"still waiting after {seconds} s (on {fifo})")
    ok, value = outcome[0]
    if not ok:
        raise value
    result: T = value
    return result


@pytest.fixture(autouse=True)
def _logging_of_its_own() -> Iterator[None]:
    """structlog as a fresh process has it (the status and report commands configure a
    filter; captured warnings need none), restored afterwards."""
    configured = structlog.is_configured()
    saved = structlog.get_config()
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
    if configured:
        structlog.configure(**saved)


@contextlib.contextmanager
def victim(tmp_path: Path) -> Iterator[Path]:
    """A file outside the run directory that a planted link points to; unchanged after."""
    target = tmp_path / "elsewhere" / "victim.txt"
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(b"not the job's")
    yield target
    assert target.read_bytes() == b"not the job's"


# -- sharding.json and the shard folders ---------------------------------------------------

BAD_SHARDINGS: list[Any] = [
    None,
    [],
    "4",
    4,
    {},
    {"count": "4", "fingerprint": {}},
    {"count": 10**12, "fingerprint": {}},
    {"count": MAX_SHARDS + 1, "fingerprint": {}},
    {"count": -1, "fingerprint": {}},
    {"count": 0, "fingerprint": {}},
    {"count": True, "fingerprint": {}},
    {"count": 2.0, "fingerprint": {}},
    {"count": 2},
    {"count": 2, "fingerprint": []},
    {"count": 2, "fingerprint": "m"},
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", BAD_SHARDINGS, ids=repr)
def test_a_sharding_record_of_the_wrong_shape_is_one_line_from_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: Any
) -> None:
    run = make_sharded(tmp_path / "run")
    dump(run / "sharding.json", value)
    for command in ("status", "merge", "report"):
        assert "sharding.json" in one_line_error(capsys, command, str(run))
    with pytest.raises(RunDirectoryError, match=r"sharding\.json"):
        read_sharding(run)


@pytest.mark.timeout(60)
def test_a_planted_sharding_link_or_fifo_is_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_sharded(tmp_path / "run")
    with victim(tmp_path) as target:
        dump(target.with_name("record.json"), {"count": 2, "fingerprint": {"model": "m"}})
        (run / "sharding.json").unlink()
        (run / "sharding.json").symlink_to(target.with_name("record.json"))
        assert "symbolic link" in one_line_error(capsys, "merge", str(run))
        with pytest.raises(RunDirectoryError, match=r"sharding\.json is a symbolic link"):
            claim(run, Shard(0, 2), {"model": "m"}, force=True)
        (run / "sharding.json").unlink()
        os.mkfifo(run / "sharding.json")
        for command in ("status", "merge", "report"):
            line = bounded(
                partial(one_line_error, capsys, command, str(run)), run / "sharding.json"
            )
            assert "sharding.json is a FIFO" in line
        with pytest.raises(RunDirectoryError, match="FIFO"):
            bounded(
                lambda: claim(run, Shard(0, 2), {"model": "m"}, force=False), run / "sharding.json"
            )


def test_a_shard_count_has_an_upper_bound() -> None:
    assert Shard(MAX_SHARDS - 1, MAX_SHARDS).name == f"shard-{MAX_SHARDS - 1:04d}-of-{MAX_SHARDS}"
    with pytest.raises(ConfigurationError, match=f"at most {MAX_SHARDS:,}"):
        Shard(0, MAX_SHARDS + 1)
    with pytest.raises(ConfigurationError, match=f"at most {MAX_SHARDS:,}"):
        Shard.parse("0/1000000000")
    env = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": str(MAX_SHARDS + 1)}
    with pytest.raises(ConfigurationError, match=f"at most {MAX_SHARDS:,}"):
        Shard.parse("auto", env)


def test_a_shard_count_above_the_bound_is_one_line_from_the_run_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"text": "a"}\n')
    line = one_line_error(
        capsys,
        "run",
        "--servers",
        "http://127.0.0.1:9/v1",
        "--input",
        str(data),
        "--prompt-template",
        "Label: {text}",
        "--output-dir",
        str(tmp_path / "run"),
        "--shard",
        "0/1000000000",
    )
    assert f"at most {MAX_SHARDS:,}" in line
    assert not (tmp_path / "run").exists()


def test_claim_makes_its_temporary_under_a_fresh_name(tmp_path: Path) -> None:
    """A link planted at the name a shard process would pick is neither written nor
    linked into place."""
    run = tmp_path / "run"
    run.mkdir()
    with victim(tmp_path) as target:
        for index in range(2):
            (run / f".sharding.json.{os.getpid()}.{index}").symlink_to(target)
        claim(run, Shard(0, 2), {"model": "m"}, force=False)
    assert read_sharding(run) == {"count": 2, "fingerprint": {"model": "m"}}
    assert not (run / "sharding.json").is_symlink()
    assert sorted(p.name for p in run.iterdir() if not p.is_symlink()) == ["sharding.json"]


@pytest.mark.timeout(60)
def test_the_largest_count_lists_the_folders_and_caps_the_missing_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_sharded(tmp_path / "run", 2)
    dump(run / "sharding.json", {"count": MAX_SHARDS, "fingerprint": {"model": "m"}})
    for index in (0, 1):  # the two folders, named for the large count
        Shard(index, 2).directory(run).rename(Shard(index, MAX_SHARDS).directory(run))
    started = time.monotonic()
    with pytest.raises(JobError) as caught:
        merge(run)
    message = str(caught.value)
    assert f"{MAX_SHARDS - 2} of its {MAX_SHARDS} shards are not complete" in message
    assert f"shard 2 of {MAX_SHARDS}: not started" in message
    assert f"shard 21 of {MAX_SHARDS}: not started" in message
    assert f"shard 22 of {MAX_SHARDS}" not in message
    assert f"and {MAX_SHARDS - 22} more" in message
    assert len(message.splitlines()) < 30
    assert main(["status", str(run)]) == 0
    shown = capsys.readouterr().out
    listed = [line for line in shown.splitlines() if line.startswith("shard ")]
    assert len(listed) == 20 and all("not started" in line for line in listed)
    assert f"and {MAX_SHARDS - 22} more shards not started" in shown
    assert time.monotonic() - started < 20


def test_shard_folders_are_found_by_listing_and_odd_names_are_skipped_with_a_warning(
    tmp_path: Path,
) -> None:
    run = make_sharded(tmp_path / "run", 3)
    Shard(2, 3).directory(run).rename(run / "shard-0002-of-0004")  # another count's
    (run / "shard-2-of-3").mkdir()  # not the name the job gives it
    (run / "shard-0001-of-0003x").mkdir()
    (run / "shard-٠٠٠١-of-٠٠٠٣").mkdir()  # Arabic-Indic digits: not the job's name
    with structlog.testing.capture_logs() as logs:
        count, states = shard_states(run)
    assert count == 3
    assert [s.state for s in states] == ["finished", "finished", "missing"]
    ignored = warnings_of(logs, "shard_entry_ignored")
    assert sorted(entry["entry"] for entry in ignored) == sorted(
        ["shard-0002-of-0004", "shard-2-of-3", "shard-0001-of-0003x", "shard-٠٠٠١-of-٠٠٠٣"]
    )
    with pytest.raises(JobError, match="1 of its 3 shards are not complete"):
        merge(run)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["link", "file", "fifo"])
def test_an_entry_under_a_shard_folders_name_that_is_not_a_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    run = make_sharded(tmp_path / "run", 3)
    elsewhere = make_sharded(tmp_path / "other", 3)
    shard = Shard(1, 3).directory(run)
    shutil.rmtree(shard)
    kept = {
        p.name: p.read_bytes() for p in Shard(1, 3).directory(elsewhere).iterdir() if p.is_file()
    }
    if kind == "link":
        shard.symlink_to(Shard(1, 3).directory(elsewhere), target_is_directory=True)
    elif kind == "file":
        shard.write_bytes(b"")
    else:
        os.mkfifo(shard)
    with pytest.raises(RunDirectoryError, match="shard-0001-of-0003 is "):
        bounded(lambda: shard_states(run), shard)
    for command in ("status", "merge", "report"):
        line = bounded(partial(one_line_error, capsys, command, str(run)), shard)
        assert "shard-0001-of-0003 is " in line
    after = {
        p.name: p.read_bytes() for p in Shard(1, 3).directory(elsewhere).iterdir() if p.is_file()
    }
    assert after == kept  # the linked folder's files untouched (no lock, no output)


# -- job.json --------------------------------------------------------------------------------

BAD_JOBS: list[Any] = [
    None,
    [],
    "job",
    5,
    {},
    {"fingerprint": []},
    {"fingerprint": "m"},
    {"fingerprint": {}, "format_version": "1"},
    {"fingerprint": {}, "format_version": True},
    {"fingerprint": {}, "format_version": 1.0},
    {"fingerprint": {}, "history": 5},
    {"fingerprint": {}, "history": "abc"},
]


@pytest.mark.parametrize("value", BAD_JOBS, ids=repr)
def test_a_job_record_of_the_wrong_shape_is_one_line_from_status_and_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: Any
) -> None:
    run = make_run(tmp_path / "run")
    dump(run / "job.json", value)
    assert "job.json" in one_line_error(capsys, "status", str(run))
    assert "job.json" in one_line_error(capsys, "report", str(run))
    with pytest.raises(JobError, match=r"job\.json"):
        read_job_record(run / "job.json")
    assert read_job_record(run / "job.json", force=True) is None
    with pytest.raises(JobError, match=r"job\.json"):
        ResultStore.open(run, {"model": "m"})


@pytest.mark.timeout(60)
def test_a_planted_job_record_link_or_fifo_is_refused_even_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path / "run")
    with victim(tmp_path) as target:
        (run / "job.json").rename(target.with_name("job.json"))
        (run / "job.json").symlink_to(target.with_name("job.json"))
        assert "job.json is a symbolic link" in one_line_error(capsys, "status", str(run))
        with pytest.raises(RunDirectoryError, match="symbolic link"):
            read_job_record(run / "job.json", force=True)
    (run / "job.json").unlink()
    fifo = run / "job.json"
    os.mkfifo(fifo)
    for command in ("status", "report"):
        line = bounded(partial(one_line_error, capsys, command, str(run)), fifo)
        assert "job.json is a FIFO" in line
    with pytest.raises(RunDirectoryError, match="FIFO"):
        bounded(lambda: read_job_record(fifo, force=True), fifo)
    with pytest.raises(RunDirectoryError, match="FIFO"):
        bounded(lambda: ResultStore.open(run, {"model": "m"}, force=True), fifo)


@pytest.mark.parametrize(
    "fingerprint",
    [
        {"model": 5, "sample": [1, 2]},
        {"model": ["m"], "sample": "first 5"},
        {"model": None, "sample": {"limit": "5", "shuffle_seed": []}},
        {"model": "m", "sample": {"limit": True}},
    ],
    ids=repr,
)
def test_the_fingerprint_fields_status_shows_are_checked_for_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fingerprint: dict[str, Any]
) -> None:
    run = make_run(tmp_path / "run", fingerprint=fingerprint)
    status = run_status(run)
    assert status.model is None or status.model == "m"
    assert status.sample is None
    assert main(["status", str(run)]) == 0
    assert main(["status", str(run), "--json"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_sample_of_the_right_types_is_shown(tmp_path: Path) -> None:
    run = make_run(
        tmp_path / "run", fingerprint={"model": "m", "sample": {"limit": 5, "shuffle_seed": 7}}
    )
    assert run_status(run).sample == {"limit": 5, "shuffle_seed": 7}


# -- status.json -----------------------------------------------------------------------------


def fresh() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


ELSEWHERE = {"state": "running", "host": "node-elsewhere", "pid": 7}
BAD_STATUSES: list[Any] = [
    None,
    [],
    "running",
    5,
    {"state": 5},
    {"state": ["running"]},
    {"state": "exploded"},
    {"state": "finished", "total": "x"},
    {"state": "finished", "total": -1},
    {"state": "finished", "total": True},
    {"state": "finished", "pid": 1.5},
    {"state": "finished", "pid": True},
    {"state": "finished", "pid": -3},
    {"state": "finished", "updated": 5},
    {"state": "finished", "host": 5},
    {"state": "failed", "error": ["x"]},
    {**ELSEWHERE, "updated": "2020-01-01T00:00:00"},  # no time zone
    {**ELSEWHERE, "updated": "tomorrow"},
    {**ELSEWHERE, "updated": "FRESH", "rows_per_second": "fast", "eta_seconds": [1]},
    {**ELSEWHERE, "updated": "FRESH", "rows_per_second": True, "eta_seconds": -5},
]


@pytest.mark.parametrize("value", BAD_STATUSES, ids=repr)
def test_status_fields_of_the_wrong_type_are_ignored_one_by_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: Any
) -> None:
    run = make_run(tmp_path / "run")
    if isinstance(value, dict) and value.get("updated") == "FRESH":
        value = {**value, "updated": fresh()}
    dump(run / "status.json", value)
    status = run_status(run)
    assert status.state in STATES
    assert status.pid is None or (type(status.pid) is int and status.pid >= 0)
    assert status.total is None or (type(status.total) is int and status.total >= 0)
    assert status.host is None or isinstance(status.host, str)
    assert status.updated is None or isinstance(status.updated, str)
    assert status.error is None or isinstance(status.error, str)
    for number in (status.rows_per_second, status.eta_seconds):
        assert number is None or (type(number) in (int, float) and number >= 0)
    assert status.done == 2
    assert main(["status", str(run)]) == 0
    assert main(["status", str(run), "--json"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_fresh_status_of_another_host_keeps_its_well_typed_fields(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    dump(
        run / "status.json",
        {**ELSEWHERE, "updated": fresh(), "total": 9, "rows_per_second": "x", "eta_seconds": 2.5},
    )
    status = run_status(run)
    assert (status.state, status.host, status.pid, status.total) == (
        "running",
        "node-elsewhere",
        7,
        9,
    )
    assert (status.rows_per_second, status.eta_seconds) == (None, 2.5)


@pytest.mark.timeout(60)
def test_a_status_file_link_or_fifo_is_ignored_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path / "run")
    (run / "status.json").unlink()
    with victim(tmp_path) as target:
        dump(target.with_name("status.json"), {"state": "failed", "error": "planted"})
        (run / "status.json").symlink_to(target.with_name("status.json"))
        status = run_status(run)
        assert (status.state, status.error) == ("stopped", None)  # not followed
    (run / "status.json").unlink()
    fifo = run / "status.json"
    os.mkfifo(fifo)
    assert bounded(lambda: run_status(run), fifo).state == "stopped"
    assert bounded(lambda: main(["status", str(run)]), fifo) == 0
    assert "stopped" in capsys.readouterr().out


def test_the_status_writer_uses_no_fixed_temporary_name_and_no_planted_link(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    writer = StatusFile(run, 10)
    with victim(tmp_path) as target:
        (run / f".status.json.{os.getpid()}.tmp").symlink_to(target)
        writer.write({"done": 1})
        assert orjson.loads((run / "status.json").read_bytes())["done"] == 1
        (run / "status.json").unlink()
        (run / "status.json").symlink_to(target)
        with structlog.testing.capture_logs() as logs:
            writer.write({"done": 2})  # refused, logged: the job goes on
        assert (run / "status.json").is_symlink()
        assert warnings_of(logs, "status_not_written")


# -- timeline.jsonl --------------------------------------------------------------------------


def test_the_timeline_is_never_appended_through_a_link_a_fifo_or_a_hard_link(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    path = run / TIMELINE_FILE
    with victim(tmp_path) as target:
        path.symlink_to(target)
        with pytest.raises(RunDirectoryError, match=r"timeline\.jsonl is a symbolic link"):
            TimelineFile(run).open()
        path.unlink()
        os.link(target, path)
        with pytest.raises(RunDirectoryError, match="hard links"):
            TimelineFile(run).open()
        path.unlink()
    os.mkfifo(path)
    with pytest.raises(RunDirectoryError, match="FIFO"):
        bounded(TimelineFile(run).open, path)


def test_bad_timeline_lines_are_skipped(tmp_path: Path) -> None:
    start = {"e": "start", "wall": 10.0, "total": 4, "done_before": 0}
    good = {
        "e": "tick",
        "t": 0,
        "wall": 10.0,
        "done": 0,
        "rows": 0,
        "urls": ["u"],
        "servers": [["healthy", 0, 1]],
    }
    lines: list[Any] = [
        {**start, "total": -1},
        {**start, "total": True},
        start | {"pid": True},
        good,
        {**good, "t": True},
        {**good, "done": False},
        {**good, "urls": [1, 2], "servers": [["healthy", 0], ["healthy", 0]]},
        {**good, "servers": [[5, 1, 1]]},  # a state that is not a string
        {**good, "servers": [["healthy", 1, [1]]]},
        {
            **good,
            "t": 1,
            "wall": 11.0,
            "done": 1,
            "rows": 1,
            "errors": {"timeout": "y", "gone": 1, "odd": True},
            "servers": [["healthy", 1, 0, *range(100_000)]],
        },
        {
            **good,
            "t": 2,
            "wall": 12.0,
            "done": 2,
            "rows": 2,
            "errors": [],
            "servers": [["healthy", 2, 0]],
            "queued": "many",
        },
        {"e": "member", "t": 1, "wall": 11.0, "server": "u", "from": 5, "to": "evicted"},
        {"e": "member", "t": 1, "wall": 11.0, "server": "u", "from": "healthy", "to": ["evicted"]},
        {
            "e": "member",
            "t": 1.5,
            "wall": 11.5,
            "server": "u",
            "from": "healthy",
            "to": "evicted",
            "reason": {"x": 1},
        },
        {"e": "member", "t": True, "wall": 11.0, "server": "u", "from": "healthy", "to": "evicted"},
        {"e": "end", "state": 5},
        {"e": "end", "state": None},
    ]
    body = b"".join(orjson.dumps(line) + b"\n" for line in lines) + b"not json\n[1]\n{"
    (tmp_path / TIMELINE_FILE).write_bytes(body)
    with structlog.testing.capture_logs() as logs:
        (run,) = read_timeline(tmp_path)
    (skipped,) = warnings_of(logs, "timeline_lines_skipped")
    assert (skipped["lines"], skipped["first_line"]) == (14, 1)  # "{": a line being written
    assert run.pid is None and run.total == 4
    assert [tick["done"] for tick in run.ticks] == [0, 1, 2]
    assert run.ticks[1]["errors"] == {"gone": 1}
    assert run.ticks[1]["servers"] == {
        "u": dict(zip(SERVER_FIELDS, ["healthy", 1, 0, *range(6)], strict=True))
    }
    assert run.ticks[2]["errors"] == {} and "queued" not in run.ticks[2]
    assert [(c["from"], c["to"], c["reason"]) for c in run.changes] == [
        ("healthy", "evicted", None)
    ]
    assert run.ended is None
    series = run_series([run])
    assert series.evictions == [(1.5, "u", None)]
    assert last_servers(tmp_path)["u"]["state"] == "healthy"
    dump(tmp_path / "job.json", {"fingerprint": {"model": "m"}})
    assert write_html_report(tmp_path).is_file()


@pytest.mark.timeout(60)
def test_a_timeline_link_or_fifo_gives_status_no_hang_and_report_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path / "run")
    path = run / TIMELINE_FILE
    with victim(tmp_path) as target:
        path.symlink_to(target)
        assert run_status(run).servers == {}
        assert "timeline.jsonl is a symbolic link" in one_line_error(capsys, "report", str(run))
        path.unlink()
    os.mkfifo(path)
    assert bounded(lambda: run_status(run), path).servers == {}
    assert bounded(lambda: main(["status", str(run)]), path) == 0
    line = bounded(lambda: one_line_error(capsys, "report", str(run)), path)
    assert "timeline.jsonl is a FIFO" in line


# -- report.json and the reports written ----------------------------------------------------


@pytest.mark.parametrize("value", [None, [], "report", 5], ids=repr)
def test_a_shard_report_of_the_wrong_shape_is_one_line_from_merge_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: Any
) -> None:
    run = make_sharded(tmp_path / "run")
    dump(Shard(1, 2).directory(run) / "report.json", value)
    assert "report.json" in one_line_error(capsys, "merge", str(run))
    assert "report.json" in one_line_error(capsys, "report", str(run))


def test_merge_copies_only_well_typed_parts_of_the_shards_reports(tmp_path: Path) -> None:
    run = make_sharded(tmp_path / "run")
    dump(Shard(0, 2).directory(run) / "report.json", {"this_run": [1], "per_server": 5})
    dump(
        Shard(1, 2).directory(run) / "report.json",
        {
            "this_run": {"wall_seconds": 1.5, "rows_per_second": "x"},
            "per_server": {"u": {"completed": 2}, "v": 3},
        },
    )
    merge(run)
    report = orjson.loads((run / "report.json").read_bytes())
    assert report["shards"] == [
        {"shard": 0, "rows": 2},
        {
            "shard": 1,
            "rows": 2,
            "this_run": {"wall_seconds": 1.5},
            "per_server": {"u": {"completed": 2}},
        },
    ]


@pytest.mark.timeout(60)
def test_a_planted_shard_report_link_or_fifo_is_one_line_from_merge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_sharded(tmp_path / "run")
    path = Shard(0, 2).directory(run) / "report.json"
    with victim(tmp_path) as target:
        path.symlink_to(target)
        assert "report.json is a symbolic link" in one_line_error(capsys, "merge", str(run))
        path.unlink()
    os.mkfifo(path)
    for command in ("merge", "report"):
        line = bounded(partial(one_line_error, capsys, command, str(run)), path)
        assert "report.json is a FIFO" in line
    assert not (run / "annotations.parquet").exists()  # refused before anything is written


def test_the_html_report_shows_only_numbers_from_report_json(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    dump(run / "report.json", {"this_run": {"wall_seconds": "<b>soon</b>", "rows_per_second": 3.5}})
    page = write_html_report(run).read_text()
    assert '<td>rows / s (last run)</td><td class="n">3.5</td>' in page
    assert "wall seconds" not in page and "soon" not in page


def test_reports_are_written_under_no_fixed_temporary_name(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    with victim(tmp_path) as target:
        for name in ("report.json.tmp", ".report.json.tmp", ".report.html.tmp"):
            (run / name).symlink_to(target)
        write_json(run / "report.json", {"rows": 1})
        write_html_report(run)
    assert orjson.loads((run / "report.json").read_bytes()) == {"rows": 1}
    assert (run / "report.html").read_text().startswith("<!DOCTYPE html>")


def test_reports_are_not_written_over_a_planted_link_or_fifo(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    with victim(tmp_path) as target:
        (run / "report.html").symlink_to(target)
        (run / "report.json").symlink_to(target)
        with pytest.raises(RunDirectoryError, match=r"report\.html is a symbolic link"):
            write_html_report(run)
        with pytest.raises(RunDirectoryError, match=r"report\.json is a symbolic link"):
            write_json(run / "report.json", {"rows": 1})
        assert (run / "report.html").is_symlink() and (run / "report.json").is_symlink()
    (run / "report.html").unlink()
    fifo = run / "report.html"
    os.mkfifo(fifo)
    with pytest.raises(RunDirectoryError, match=r"report\.html is a FIFO"):
        bounded(lambda: write_html_report(run), fifo)
    (run / "report.json").unlink()
    os.mkfifo(run / "report.json")
    with pytest.raises(RunDirectoryError, match=r"report\.json is a FIFO"):
        bounded(lambda: write_json(run / "report.json", {"rows": 1}), run / "report.json")


def test_an_output_the_user_names_may_be_a_link_of_theirs(tmp_path: Path) -> None:
    """``--output`` is the user's own path: a link of theirs is followed."""
    run = make_run(tmp_path / "run")
    (tmp_path / "shared.html").write_bytes(b"")
    (tmp_path / "link.html").symlink_to(tmp_path / "shared.html")
    write_html_report(run, tmp_path / "link.html")
    assert (tmp_path / "link.html").is_symlink()
    assert (tmp_path / "shared.html").read_text().startswith("<!DOCTYPE html>")


# -- anything at all in those files -----------------------------------------------------------

STATUS_KEYS = [
    "state",
    "pid",
    "host",
    "updated",
    "total",
    "rows_per_second",
    "eta_seconds",
    "error",
]
TICK_KEYS = ["e", "t", "wall", "done", "rows", "errors", "urls", "servers", "queued", "in_flight"]
OTHER_LINE_KEYS = ["total", "done_before", "pid", "server", "from", "to", "reason", "state"]
LINE_KINDS = st.sampled_from(["start", "tick", "member", "end", 5, None])


def _fields(keys: list[str]) -> st.SearchStrategy[Any]:
    return st.dictionaries(st.sampled_from(keys), json_values, max_size=len(keys)) | json_values


def _lines() -> st.SearchStrategy[list[Any]]:
    line = st.fixed_dictionaries(
        {"e": LINE_KINDS},
        optional=dict.fromkeys([*TICK_KEYS[1:], *OTHER_LINE_KEYS], json_values),
    )
    tick = st.fixed_dictionaries(
        {
            "e": st.just("tick"),
            "t": st.integers(0, 9),
            "wall": st.integers(0, 9),
            "done": st.integers(0, 9),
            "rows": st.integers(0, 9),
            "urls": st.just(["u"]),
        },
        optional={
            "servers": st.lists(st.lists(json_values, max_size=10), max_size=2),
            "errors": json_values,
        },
    )
    start = st.just({"e": "start", "wall": 0, "total": 4, "done_before": 0})
    return st.lists(start | line | tick, max_size=8)


@pytest.fixture(scope="module")
def fuzz_run() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield make_sharded(Path(folder) / "run")


@settings(max_examples=60, deadline=None)
@given(
    sharding=_fields(["count", "fingerprint"]),
    job=_fields(["fingerprint", "format_version", "history"]),
    status=_fields(STATUS_KEYS),
    report=_fields(["this_run", "per_server"]),
    lines=_lines(),
)
def test_whatever_json_the_files_hold_readers_raise_job_error_or_nothing(
    fuzz_run: Path, sharding: Any, job: Any, status: Any, report: Any, lines: list[Any]
) -> None:
    shard = Shard(0, 2).directory(fuzz_run)
    kept = (shard / "job.json").read_bytes()
    try:
        dump(fuzz_run / "sharding.json", sharding)
        dump(shard / "status.json", status)
        dump(shard / "report.json", report)
        (shard / TIMELINE_FILE).write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
        with contextlib.suppress(JobError):
            read_sharding(fuzz_run)
        with contextlib.suppress(JobError):
            shard_states(fuzz_run)
        with contextlib.suppress(JobError):
            merge(fuzz_run)
        run_series(read_timeline(shard))
        last_servers(shard)
        run_status(shard)
        dump(shard / "job.json", job)
        with contextlib.suppress(JobError):
            read_job_record(shard / "job.json")
        with contextlib.suppress(JobError):
            run_status(shard)
    finally:
        (shard / "job.json").write_bytes(kept)
        dump(fuzz_run / "sharding.json", {"count": 2, "fingerprint": {"model": "m"}})


@pytest.fixture(scope="module")
def fuzz_report_run() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield make_run(Path(folder) / "run")


@settings(max_examples=12, deadline=None)
@given(
    report=_fields(["this_run", "per_server", "rows"]), status=_fields(STATUS_KEYS), lines=_lines()
)
def test_whatever_json_the_files_hold_the_html_report_is_written_or_one_job_error(
    fuzz_report_run: Path, report: Any, status: Any, lines: list[Any]
) -> None:
    run = fuzz_report_run
    dump(run / "report.json", report)
    dump(run / "status.json", status)
    (run / TIMELINE_FILE).write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    if isinstance(report, dict):
        assert write_html_report(run).read_text().startswith("<!DOCTYPE html>")
    else:
        with pytest.raises(RunDirectoryError, match=r"report\.json is not a run report"):
            write_html_report(run)
