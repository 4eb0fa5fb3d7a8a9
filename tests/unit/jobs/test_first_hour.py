"""What a researcher does in the first hour: a trial run on a sample, their own answer
check, retrying only some error types, and looking at a run from another terminal."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from llm_annotator import ConfigurationError, FingerprintMismatchError, VLLMOnlineRuntimeOptions
from llm_annotator.cli import main
from llm_annotator.jobs.rows.sample import Sample
from llm_annotator.jobs.rundir.store import ResultStore
from llm_annotator.jobs.watch.status import run_status
from tests.cli import COMMAND
from tests.unit.conftest import FakeServer, completion, echo, error
from tests.unit.helpers import (
    TEMPLATE,
    command,
    delayed_echo,
    pool_of,
    read_output,
    rows,
    sent_texts,
    write_rows,
)

# -- a trial run on a sample ------------------------------------------------------------


def test_limit_takes_the_first_rows_and_a_full_run_needs_force(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A trial on 5 of 20 rows writes 5 rows and records the sample; the full run in the
    same directory is refused with a message about the trial, and with force it keeps
    the 5 rows and sends only the other 15."""
    out = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        trial = pool.annotate(rows(20), TEMPLATE, out, progress=False, limit=5)
        assert [r["id"] for r in read_output(trial.output_path)] == [0, 1, 2, 3, 4]
        assert trial.num_sent == 5
        job = orjson.loads((out / "job.json").read_bytes())
        assert job["fingerprint"]["sample"] == {"limit": 5, "shuffle_seed": None}
        with pytest.raises(FingerprintMismatchError) as refused:
            pool.annotate(rows(20), TEMPLATE, out, progress=False)
        assert "trial run" in str(refused.value) and "force" in str(refused.value)
        fake_server.requests.clear()
        full = pool.annotate(rows(20), TEMPLATE, out, progress=False, force=True)
    assert (full.num_resumed, full.num_sent, full.num_rows) == (5, 15, 20)
    assert set(sent_texts([fake_server])) == {f"Label: t{i}" for i in range(5, 20)}


def test_the_same_trial_again_resumes_and_a_larger_one_is_refused(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Running the same trial twice resumes it (nothing sent); another limit is another
    job."""
    out = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        pool.annotate(rows(20), TEMPLATE, out, progress=False, limit=5, shuffle_seed=1)
        again = pool.annotate(rows(20), TEMPLATE, out, progress=False, limit=5, shuffle_seed=1)
        assert (again.num_sent, again.num_rows) == (0, 5)
        with pytest.raises(FingerprintMismatchError):
            pool.annotate(rows(20), TEMPLATE, out, progress=False, limit=10, shuffle_seed=1)


def test_shuffle_seed_draws_the_same_rows_from_the_whole_input(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """With a seed the sample is spread over the input, the same for the same seed,
    another for another seed; a limit above the input takes every row."""
    with pool_of([fake_server]) as pool:
        ids = []
        for n, seed in enumerate((7, 7, 8)):
            result = pool.annotate(
                rows(200), TEMPLATE, tmp_path / f"r{n}", progress=False, limit=10, shuffle_seed=seed
            )
            ids.append([r["id"] for r in read_output(result.output_path)])
        everything = pool.annotate(rows(6), TEMPLATE, tmp_path / "all", progress=False, limit=50)
    assert ids[0] == ids[1] and ids[0] != ids[2]
    job = orjson.loads((tmp_path / "r0" / "job.json").read_bytes())
    assert job["fingerprint"]["sample"] == {"limit": 10, "shuffle_seed": 7, "input_rows": 200}
    assert len(set(ids[0])) == 10 and max(ids[0]) >= 50  # not just the first rows
    assert everything.num_rows == 6


def test_a_seeded_trial_on_an_input_that_grew_is_another_job(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """The rows a seed draws depend on the input's size: resuming a seeded trial on an
    input that grew is refused, not silently drawn anew; a trial in a directory that
    holds a full run gets the plain hint."""
    out = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        pool.annotate(rows(50), TEMPLATE, out, progress=False, limit=5, shuffle_seed=2)
        with pytest.raises(FingerprintMismatchError, match="input_rows: 50 -> 60"):
            pool.annotate(rows(60), TEMPLATE, out, progress=False, limit=5, shuffle_seed=2)
        pool.annotate(rows(4), TEMPLATE, tmp_path / "full", progress=False)
        with pytest.raises(FingerprintMismatchError) as refused:
            pool.annotate(rows(4), TEMPLATE, tmp_path / "full", progress=False, limit=2)
    assert "trial run" not in str(refused.value) and "resume anyway" in str(refused.value)


def test_selection_sampling_is_exact_and_uniform() -> None:
    """Exactly ``limit`` positions every time, and each position about equally often."""
    counts: Counter[int] = Counter()
    for seed in range(2000):
        chosen = Sample(5, shuffle_seed=seed).positions(20)
        assert len(chosen) == 5 and chosen == sorted(set(chosen))
        counts.update(chosen)
    # 2000 draws of 5 of 20: each position 500 times expected (sd about 19).
    assert all(400 < counts[p] < 600 for p in range(20)), counts


@pytest.mark.parametrize(
    ("limit", "seed", "message"),
    [
        (0, None, "limit must be a positive number"),
        (True, None, "limit must be a positive number"),
        (None, 3, "give limit too"),
        (5, "x", "shuffle_seed must be an int"),
    ],
)
def test_bad_samples_are_refused_by_name(
    fake_server: FakeServer, tmp_path: Path, limit: Any, seed: Any, message: str
) -> None:
    with pool_of([fake_server]) as pool, pytest.raises(ConfigurationError, match=message):
        pool.annotate(rows(3), TEMPLATE, tmp_path / "run", limit=limit, shuffle_seed=seed)
    assert not fake_server.requests


# -- your own answer check --------------------------------------------------------------


def parse_label(text: str) -> dict[str, Any]:
    """A user's check: 'label: X (0.9)' -> columns, anything else refused."""
    head, _, rest = text.partition(":")
    if head != "label":
        raise ValueError(f"not a label: {text!r}")
    word, _, score = rest.strip().partition(" ")
    return {"label": word, "score": float(score.strip("()"))}


def test_validate_turns_answers_into_columns(fake_server: FakeServer, tmp_path: Path) -> None:
    """A dict the check returns becomes columns; the check's name is in the
    fingerprint. A key that is also an input column kept in the output is refused (the
    input column would move between rows), and so is a column every row has."""

    async def labels(request: dict[str, Any]) -> web.StreamResponse:
        return completion("label: pos (0.9)")

    fake_server.handler = labels
    out = tmp_path / "run"
    data = [{"text": f"t{i}", "gold": "neg"} for i in range(6)]
    with pool_of([fake_server]) as pool:
        result = pool.annotate(data, TEMPLATE, out, progress=False, validate=parse_label)
        table = read_output(result.output_path)
        assert [(r["label"], r["score"], r["valid"], r["gold"]) for r in table] == [
            ("pos", 0.9, True, "neg")
        ] * 6
        job = orjson.loads((out / "job.json").read_bytes())
        assert job["fingerprint"]["validate"] == "tests.unit.jobs.test_first_hour:parse_label"
        clash = [{"text": "t0", "label": "gold"}]
        with pytest.raises(ConfigurationError, match="'label', which is also an input column"):
            pool.annotate(clash, TEMPLATE, tmp_path / "clash", validate=parse_label)
        kept = pool.annotate(
            clash, TEMPLATE, tmp_path / "kept", validate=parse_label, columns=["text"]
        )
        assert read_output(kept.output_path)[0]["label"] == "pos"
        with pytest.raises(ConfigurationError, match="'error', which is a column every row"):
            pool.annotate(rows(3), TEMPLATE, tmp_path / "r", validate=lambda t: {"error": 1})


def test_a_value_that_is_not_json_stops_the_job_naming_the_row(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    with pool_of([fake_server]) as pool, pytest.raises(ConfigurationError, match="row 0"):
        pool.annotate(rows(1), TEMPLATE, tmp_path / "run", validate=lambda t: {"s": {1, 2}})


def test_a_check_that_refuses_everything_alike_is_taken_for_a_bug(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A check that raises NameError on every answer is not a model giving bad answers:
    after 20 such refusals and none accepted the job stops and says so."""

    def broken(text: str) -> Any:
        return undefined_name  # type: ignore[name-defined]  # noqa: F821

    out = tmp_path / "run"
    with pool_of([fake_server]) as pool, pytest.raises(ConfigurationError, match="bug in the"):
        pool.annotate(rows(100), TEMPLATE, out, progress=False, validate=broken)
    # Stopped early: not 300 requests (each of 100 rows 3 times) and no row written.
    assert len(fake_server.requests) < 300 and run_status(out).done == 0
    assert run_status(out).state == "failed"
    assert "NameError" in (run_status(out).error or "")


def test_a_refused_answer_is_generated_again_then_kept_as_an_error_row(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Rows whose answer the check refuses are sent again, at most max_regenerations
    times; one that gets a good answer on the way is a normal row, one that never does is
    an invalid_output error row that says why, with the last raw answer kept."""
    asked: Counter[str] = Counter()

    async def flaky(request: dict[str, Any]) -> web.StreamResponse:
        prompt = request["messages"][-1]["content"]
        asked[prompt] += 1
        if prompt == "Label: t1" and asked[prompt] == 2:  # good on its second try
            return completion("label: neg (0.2)")
        if prompt in ("Label: t1", "Label: t2"):
            return completion("no idea")
        return completion("label: pos (0.8)")

    fake_server.handler = flaky
    with pool_of([fake_server]) as pool:
        result = pool.annotate(
            rows(4),
            TEMPLATE,
            tmp_path / "run",
            progress=False,
            validate=parse_label,
            max_regenerations=2,
        )
    table = {r["id"]: r for r in read_output(result.output_path)}
    assert asked["Label: t0"] == 1 and asked["Label: t1"] == 2 and asked["Label: t2"] == 3
    assert table[1]["label"] == "neg" and table[1]["valid"]
    bad = table[2]
    assert bad["error_type"] == "invalid_output" and bad["valid"] is False
    assert "validate refused the answer: ValueError: not a label" in bad["error"]
    assert bad["response"] == "no idea"
    assert result.num_failed == 1


def test_validate_runs_after_the_schema_and_a_plain_value_is_one_column(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """With an output schema, the check sees only answers that follow it; what it
    returns that is not a dict is the column 'validated'."""

    async def answers(request: dict[str, Any]) -> web.StreamResponse:
        return completion('{"label": "positive"}')

    fake_server.handler = answers
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    options = VLLMOnlineRuntimeOptions(output_schema=schema)
    with pool_of([fake_server]) as pool:
        result = pool.annotate(
            rows(3),
            TEMPLATE,
            tmp_path / "run",
            progress=False,
            options=options,
            validate=lambda text: len(text),
        )
    table = read_output(result.output_path)
    assert [(r["label"], r["validated"], r["valid"]) for r in table] == [("positive", 21, True)] * 3


# -- retrying some error types ----------------------------------------------------------


def test_retry_errors_of_named_types_sends_only_those(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A first run ends with two kinds of error rows; retrying one type sends only the
    rows of that type again, and the others stay error rows."""

    async def first(request: dict[str, Any]) -> web.StreamResponse:
        n = int(request["messages"][-1]["content"].split("t")[-1])
        if n in (1, 2):
            return error(400, "prompt too long")  # bad_request
        if n == 3:
            return completion("nonsense")  # invalid_output with the schema below
        return completion('{"label": "x"}')

    fake_server.handler = first
    schema = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}
    options = VLLMOnlineRuntimeOptions(output_schema=schema, seed=1)  # seeded: no regeneration
    out = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        before = pool.annotate(rows(6), TEMPLATE, out, progress=False, options=options)
        assert before.num_failed == 3
        fake_server.requests.clear()

        async def now_fine(request: dict[str, Any]) -> web.StreamResponse:
            return completion('{"label": "y"}')

        fake_server.handler = now_fine
        after = pool.annotate(
            rows(6),
            TEMPLATE,
            out,
            progress=False,
            options=options,
            retry_errors=["bad_request"],
        )
    assert set(sent_texts([fake_server])) == {"Label: t1", "Label: t2"}
    table = {r["id"]: r for r in read_output(after.output_path)}
    assert table[1]["label"] == "y" and table[2]["label"] == "y"
    assert table[3]["error_type"] == "invalid_output"
    assert (after.num_failed, after.num_sent) == (1, 2)


def test_retry_errors_with_an_unknown_type_lists_the_types(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    with pool_of([fake_server]) as pool, pytest.raises(ConfigurationError, match="read_timeout"):
        pool.annotate(rows(3), TEMPLATE, tmp_path / "run", retry_errors=["timeout"])


def test_the_store_decides_by_the_latest_error_of_an_id(tmp_path: Path) -> None:
    """An id whose first error was of a retried type and whose latest is not stays done;
    one whose latest error is of a retried type is sent again."""
    out = tmp_path / "run"
    with ResultStore.open(out, {"m": 1}) as store:
        store.append({"id": 1, "error": "x", "error_type": "read_timeout"})
        store.append({"id": 2, "error": "x", "error_type": "bad_request"})
    with ResultStore.open(out, {"m": 1}, retry_errors=True) as store:
        store.append({"id": 1, "error": "x", "error_type": "bad_request"})
        store.append({"id": 2, "error": "x", "error_type": "read_timeout"})
    with ResultStore.open(out, {"m": 1}, retry_errors=frozenset({"read_timeout"})) as store:
        assert store.is_done(1) and not store.is_done(2)
        assert store.num_done == 1


# -- the CLI ------------------------------------------------------------------------------


CHECK = """
def label(text):
    if not text.startswith("Label: "):
        raise ValueError("no label")
    return {"word": text.removeprefix("Label: ")}
"""


def test_cli_takes_limit_shuffle_seed_validate_and_retry_error_types(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    data = write_rows(tmp_path / "data.jsonl", 30)
    check = tmp_path / "checks.py"
    check.write_text(CHECK)
    out = tmp_path / "run"
    base = command(fake_server, data, out)
    done = subprocess.run(
        [*base, "--limit", "4", "--shuffle-seed", "5", "--validate", f"{check}:label"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    table = read_output(out / "annotations.parquet")
    assert len(table) == 4 and all(r["word"] == f"t{r['id']}" for r in table)
    again = subprocess.run(
        [
            *base,
            "--limit",
            "4",
            "--shuffle-seed",
            "5",
            "--validate",
            f"{check}:label",
            "--retry-errors",
            "bad_request",
            "server_error",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert again.returncode == 0, again.stderr
    assert "this run sent 0" in again.stdout
    # module:function, found from the working directory as python -m would
    from_cwd = subprocess.run(
        [
            *command(fake_server, data, tmp_path / "cwd"),
            "--limit",
            "2",
            "--validate",
            "checks:label",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
        check=False,
        cwd=tmp_path,
    )
    assert from_cwd.returncode == 0, from_cwd.stderr
    assert read_output(tmp_path / "cwd" / "annotations.parquet")[0]["word"] == "t0"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--validate", "no_such_module_here:fn"], "cannot import no_such_module_here"),
        (["--validate", "json"], "expected MODULE:FUNCTION"),
        (["--validate", "json:no_such_name"], "json has no 'no_such_name'"),
        (["--retry-errors", "timeout"], "unknown error type 'timeout'"),
        (["--limit", "0"], "expected an integer >= 1"),
    ],
)
def test_cli_refuses_bad_first_hour_flags_in_one_line(
    fake_server: FakeServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    data = write_rows(tmp_path / "data.jsonl", 3)
    argv = command(fake_server, data, tmp_path / "run")[1:]
    code: int | str | None
    try:
        code = main([*argv, *extra])
    except SystemExit as exit_:  # argparse's own refusal
        code = exit_.code
    assert code == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not fake_server.requests


def test_bare_retry_errors_means_every_type(tmp_path: Path) -> None:
    from tests.unit.helpers import settings

    base = [
        "--servers",
        "http://h:1/v1",
        "--input",
        "d.jsonl",
        "--prompt-template",
        "{t}",
        "--output-dir",
        "o",
    ]
    assert settings(*base, "--retry-errors")["retry_errors"] is True
    job = tmp_path / "job.toml"
    job.write_text("retry_errors = []\n")
    assert settings(*base, "--config", str(job))["retry_errors"] == []  # none, not all
    assert settings(*base, "--no-retry-errors")["retry_errors"] is False
    assert settings(*base, "--retry-errors", "oversized")["retry_errors"] == ["oversized"]
    assert settings(*base)["retry_errors"] is False


# -- status from another terminal -------------------------------------------------------


def status_json(out: Path) -> dict[str, Any]:
    done = subprocess.run(
        [COMMAND, "status", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def test_status_of_a_running_then_finished_job(fake_server: FakeServer, tmp_path: Path) -> None:
    """``status --json`` while ``run`` works: running, its pid, the total, rows done so
    far; afterwards finished, with counts equal to the output's."""

    async def slow_some_fail(request: dict[str, Any]) -> web.StreamResponse:
        n = int(request["messages"][-1]["content"].split("t")[-1])
        if n % 10 == 0:
            return error(400, "too long")
        answer: web.StreamResponse = await delayed_echo(0.25)(request)
        return answer

    fake_server.handler = slow_some_fail
    data = write_rows(tmp_path / "data.jsonl", 400)
    out = tmp_path / "run"
    log = tmp_path / "run.log"
    seen: dict[str, Any] = {}
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command(fake_server, data, out),
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=sink,
        )
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline and process.poll() is None:
                if (out / "job.json").exists():
                    seen = status_json(out)
                    if seen["state"] == "running" and seen["done"] > 0 and seen["total"]:
                        break
                time.sleep(0.2)
        finally:
            returncode = process.wait(timeout=120)
    assert returncode == 0, log.read_text()
    assert seen.get("state") == "running", seen
    assert seen["pid"] == process.pid and seen["total"] == 400
    assert 0 < seen["done"] < 400
    final = status_json(out)
    table = read_output(out / "annotations.parquet")
    assert final["state"] == "finished" and final["done"] == 400 == len(table)
    assert final["failed"] == 40 and final["by_error_type"] == {"bad_request": 40}
    assert final["per_server"] == {fake_server.base_url: 400}
    assert final["rows_per_second"] is None  # a rate is shown only while it runs
    shown = subprocess.run(
        [COMMAND, "status", str(out)], capture_output=True, text=True, timeout=60, check=False
    )
    assert "finished" in shown.stdout and "400 of 400 done" in shown.stdout
    assert "bad_request 40" in shown.stdout


def test_status_of_a_job_on_another_host_trusts_a_fresh_status_file(tmp_path: Path) -> None:
    """A job on a compute node holds its lock there, out of this host's sight: its
    status.json says running, believed while fresh; once stale, the run is stopped."""
    from datetime import UTC, datetime, timedelta

    out = tmp_path / "run"
    with ResultStore.open(out, {"m": 1}) as store:
        store.append({"id": 1, "response": "a", "error": None, "server": "http://s/v1"})

    def said(age: float) -> None:
        when = (datetime.now(UTC) - timedelta(seconds=age)).isoformat(timespec="seconds")
        body = {
            "state": "running",
            "pid": 4242,
            "host": "node-elsewhere",
            "updated": when,
            "total": 10,
            "rows_per_second": 2.5,
            "eta_seconds": 3.6,
        }
        (out / "status.json").write_bytes(orjson.dumps(body))

    said(1)
    fresh = run_status(out)
    assert (fresh.state, fresh.pid, fresh.host, fresh.total) == (
        "running",
        4242,
        "node-elsewhere",
        10,
    )
    assert fresh.rows_per_second == 2.5 and fresh.done == 1
    said(600)
    assert run_status(out).state == "stopped"


def test_status_of_a_directory_that_holds_no_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", str(tmp_path)]) == 1
    assert "holds no annotation job" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "nowhere")]) == 1
    assert "no such directory" in capsys.readouterr().err


def test_status_says_stopped_when_nothing_holds_the_directory(tmp_path: Path) -> None:
    """A store held in this process reads as running with this pid; once closed, with
    no word from a job about how it ended, stopped (a job killed outright looks so)."""
    import os

    out = tmp_path / "run"
    store = ResultStore.open(out, {"m": 1})
    store.append({"id": 1, "response": "a", "error": None, "server": "http://s/v1"})
    store.flush()
    held = run_status(out)
    assert (held.state, held.pid, held.done, held.per_server) == (
        "running",
        os.getpid(),
        1,
        {"http://s/v1": 1},
    )
    store.close()
    assert run_status(out).state == "stopped"


def test_status_of_an_echo_run_with_a_trial(fake_server: FakeServer, tmp_path: Path) -> None:
    fake_server.handler = echo
    with pool_of([fake_server]) as pool:
        pool.annotate(rows(9), TEMPLATE, tmp_path / "run", progress=False, limit=3)
    status = run_status(tmp_path / "run")
    assert (status.state, status.total, status.done) == ("finished", 3, 3)
    assert status.sample == {"limit": 3, "shuffle_seed": None}
