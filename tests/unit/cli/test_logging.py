"""Where the command's log records go: one language on standard error.

The rule is a pure function, tested with a table; the commands run as real
subprocesses with standard output and standard error as pipes (as under CI, or
``make demo | tee demo.log``), against fake servers and a refused address, whose
``member_down`` warning is the record to place.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from llm_annotator.cli._logging import HumanLines, LogPlan, log_plan
from tests.cli import COMMAND
from tests.unit.conftest import FakeServer, completion
from tests.unit.helpers import write_rows


@pytest.mark.parametrize(
    ("tty", "human", "log_format", "log_file", "plan"),
    [
        # A command with lines for people: the same on a terminal and in a pipe.
        (True, True, None, None, LogPlan("human")),
        (False, True, None, None, LogPlan("human")),
        # --log-format asks for every record on stderr, in that format.
        (False, True, "json", None, LogPlan("json")),
        (True, True, "json", None, LogPlan("json")),
        (False, True, "console", None, LogPlan("console")),
        # --log-file takes the records; stderr stays in words; --log-format is the file's.
        (True, True, None, "run.log", LogPlan("human", "run.log", "json")),
        (False, True, "json", "run.log", LogPlan("human", "run.log", "json")),
        (False, True, "console", "run.log", LogPlan("human", "run.log", "console")),
        (False, False, None, "run.log", LogPlan("human", "run.log", "json")),
        # A command without such lines (serve-local): records on stderr as before.
        (True, False, None, None, LogPlan("console")),
        (False, False, None, None, LogPlan("json")),
        (True, False, "json", None, LogPlan("json")),
        (False, False, "console", None, LogPlan("console")),
    ],
)
def test_the_rule_of_where_records_go(
    tty: bool, human: bool, log_format: str | None, log_file: str | None, plan: LogPlan
) -> None:
    """Records go to --log-file if given, else to stderr when --log-format asks; a
    command with lines for people otherwise keeps stderr in words, terminal or not."""
    assert log_plan(tty=tty, human=human, log_format=log_format, log_file=log_file) == plan
    assert plan.records_on_stderr == (plan.stderr != "human")


@pytest.mark.parametrize(
    ("event", "level", "shown"),
    [
        ("member_evicted", "warning", True),  # no line of the command says it
        ("member_disabled", "error", True),
        ("job_interrupted", "warning", False),  # the command's closing line says it
        ("progress", "info", True),  # the progress where no bar is drawn
        ("job_started", "info", False),
        ("samples_requeued", "debug", False),
    ],
)
def test_stderr_in_words_shows_what_the_command_does_not_say(
    event: str, level: str, shown: bool
) -> None:
    """In words, stderr shows warnings and errors and the few events a command shows
    people, but not what its own lines say already."""
    lines = HumanLines(shown=frozenset({"progress"}), said=frozenset({"job_interrupted"}))
    assert lines.takes({"event": event, "level": level}) is shown


def _records(text: str) -> list[str]:
    """The lines of ``text`` that are log records in JSON."""
    records = []
    for line in text.splitlines():
        try:
            parsed = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(parsed, dict):
            records.append(line)
    return records


async def _label(_: dict[str, Any]) -> web.StreamResponse:
    return completion('{"label": "positive"}')


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,  # both streams are pipes
        text=True,
        timeout=120,
        check=False,
    )


def test_run_in_a_pipe_prints_no_record_and_the_warning_once_in_words(
    fake_server: FakeServer, refused_url: str, tmp_path: Path
) -> None:
    """``run`` with stdout and stderr as pipes and no logging flag: no JSON record on
    either; the warning of the server that is down is on stderr once, in words."""
    data = write_rows(tmp_path / "data.jsonl", 30)
    done = _run(
        [
            COMMAND,
            "run",
            "--servers",
            fake_server.base_url,
            refused_url,
            "--input",
            str(data),
            "--prompt-template",
            "Label: {text}",
            "--output-dir",
            str(tmp_path / "run"),
        ]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert _records(done.stdout) == [] and _records(done.stderr) == [], done.stderr[-2000:]
    warned = [line for line in done.stderr.splitlines() if "member_down" in line]
    assert warned == [f"llm-annotator run: warning: member_down (server={refused_url})"]
    assert "rows: 30 (30 succeeded, 0 failed)" in done.stdout


def test_run_with_a_log_file_writes_every_record_there(
    fake_server: FakeServer, refused_url: str, tmp_path: Path
) -> None:
    """``--log-file`` gets every record as one JSON object a line, the warning among
    them; stderr keeps its lines in words."""
    data = write_rows(tmp_path / "data.jsonl", 30)
    log = tmp_path / "run.log"
    done = _run(
        [
            COMMAND,
            "run",
            "--servers",
            fake_server.base_url,
            refused_url,
            "--input",
            str(data),
            "--prompt-template",
            "Label: {text}",
            "--output-dir",
            str(tmp_path / "run"),
            "--log-file",
            str(log),
        ]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert _records(done.stderr) == [], done.stderr[-2000:]
    assert "llm-annotator run: warning: member_down" in done.stderr
    records = [orjson.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    events = [record["event"] for record in records]
    assert {"job_started", "member_down", "job_finished"} <= set(events)


def test_demo_in_a_pipe_says_a_servers_fall_once_and_prints_no_record(
    fake_servers: Any, refused_url: str, tmp_path: Path
) -> None:
    """``demo`` on running servers, one of them down, with both streams as pipes: its
    own lines say the server's state; no JSON record and no second word of it on
    stderr."""
    (server,) = fake_servers(1)
    server.handler = _label
    done = _run(
        [
            COMMAND,
            "demo",
            "--servers",
            server.base_url,
            refused_url,
            "--rows",
            "30",
            "--output-dir",
            str(tmp_path / "demo"),
        ]
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert _records(done.stdout) == [] and _records(done.stderr) == [], done.stderr[-2000:]
    assert f"server 2 {refused_url}: 0 rows in the output, state evicted" in done.stdout
    assert "member_down" not in done.stderr


def test_a_log_file_on_a_full_disk_drops_records_once_said_and_never_raises(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A log file that cannot be written (``/dev/full``: no space) never makes a log
    call raise: the first failure is said once on standard error, later records dropped."""
    from llm_annotator.cli._logging import _Outlets

    plan = log_plan(tty=False, human=True, log_format=None, log_file="/dev/full")
    with open("/dev/full", "w", encoding="utf-8") as full:
        outlets = _Outlets(plan, HumanLines(), "llm-annotator run", full)
        for n in range(3):
            outlets.msg({"event": "progress", "done": n, "level": "info"})
    said = capsys.readouterr().err
    assert said.count("the log file cannot be written") == 1, said
