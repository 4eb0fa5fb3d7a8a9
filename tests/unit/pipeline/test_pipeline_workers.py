"""Elastic pipeline workers (``pipeline run --shard claim``, ``--processes N``) against a
fake server: several workers share every step's units, each step's rows once; a worker
SIGKILLed mid-step leaves its units to the others after a lease; what workers refuse."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pyarrow.dataset as ds
import pytest
import structlog
from aiohttp import web

from llm_annotator import VLLMQueueAnnotator
from llm_annotator.cli import main
from llm_annotator.errors import ConfigurationError, JobError
from llm_annotator.pipeline import Pipeline, Step
from llm_annotator.pipeline import run as pipeline_run
from llm_annotator.pipeline.run import _SharedLock, _wait_for_lock
from tests.cli import COMMAND
from tests.unit.conftest import FakeServer, completion, sleep_forever
from tests.unit.helpers import FAST, write_jsonl

FILES, ROWS = 12, 8


def _answering(delay: float) -> Any:
    async def answer(request: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(delay)
        prompt = request["messages"][-1]["content"]
        if prompt.startswith("Label: "):
            number = int(prompt.rsplit("-r", 1)[1])
            return completion("negative" if number % 2 else "positive")
        return completion(f"answer to {prompt}")

    return answer


def _pipeline_file(tmp_path: Path, server: FakeServer) -> Path:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(FILES):
        rows = [{"id": f"f{f}-r{r}", "text": f"f{f}-r{r}"} for r in range(ROWS)]
        write_jsonl(corpus / f"part-{f:02d}.jsonl", rows)
    path = tmp_path / "pipeline.toml"
    path.write_text(
        f'output_dir = "{tmp_path / "run"}"\n'
        f'input = "{corpus}"\n'
        'id_column = "id"\n'
        f'servers = ["{server.base_url}"]\n'
        "batch_size = 4\nmax_concurrent_batches_per_client = 1\n"
        'log_format = "json"\n'
        '[steps.label]\nprompt_template = "Label: {text}"\n'
        '[steps.reason]\nfrom = "label"\nwhere = "label_response == \'negative\'"\n'
        'prompt_template = "Why: {text}"\n'
        '[steps.judge]\nfrom = "reason"\nprompt_template = "Judge: {reason_response}"\n'
    )
    return path


def _sent(server: FakeServer) -> Counter[str]:
    return Counter(r["messages"][-1]["content"] for r in server.requests)


def _step_rows(run: Path, step: str) -> list[str]:
    table = ds.dataset(run / "steps" / step / "annotations", format="parquet").to_table()
    return sorted(str(value) for value in table.column("id").to_pylist())


def _check_steps(run: Path) -> None:
    """Each step's rows once: 96 labels, the 48 negatives' reasons, 48 judgements."""
    labels = _step_rows(run, "label")
    assert len(labels) == len(set(labels)) == FILES * ROWS
    assert len(_step_rows(run, "reason")) == len(set(_step_rows(run, "reason"))) == 48
    assert len(_step_rows(run, "judge")) == 48
    record = orjson.loads((run / "pipeline.json").read_bytes())
    assert {name: entry["state"] for name, entry in record["steps"].items()} == {
        "label": "done",
        "reason": "done",
        "judge": "done",
    }
    assert record["steps"]["label"]["figures"]["rows"] == FILES * ROWS


def test_processes_share_every_step_and_send_each_row_once(
    tmp_path: Path, fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.handler = _answering(0.02)
    path = _pipeline_file(tmp_path, fake_server)
    done = subprocess.run(
        [COMMAND, "pipeline", "run", str(path), "--processes", "2"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    run = tmp_path / "run"
    _check_steps(run)
    sent = _sent(fake_server)
    assert max(sent.values()) == 1, [p for p, n in sent.items() if n > 1][:5]
    assert sum(sent.values()) == FILES * ROWS + 48 + 48
    workers = sorted(p.name for p in (run / "steps" / "label").glob("worker-*"))
    assert len(workers) == 2, workers  # both took units of the first step
    capsys.readouterr()
    assert main(["pipeline", "describe", str(path)]) == 0
    said = capsys.readouterr().out
    assert "done: 96 of 96 rows, 12 of 12 units" in said, said
    assert "done: 48 of 48 rows, 12 of 12 units" in said, said


def test_a_worker_killed_mid_step_leaves_its_units_to_the_others(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Two workers with a 2 s lease; one SIGKILLed once it holds a unit of the first
    step: the other takes its units over and finishes all three steps, every row of
    each step once in the output; a row is sent again only if it was in flight."""
    fake_server.handler = _answering(0.05)
    path = _pipeline_file(tmp_path, fake_server)
    run = tmp_path / "run"
    argv = [COMMAND, "pipeline", "run", str(path), "--shard", "claim", "--claim-lease", "2"]
    logs = [(tmp_path / f"worker-{i}.log").open("wb") for i in range(2)]
    doomed = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logs[0], stderr=logs[0])
    claims = run / "steps" / "label" / "claims"
    deadline = time.monotonic() + 60
    while not any(claims.glob("*")) or len(fake_server.requests) < 8:
        assert doomed.poll() is None, (tmp_path / "worker-0.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the worker never claimed a unit"
        time.sleep(0.05)
    other = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logs[1], stderr=logs[1])
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=10)
    before = _sent(fake_server)  # what the killed worker had sent (answered or not)
    code = other.wait(timeout=120)
    for log in logs:
        log.close()
    assert code == 0, (tmp_path / "worker-1.log").read_text()[-3000:]
    _check_steps(run)
    again = {prompt: n for prompt, n in _sent(fake_server).items() if n > 1}
    # sent again only what the killed worker had in hand (in flight, or answered and
    # not yet written), and only once more
    assert all(before[prompt] == 1 and n == 2 for prompt, n in again.items()), again
    assert sum(before.values()) >= 8


def test_workers_refuse_to_redo_and_never_mix_with_a_run_alone(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "text": "x"}])
    pipeline = Pipeline([Step("label", "{text}", data=str(tmp_path / "d.jsonl"))], tmp_path / "p")
    with pytest.raises(ConfigurationError, match="never redo a step"):
        pipeline.run(object(), shard="claim", force=True, handle_signals=False)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="takes shard='claim'"):
        pipeline.run(object(), shard="0/2", handle_signals=False)  # type: ignore[arg-type]
    (tmp_path / "p").mkdir()
    held = _SharedLock.acquire(tmp_path / "p")  # a worker runs
    try:
        with pytest.raises(JobError, match=r"elastic workers \(--shard claim\) are running it"):
            pipeline.run(object(), handle_signals=False)  # type: ignore[arg-type]
    finally:
        held.release()
    with pytest.raises(SystemExit) as exited:
        main(["pipeline", "run", str(tmp_path / "none.toml"), "--processes", "0"])
    assert exited.value.code == 1


def test_rows_in_memory_are_refused_and_a_stale_plan_never_undoes_a_step_done(
    tmp_path: Path,
) -> None:
    """Workers refuse a step over rows in memory before anything runs. A worker whose
    plan was made before another finished step B plans it again under the lock: B is
    skipped, not begun again, and step C, which reads it, is not marked stale."""
    rows = Pipeline([Step("label", "{text}", data=[{"id": 1, "text": "x"}])], tmp_path / "m")
    with pytest.raises(ConfigurationError, match="reads rows in memory"):
        rows.run(object(), shard="claim", handle_signals=False)  # type: ignore[arg-type]

    write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "text": "x"}])
    pipeline = Pipeline(
        [
            Step("a", "{text}", data=str(tmp_path / "d.jsonl")),
            Step("b", "{text}", from_step="a"),
            Step("c", "{text}", from_step="b"),
        ],
        tmp_path / "p",
    )
    keys, settings = pipeline._keys()
    stale_plans = pipeline.plan()  # before anything ran: b "run", its rows changing
    plan_b = next(p for p in stale_plans if p.name == "b")
    assert plan_b.action == "run" and plan_b.rows_change
    pipeline._check_directory()
    for name, state in (("a", "done"), ("b", "done"), ("c", "begun")):
        pipeline.step_dir(name).mkdir(parents=True)
        (pipeline.step_dir(name) / "annotations.parquet").touch()  # its output is there
        pipeline._save(name, {"key": keys[name], "state": state, "settings": settings[name]})
    step_b = pipeline.steps[1]
    fresh, _, _ = pipeline._begin_step(step_b, plan_b, keys, settings, True)
    assert fresh.action == "skip"
    record = orjson.loads((tmp_path / "p" / "pipeline.json").read_bytes())
    assert {name: entry["state"] for name, entry in record["steps"].items()} == {
        "a": "done",
        "b": "done",
        "c": "begun",
    }


def _steps_over_corpus(tmp_path: Path, *, retry_errors: bool = False) -> list[Step]:
    """The 3-step pipeline over a corpus of FILES files of ROWS rows, as Steps."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for f in range(FILES):
        rows = [{"id": f"f{f}-r{r}", "text": f"f{f}-r{r}"} for r in range(ROWS)]
        write_jsonl(corpus / f"part-{f:02d}.jsonl", rows)
    return [
        Step("label", "Label: {text}", data=str(corpus), id_column="id", retry_errors=retry_errors),
        Step("reason", "Why: {text}", from_step="label", where="label_response == 'negative'"),
        Step("judge", "Judge: {reason_response}", from_step="reason"),
    ]


def _two_workers(steps: list[Step], run: Path, server: FakeServer) -> list[Any]:
    """Two elastic workers in this process, each with a pool of its own."""

    async def worker() -> Any:
        async with VLLMQueueAnnotator(
            [server.base_url], batch_size=4, max_concurrent_batches_per_client=1, **FAST
        ) as pool:
            pipeline = Pipeline(steps, run)
            return await pipeline.arun(pool, shard="claim", claim_lease=5, progress=False)

    async def two() -> list[Any]:
        return list(await asyncio.gather(worker(), worker()))

    return asyncio.run(two())


def test_step_two_runs_while_step_one_still_answers_each_row_of_each_step_once(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Two workers (pools of their own in one process) over a 3-step pipeline, the first
    step's last file slow to answer: the worker that can take no more of the first step
    goes on to the units of the second whose first-step units are done, so reasons are
    asked for before the last label is answered; each step's rows once, every step done,
    and each step's units as many as the first's."""
    answered: dict[str, float] = {}
    asked: dict[str, float] = {}
    slow = "Label: f11-"

    async def answer(request: dict[str, Any]) -> web.StreamResponse:
        prompt = request["messages"][-1]["content"]
        asked.setdefault(prompt, time.monotonic())
        await asyncio.sleep(1.5 if prompt.startswith(slow) else 0.01)
        response: web.StreamResponse = await _answering(0.0)(request)
        answered[prompt] = time.monotonic()
        return response

    fake_server.handler = answer
    run = tmp_path / "run"
    results = _two_workers(_steps_over_corpus(tmp_path), run, fake_server)
    _check_steps(run)
    assert all(r.steps[2].figures["rows"] == 48 for r in results)
    label_done = max(t for p, t in answered.items() if p.startswith("Label: "))
    first_reason = min(t for p, t in asked.items() if p.startswith("Why: "))
    assert first_reason < label_done - 0.5, (first_reason, label_done)
    units = sorted(p.name for p in (run / "inputs" / "reason").iterdir())
    assert len(units) == FILES and all(name.endswith(".jsonl.jsonl") for name in units)
    assert main(["status", str(run / "steps" / "judge")]) == 0
    # one fleet for the steps' one server group, not one a step: a worker in step 1 and
    # one in step 2 share each server's budget between them
    assert (run / "fleet" / "default").is_dir() and not list(run.glob("steps/*/fleet"))


def test_a_filter_on_a_column_no_row_has_stops_the_streamed_step_with_its_name(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """A step that reads the first step unit by unit, with a typo in its filter: the
    worker stops with one line naming the column and the columns there are, and the
    first step is done."""
    fake_server.handler = _answering(0.0)
    path = _pipeline_file(tmp_path, fake_server)
    path.write_text(path.read_text().replace('where = "label_response', 'where = "labl_response'))
    done = subprocess.run(
        [COMMAND, "pipeline", "run", str(path), "--shard", "claim"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        check=False,
    )
    said = done.stderr.decode()
    assert done.returncode != 0
    assert "'labl_response'" in said and "label_response" in said, said[-2000:]
    assert "Traceback" not in said, said[-3000:]
    record = orjson.loads((tmp_path / "run" / "pipeline.json").read_bytes())
    assert record["steps"]["label"]["state"] == "done"


def test_a_streamed_step_is_redone_whole_by_a_run_alone_and_then_skipped_by_workers(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """A worker streams the steps; a run alone with redo=["reason"] redoes reason and
    judge (their unit inputs written again, whole), each row sent once more and written
    once; a worker started afterwards finds every step done and sends nothing."""
    fake_server.handler = _answering(0.0)
    path = _pipeline_file(tmp_path, fake_server)
    run = tmp_path / "run"
    argv = [COMMAND, "pipeline", "run", str(path)]
    for extra in (["--shard", "claim"], ["--redo", "reason"], ["--shard", "claim"]):
        done = subprocess.run(
            [*argv, *extra], stdin=subprocess.DEVNULL, capture_output=True, timeout=120
        )
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        if extra[0] == "--shard" and len(fake_server.requests) == 96 + 48 + 48:
            record = orjson.loads((run / "pipeline.json").read_bytes())
            assert record["steps"]["reason"]["input"]["streamed"] is True
        _check_steps(run)
    sent = _sent(fake_server)
    assert sum(sent.values()) == 96 + 2 * (48 + 48)
    assert {n for p, n in sent.items() if p.startswith("Label: ")} == {1}
    assert {n for p, n in sent.items() if not p.startswith("Label: ")} == {2}
    record = orjson.loads((run / "pipeline.json").read_bytes())
    assert not record["steps"]["reason"]["input"].get("streamed")  # written whole, alone


def test_a_worker_alone_streams_turn_by_turn(
    tmp_path: Path, fake_server: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One worker, turns of 0.3 s: it leaves the first step after a turn (the units it
    holds finished), runs the later steps' units that are ready, and comes back, so
    the second and third steps are asked before the first is done; each row once."""
    monkeypatch.setattr("llm_annotator.pipeline.run.TURN_SECONDS", 0.3)
    asked: dict[str, float] = {}

    async def answer(request: dict[str, Any]) -> web.StreamResponse:
        asked.setdefault(request["messages"][-1]["content"], time.monotonic())
        response: web.StreamResponse = await _answering(0.03)(request)
        return response

    fake_server.handler = answer
    path = _pipeline_file(tmp_path, fake_server)
    path.write_text(path.read_text().replace("batch_size = 4", "batch_size = 2"))
    assert main(["pipeline", "run", str(path), "--shard", "claim"]) == 0
    _check_steps(tmp_path / "run")
    last_label = max(t for p, t in asked.items() if p.startswith("Label: "))
    for step in ("Why: ", "Judge: "):
        assert min(t for p, t in asked.items() if p.startswith(step)) < last_label, step
    assert max(Counter(r["messages"][-1]["content"] for r in fake_server.requests).values()) == 1


def test_a_step_reading_a_step_that_retries_errors_waits_for_it_to_be_done(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """The first step retries its error rows, so the second cannot read its units as
    they finish: two workers, the first step's last file slow; the worker that can take
    no more of the first step does not begin the second (its rows written whole, once
    the first is done): every negative label is reasoned about, each once."""
    slow = "Label: f11-"

    async def answer(request: dict[str, Any]) -> web.StreamResponse:
        prompt = request["messages"][-1]["content"]
        await asyncio.sleep(1.0 if prompt.startswith(slow) else 0.01)
        response: web.StreamResponse = await _answering(0.0)(request)
        return response

    fake_server.handler = answer
    _two_workers(_steps_over_corpus(tmp_path, retry_errors=True), tmp_path / "run", fake_server)
    _check_steps(tmp_path / "run")
    record = orjson.loads((tmp_path / "run" / "pipeline.json").read_bytes())
    assert not record["steps"]["reason"]["input"].get("streamed")
    assert record["steps"]["reason"]["input"]["rows"] == 48
    assert max(_sent(fake_server).values()) == 1


def _logged(path: Path, event: str, unit_suffix: str | None) -> bool:
    """Whether a worker's JSON log says ``event`` (of a unit ending so, if given)."""
    for line in path.read_bytes().splitlines():
        try:
            said = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(said, dict) or said.get("event") != event:
            continue
        if unit_suffix is None or str(said.get("unit", "")).endswith(unit_suffix):
            return True
    return False


@pytest.mark.parametrize(
    ("event", "unit_suffix"),
    [
        ("step_unit_input_written", None),  # a unit's rows of step 2 just written
        ("unit_finished", ".jsonl.jsonl"),  # a unit of step 2 just finished
        ("unit_claimed", ".jsonl.jsonl.jsonl"),  # a unit of step 3 just claimed
        ("step_finished", None),  # a step just recorded done
    ],
)
def test_a_worker_killed_at_each_phase_of_the_stream_leaves_each_step_exact(
    tmp_path: Path, fake_server: FakeServer, event: str, unit_suffix: str | None
) -> None:
    """A worker alone is SIGKILLed as soon as its log says it reached a phase of the
    streamed steps; a second worker started then finishes the pipeline: every step
    done, each step's rows once, and a row sent again only if the killed worker had
    sent it (in flight, or answered and not yet written), once more."""
    fake_server.handler = _answering(0.01)
    path = _pipeline_file(tmp_path, fake_server)
    run = tmp_path / "run"
    argv = [COMMAND, "pipeline", "run", str(path), "--shard", "claim", "--claim-lease", "2"]
    logs = [tmp_path / f"worker-{i}.log" for i in range(2)]
    with logs[0].open("wb") as out:
        doomed = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    deadline = time.monotonic() + 60
    while not _logged(logs[0], event, unit_suffix):
        assert doomed.poll() is None, logs[0].read_text()[-3000:]
        assert time.monotonic() < deadline, f"the worker never logged {event}"
        time.sleep(0.01)
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=10)
    before = _sent(fake_server)
    with logs[1].open("wb") as out:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=120, check=False
        )
    assert done.returncode == 0, logs[1].read_text()[-3000:]
    _check_steps(run)
    again = {prompt: n for prompt, n in _sent(fake_server).items() if n > 1}
    assert all(before[prompt] == 1 and n == 2 for prompt, n in again.items()), again


def test_a_worker_stopped_by_sigterm_between_turns_ends_as_a_stopped_job_does(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """A worker that finds nothing to take (the one unit of the first step is held by
    another worker, whose requests hang; the later steps wait for it) pauses between
    passes. SIGTERM there (as ``scancel`` or a pod's deletion sends it) ends it as a
    stopped job ends: status 128 + 15, one line that says what stopped it and that
    everything done is kept, no traceback. It used to die on the spot, saying nothing."""
    fake_server.handler = sleep_forever
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "part-00.jsonl", [{"id": f"r{r}", "text": f"r{r}"} for r in range(4)])
    path = tmp_path / "pipeline.toml"
    path.write_text(
        f'output_dir = "{tmp_path / "run"}"\ninput = "{corpus}"\nid_column = "id"\n'
        f'servers = ["{fake_server.base_url}"]\nlog_format = "json"\n'
        '[steps.label]\nprompt_template = "Label: {text}"\n'
        '[steps.judge]\nfrom = "label"\nprompt_template = "Judge: {label_response}"\n'
    )
    argv = [COMMAND, "pipeline", "run", str(path), "--shard", "claim"]
    logs = [tmp_path / name for name in ("holder.log", "waiting.log")]
    with logs[0].open("wb") as out:
        holder = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    waiting = None
    try:
        deadline = time.monotonic() + 60
        while not fake_server.requests:
            assert holder.poll() is None and time.monotonic() < deadline, logs[0].read_text()
            time.sleep(0.05)
        with logs[1].open("wb") as out:
            waiting = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        # Its pauses are 0.25 s, 0.5 s, then 1 s: signalled as the third begins.
        while logs[1].read_text().count('"worker_paused"') < 3:
            assert waiting.poll() is None and time.monotonic() < deadline, logs[1].read_text()
            time.sleep(0.01)
        waiting.send_signal(signal.SIGTERM)
        code = waiting.wait(timeout=30)
    finally:
        for process in (holder, waiting):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    said = logs[1].read_text()
    assert code == 128 + signal.SIGTERM, said[-3000:]
    assert "Traceback" not in said
    assert "stopped by SIGTERM between two jobs; everything done is kept" in said, said[-3000:]


def test_a_worker_waiting_for_the_steps_lock_says_who_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A holder stopped with the lock (SIGSTOP, a frozen node) stalls the others: one
    that waits says, after a while, which host and pid hold it; it takes the lock as
    soon as the holder lets go."""
    monkeypatch.setattr(pipeline_run, "LOCK_WAIT_SAID", 0.2)
    path = tmp_path / ".steps.lock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.write(holder, b"node7 pid 4242\n")
    waiter = os.open(path, os.O_RDWR)
    try:
        with structlog.testing.capture_logs() as logs:
            waiting = threading.Thread(target=_wait_for_lock, args=(waiter, path), daemon=True)
            waiting.start()
            time.sleep(0.6)
            assert waiting.is_alive()
            os.close(holder)
            waiting.join(timeout=10)
            assert not waiting.is_alive()
    finally:
        os.close(waiter)
    said = [entry for entry in logs if entry["event"] == "steps_lock_waiting"]
    assert said and said[0]["holder"] == "node7 pid 4242" and said[0]["seconds"] >= 0.2
