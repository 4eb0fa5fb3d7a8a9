"""``llm-annotator run``: settings from flags and TOML, and signals, against fake servers.

The command runs as a real subprocess (the installed console script) talking to the
in-process fake servers over loopback, so its signals are real signals.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from llm_annotator.cli import main
from llm_annotator.errors import ConfigurationError
from tests.cli import COMMAND
from tests.unit.conftest import FakeServer, echo, sleep_forever
from tests.unit.helpers import command, delayed_echo, settings, write_rows


def test_flags_override_the_job_file(tmp_path: Path) -> None:
    """Every setting can come from the TOML file; a flag given wins over it."""
    job = tmp_path / "job.toml"
    job.write_text(
        'servers = ["http://127.0.0.1:1/v1"]\ninput = "a.jsonl"\n'
        'prompt_template = "Label: {text}"\noutput_dir = "out"\n'
        "max_completion_tokens = 8\ntemperature = 0.5\nretry_errors = true\n",
        encoding="utf-8",
    )
    merged = settings("--config", str(job), "--temperature", "0.0", "--output-dir", "other")
    assert merged["servers"] == ["http://127.0.0.1:1/v1"]
    assert merged["max_completion_tokens"] == 8
    assert merged["temperature"] == 0.0
    assert merged["output_dir"] == "other"
    assert merged["retry_errors"] is True
    assert merged["hedge_tail"] is True
    assert settings("--config", str(job), "--no-retry-errors")["retry_errors"] is False


@pytest.mark.parametrize(
    ("content", "argv", "message"),
    [
        ('inptu = "x"\n', (), "unknown setting 'inptu'"),
        ("batch_size = 'big'\n", (), "batch_size"),
        ("servers = [\n", (), "cannot read the job file"),
        ("", ("--input", "a.jsonl", "--output-dir", "o"), "--prompt-template"),
        (
            "",
            ("--input", "a", "--output-dir", "o", "--prompt-template", "{t}"),
            "give the servers",
        ),
    ],
)
def test_bad_settings_name_the_setting(
    tmp_path: Path, content: str, argv: tuple[str, ...], message: str
) -> None:
    """A bad job file or missing setting is refused, naming what to fix."""
    job = tmp_path / "job.toml"
    job.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigurationError, match=message):
        settings("--config", str(job), *argv)


def test_a_missing_setting_exits_1_with_the_message(capsys: pytest.CaptureFixture[str]) -> None:
    """The command prints the error and exits 1 instead of a traceback."""
    assert main(["run", "--input", "a.jsonl"]) == 1
    assert "--prompt-template" in capsys.readouterr().err


def complete_lines(out: Path) -> list[dict[str, Any]]:
    """Every record in the shards; fails if any line is not whole JSON."""
    records = []
    for shard in (out / "shards").glob("*.jsonl"):
        data = shard.read_bytes()
        assert not data or data.endswith(b"\n"), shard
        records += [orjson.loads(line) for line in data.splitlines()]
    return records


def wait_for_requests(server: FakeServer, count: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while len(server.requests) < count:
        assert process.poll() is None, process.stderr.read() if process.stderr else ""
        assert time.monotonic() < deadline, "the command sent too few requests"
        time.sleep(0.02)


def test_a_second_signal_stops_at_once(fake_server: FakeServer, tmp_path: Path) -> None:
    """SIGINT while requests hang: the first starts the grace (60 s here), the second
    stops the command at once with 128+SIGINT; what was written is whole."""
    answered = 0

    async def first_ten_then_hang(request: dict[str, Any]) -> web.StreamResponse:
        nonlocal answered
        answered += 1
        if answered <= 10:
            return await echo(request)
        return await sleep_forever(request)

    fake_server.handler = first_ten_then_hang
    data = write_rows(tmp_path / "data.jsonl", 200)
    out = tmp_path / "run"
    process = subprocess.Popen(
        command(fake_server, data, out, "--stop-grace", "60"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for_requests(fake_server, 20, process)
    time.sleep(1.0)  # the first answers are written (flushed every 0.5 s)
    process.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert process.poll() is None  # in the grace, waiting for requests that hang
    process.send_signal(signal.SIGINT)
    started = time.monotonic()
    _, err = process.communicate(timeout=30)
    assert time.monotonic() - started < 10
    assert process.returncode == 128 + signal.SIGINT, err.decode()[-2000:]
    records = complete_lines(out)
    assert len({r["id"] for r in records}) == len(records) == 10
    assert b"Run the same job again to resume" in err


def test_sigterm_past_the_grace_stops_and_resume_finishes(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """SIGTERM with requests that outlast the grace: the command exits 128+SIGTERM
    after about the grace; a second run sends only what is missing and completes."""
    fake_server.handler = delayed_echo(3.0)
    data = write_rows(tmp_path / "data.jsonl", 40)
    out = tmp_path / "run"
    process = subprocess.Popen(
        command(fake_server, data, out, "--stop-grace", "1"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for_requests(fake_server, 8, process)
    process.send_signal(signal.SIGTERM)
    started = time.monotonic()
    _, err = process.communicate(timeout=30)
    assert time.monotonic() - started < 8
    assert process.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    written = {r["id"] for r in complete_lines(out)}
    fake_server.requests.clear()
    fake_server.handler = echo
    done = subprocess.run(
        command(fake_server, data, out),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert len(fake_server.requests) == 40 - len(written)
    table = pq.read_table(out / "annotations.parquet")
    assert table.column("id").to_pylist() == list(range(40))


def test_no_server_at_all_exits_3_with_how_to_resume(refused_url: str, tmp_path: Path) -> None:
    """With every server down past --all-down-timeout, the command says so, names the
    server, and exits 3 (nothing is lost: the same command resumes)."""
    data = write_rows(tmp_path / "data.jsonl", 5)
    done = subprocess.run(
        [
            COMMAND,
            "run",
            "--servers",
            refused_url,
            "--input",
            str(data),
            "--prompt-template",
            "Label: {text}",
            "--output-dir",
            str(tmp_path / "run"),
            "--all-down-timeout",
            "1",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3, done.stderr[-2000:]
    assert refused_url in done.stderr
    assert "run the same command again to resume" in done.stderr


def test_prefix_affinity_and_group_by_run_the_job_and_a_wrong_column_is_one_line(
    fake_servers: Any, tmp_path: Path
) -> None:
    """``--prefix-affinity --group-by doc`` over two servers: every row once, each
    document's rows on one server when they arrive together; a ``--group-by`` column
    the input lacks stops before any request, in one line."""
    servers = fake_servers(2)
    data = tmp_path / "docs.jsonl"
    data.write_bytes(
        b"".join(orjson.dumps({"text": f"t{i}", "doc": i // 4}) + b"\n" for i in range(80))
    )
    out = tmp_path / "run"
    argv = [
        *command(servers[0], data, out, "--prefix-affinity", "--group-by", "doc"),
        "--servers",
        servers[0].base_url,
        servers[1].base_url,
    ]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    table = pq.read_table(out / "annotations.parquet").to_pylist()
    assert sorted(r["text"] for r in table) == sorted(f"t{i}" for i in range(80))
    servers_of: dict[int, set[str]] = {}
    for record in table:
        servers_of.setdefault(record["doc"], set()).add(record["server"])
    assert sum(len(s) == 1 for s in servers_of.values()) >= 15, servers_of
    sent = len(servers[0].requests)
    bad = command(servers[0], data, tmp_path / "bad", "--prefix-affinity", "--group-by", "dok")
    refused = subprocess.run(bad, stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    assert refused.returncode == 1
    err = refused.stderr.decode()
    assert "group_by column 'dok' is not in the input" in err and "Traceback" not in err
    assert len(servers[0].requests) == sent  # refused before any request
