"""A pipeline over a fake server: steps in order, skipped when done, redone only when
forced, generated rows, ``n`` answers and hooks, each row once."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from llm_annotator import VLLMQueueAnnotator
from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs import run_status
from llm_annotator.jobs.rundir.store import DirectoryLock
from llm_annotator.pipeline import Pipeline, Step
from tests.unit.conftest import FakeServer, completion
from tests.unit.helpers import FAST, write_jsonl


async def _answers(request: dict[str, Any]) -> web.StreamResponse:
    """'negative' for reviews whose number is odd; a reason; a verdict; a question."""
    prompt = request["messages"][-1]["content"]
    if prompt.startswith("Label: "):
        number = int(prompt.rsplit(" ", 1)[1])
        return completion("negative" if number % 2 else "positive")
    if prompt.startswith("Why: "):
        return completion(f"because {prompt.rsplit(' ', 1)[1]}")
    if prompt.startswith("Judge: "):
        return completion("yes")
    return completion(f"answer to {prompt}")


def _reviews(path: Path, count: int = 10) -> Path:
    return write_jsonl(path, [{"id": f"r{i}", "text": f"review {i}"} for i in range(count)])


def _steps(data: Path, reason: str = "Why: {text}") -> list[Step]:
    return [
        Step("label", "Label: {text}", data=str(data), id_column="id"),
        Step("reason", reason, from_step="label", where="label_response == 'negative'"),
        Step("judge", "Judge: {reason_response}", from_step="reason"),
    ]


def _rows(result_dir: Path) -> list[dict[str, Any]]:
    return pq.read_table(result_dir / "annotations.parquet").to_pylist()  # type: ignore[no-any-return]


@pytest.fixture
def pool(fake_server: FakeServer) -> Any:
    fake_server.handler = _answers
    client = VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST)
    yield client
    client.close()


def test_three_steps_run_in_order_each_row_once(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """The second step gets only the negative rows, with the first step's answer as
    ``label_response``; the third reads the second's; each row is sent once."""
    pipeline = Pipeline(_steps(_reviews(tmp_path / "r.jsonl")), tmp_path / "run")
    result = pipeline.run(pool, progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["run", "run", "run"]
    label = _rows(pipeline.step_dir("label"))
    reason = _rows(pipeline.step_dir("reason"))
    judge = _rows(pipeline.step_dir("judge"))
    assert sorted(r["id"] for r in label) == sorted(f"r{i}" for i in range(10))
    assert sorted(r["id"] for r in reason) == sorted(f"r{i}" for i in range(1, 10, 2))
    assert all(r["label_response"] == "negative" for r in reason)
    assert {r["response"] for r in judge} == {"yes"}
    assert sorted(r["id"] for r in judge) == sorted(r["id"] for r in reason)
    assert len(fake_server.requests) == 10 + 5 + 5
    report = orjson.loads((tmp_path / "run" / "report.json").read_bytes())
    assert [(s["name"], s["rows"]) for s in report["steps"]] == [
        ("label", 10),
        ("reason", 5),
        ("judge", 5),
    ]


def test_a_run_again_skips_every_step_done_and_sends_nothing(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    pipeline = Pipeline(_steps(_reviews(tmp_path / "r.jsonl")), tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    sent = len(fake_server.requests)
    again = pipeline.run(pool, progress=False, handle_signals=False)
    assert [s.action for s in again.steps] == ["skip", "skip", "skip"]
    assert [s.figures["rows"] for s in again.steps] == [10, 5, 5]
    assert len(fake_server.requests) == sent


def test_a_changed_step_is_refused_naming_its_readers_then_redone_with_force(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """Changing the second step's template is said before anything runs, with the step
    that reads it; with force, the first step is kept and the other two redone."""
    data = _reviews(tmp_path / "r.jsonl")
    Pipeline(_steps(data), tmp_path / "run").run(pool, progress=False, handle_signals=False)
    changed = Pipeline(_steps(data, reason="Why: {text} (briefly)"), tmp_path / "run")
    sent = len(fake_server.requests)
    with pytest.raises(ConfigurationError) as refused:
        changed.run(pool, progress=False, handle_signals=False)
    message = str(refused.value)
    assert "step reason changed" in message and "prompt_template" in message
    assert "judge" in message and "--force" in message
    assert len(fake_server.requests) == sent
    result = changed.run(pool, force=True, progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["skip", "redo", "redo"]
    assert len(fake_server.requests) == sent + 5 + 5
    assert all(r["response"].startswith("because") for r in _rows(changed.step_dir("reason")))


def test_steps_runs_only_those_named_and_needs_what_they_read_done(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    pipeline = Pipeline(_steps(_reviews(tmp_path / "r.jsonl")), tmp_path / "run")
    with pytest.raises(ConfigurationError, match="reads step label, which is not done"):
        pipeline.run(pool, steps=["reason"], progress=False, handle_signals=False)
    with pytest.raises(ConfigurationError, match="nope is not a step"):
        pipeline.run(pool, steps=["nope"], progress=False, handle_signals=False)
    result = pipeline.run(pool, steps=["label"], progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["run", "leave", "leave"]
    assert len(fake_server.requests) == 10
    result = pipeline.run(pool, steps=["reason"], progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["leave", "run", "leave"]


def test_generation_gives_each_answer_its_own_stable_id(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """Two prompts, two copies each, three answers per prompt: 12 rows with ids
    ``prompt_id:answer_index``, each sent once; a second run sends none."""
    step = Step("ideas", prompts=["Name a fruit.", "Name a tree."], copies=2, n=3)
    pipeline = Pipeline([step], tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    rows = _rows(pipeline.step_dir("ideas"))
    assert sorted(r["id"] for r in rows) == sorted(f"{p}:{a}" for p in range(4) for a in range(3))
    assert {(r["prompt_id"], r["answer_index"]) for r in rows} == {
        (p, a) for p in range(4) for a in range(3)
    }
    assert {r["prompt"] for r in rows if r["prompt_id"] < 2} == {"Name a fruit."}
    assert len(fake_server.requests) == 12
    pipeline.run(pool, progress=False, handle_signals=False)
    assert len(fake_server.requests) == 12


def test_n_answers_per_row_of_a_dataset(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    step = Step(
        "label", "Label: {text}", data=str(_reviews(tmp_path / "r.jsonl", 3)), id_column="id", n=2
    )
    pipeline = Pipeline([step], tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    rows = _rows(pipeline.step_dir("label"))
    assert sorted(r["id"] for r in rows) == [f"r{i}:{a}" for i in range(3) for a in range(2)]
    assert {r["prompt_id"] for r in rows} == {"r0", "r1", "r2"}


def _short_only(row: dict[str, Any]) -> dict[str, Any] | None:
    number = int(row["text"].rsplit(" ", 1)[1])
    return None if number >= 4 else {**row, "text": row["text"].upper()}


def _length(row: dict[str, Any], answer: Any) -> dict[str, Any]:
    return {"answer_length": len(answer), "source": row["text"]}


def test_hooks_leave_rows_out_reshape_them_and_add_columns(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    step = Step(
        "label",
        "Label: {text}",
        data=str(_reviews(tmp_path / "r.jsonl")),
        id_column="id",
        preprocess=_short_only,
        postprocess=_length,
    )
    pipeline = Pipeline([step], tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    rows = _rows(pipeline.step_dir("label"))
    assert sorted(r["id"] for r in rows) == ["r0", "r1", "r2", "r3"]
    assert all(r["text"].startswith("REVIEW") for r in rows)
    assert all(r["answer_length"] == len(r["response"]) for r in rows)
    assert all(r["source"] == r["text"] for r in rows)
    settings = orjson.loads((tmp_path / "run" / "pipeline.json").read_bytes())
    recorded = settings["steps"]["label"]["settings"]
    assert recorded["preprocess"].endswith(":_short_only")
    assert recorded["postprocess"].endswith(":_length")


def test_a_where_on_a_column_the_rows_lack_is_said_with_the_columns_they_have(
    tmp_path: Path, pool: VLLMQueueAnnotator
) -> None:
    steps = _steps(_reviews(tmp_path / "r.jsonl"))
    steps[1] = Step("reason", "Why: {text}", from_step="label", where="sentiment == 'negative'")
    pipeline = Pipeline(steps, tmp_path / "run")
    with pytest.raises(
        ConfigurationError, match="'sentiment', which none of the rows it reads has"
    ):
        pipeline.run(pool, progress=False, handle_signals=False)


def test_a_step_naming_servers_not_given_is_refused_before_anything_runs(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    step = Step("label", "Label: {text}", data=str(_reviews(tmp_path / "r.jsonl")), servers="big")
    with pytest.raises(ConfigurationError, match="servers 'big', which are not given"):
        Pipeline([step], tmp_path / "run").run(pool, progress=False, handle_signals=False)
    assert not fake_server.requests
    result = Pipeline([step], tmp_path / "run").run(
        pool, servers={"big": pool}, progress=False, handle_signals=False
    )
    assert result.steps[0].figures["rows"] == 10


def test_a_changed_dataset_is_a_changed_step(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """Rows added to the dataset after step 1 ran: the run refuses, naming the change,
    rather than skip step 1 and feed the later steps stale rows."""
    data = _reviews(tmp_path / "r.jsonl")
    pipeline = Pipeline(_steps(data), tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    _reviews(data, 12)
    with pytest.raises(
        ConfigurationError, match=r"step label changed since it ran \(its dataset changed"
    ):
        pipeline.run(pool, progress=False, handle_signals=False)
    result = pipeline.run(pool, force=True, progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["redo", "redo", "redo"]
    assert len(_rows(pipeline.step_dir("label"))) == 12


def test_one_process_runs_a_pipeline_at_a_time(tmp_path: Path, pool: VLLMQueueAnnotator) -> None:
    from llm_annotator.errors import JobError
    from llm_annotator.jobs.rundir.store import DirectoryLock

    pipeline = Pipeline(_steps(_reviews(tmp_path / "r.jsonl")), tmp_path / "run")
    (tmp_path / "run").mkdir()
    held = DirectoryLock.acquire(tmp_path / "run", "hold")
    try:
        with pytest.raises(JobError, match=r"another run .* is using it"):
            pipeline.run(pool, progress=False, handle_signals=False)
    finally:
        held.release()


def test_a_step_whose_output_was_removed_is_made_again_and_its_readers_redone(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """Its rows are made again and may differ, so what reads them is redone (asked
    with --force, as it replaces results); a last step is simply made again."""
    pipeline = Pipeline(_steps(_reviews(tmp_path / "r.jsonl")), tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    (pipeline.step_dir("judge") / "annotations.parquet").unlink()
    result = pipeline.run(pool, progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["skip", "skip", "resume"]
    assert len(_rows(pipeline.step_dir("judge"))) == 5
    shutil.rmtree(pipeline.step_dir("label"))
    with pytest.raises(
        ConfigurationError, match=r"step label makes rows again .* \(reason, judge\)"
    ):
        pipeline.run(pool, progress=False, handle_signals=False)
    result = pipeline.run(pool, force=True, progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["resume", "redo", "redo"]


def test_a_corpus_runs_as_corpus_jobs_through_the_steps(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """A folder of files: step 1 is a corpus job, step 2 reads its units (filtered)
    into a unit file each and is a corpus job too; each row once per step."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    write_jsonl(corpus / "a.jsonl", [{"id": f"a{i}", "text": f"review {i}"} for i in range(4)])
    write_jsonl(
        corpus / "sub" / "b.jsonl", [{"id": f"b{i}", "text": f"review {i}"} for i in range(6)]
    )
    steps = [
        Step("label", "Label: {text}", data=str(corpus), id_column="id"),
        Step("reason", "Why: {text}", from_step="label", where="label_response == 'negative'"),
    ]
    pipeline = Pipeline(steps, tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    label = pq.read_table(pipeline.step_dir("label") / "annotations").to_pylist()
    reason = pq.read_table(pipeline.step_dir("reason") / "annotations").to_pylist()
    assert sorted(r["id"] for r in label) == sorted(
        [f"a{i}" for i in range(4)] + [f"b{i}" for i in range(6)]
    )
    assert sorted(r["id"] for r in reason) == ["a1", "a3", "b1", "b3", "b5"]
    assert {r["label_input_file"] for r in reason} == {"a.jsonl", "sub/b.jsonl"}
    assert len(fake_server.requests) == 15
    again = pipeline.run(pool, progress=False, handle_signals=False)
    assert [s.action for s in again.steps] == ["skip", "skip"]


def test_a_reader_is_redone_when_what_it_reads_is_redone_under_an_old_key(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """Step 1 redone alone (--steps) to other settings, then back to the first: step 2
    read the first run's rows, which are gone, so it is redone, never skipped."""
    data = _reviews(tmp_path / "r.jsonl")

    def two(template: str) -> list[Step]:
        return (
            _steps(data, reason="Why: {text}")[:2]
            if template == "A"
            else [
                Step("label", "Label: {text}", data=str(data), id_column="id", system_message="B"),
                _steps(data)[1],
            ]
        )

    run = tmp_path / "run"
    Pipeline(two("A"), run).run(pool, progress=False, handle_signals=False)
    with pytest.raises(ConfigurationError, match=r"the steps that read it \(reason\)"):
        Pipeline(two("B"), run).run(pool, steps=["label"], progress=False, handle_signals=False)
    Pipeline(two("B"), run).run(
        pool, steps=["label"], force=True, progress=False, handle_signals=False
    )
    back = Pipeline(two("A"), run)
    assert [p.action for p in back.plan(force=True)] == ["redo", "redo"]
    result = back.run(pool, force=True, progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["redo", "redo"]


def test_n_after_n_keeps_each_levels_ids(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    steps = [
        Step("ideas", prompts=["Name a fruit."], n=2),
        Step("more", "More: {ideas_response}", from_step="ideas", n=3),
    ]
    pipeline = Pipeline(steps, tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    rows = _rows(pipeline.step_dir("more"))
    assert sorted((r["id"], r["prompt_id"], r["answer_index"]) for r in rows) == [
        (f"0:{a}:{b}", f"0:{a}", b) for a in range(2) for b in range(3)
    ]
    assert sorted((r["input_prompt_id"], r["input_answer_index"]) for r in rows) == sorted(
        (0, a) for a in range(2) for _ in range(3)
    )


def test_a_step_begun_on_another_model_is_refused_and_redone_only_when_named(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """The pipeline never lets a job mix two models' answers: --force (given for
    something else) does not redo it; --redo names it."""
    data = _reviews(tmp_path / "r.jsonl")
    pipeline = Pipeline(_steps(data), tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    (pipeline.step_dir("judge") / "annotations.parquet").unlink()  # judge: begun again
    fake_server.models = ["other-model"]
    with VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST) as other:
        for force in (False, True):
            with pytest.raises(ConfigurationError, match="--redo judge"):
                pipeline.run(other, force=force, progress=False, handle_signals=False)
        result = pipeline.run(other, redo=["judge"], progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["skip", "skip", "redo"]
    assert run_status(pipeline.step_dir("judge")).model == "other-model"
    assert len(_rows(pipeline.step_dir("judge"))) == 5


def test_redo_redoes_a_step_and_its_readers(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    pipeline = Pipeline(_steps(_reviews(tmp_path / "r.jsonl")), tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    result = pipeline.run(pool, redo=["reason"], progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["skip", "redo", "redo"]
    with pytest.raises(ConfigurationError, match="--redo: nope is not a step"):
        pipeline.run(pool, redo=["nope"], progress=False, handle_signals=False)


async def _fail_some(request: dict[str, Any]) -> web.StreamResponse:
    prompt = request["messages"][-1]["content"]
    if prompt == "Label: review 3":
        return web.Response(status=400, text="bad request")
    return await _answers(request)


def test_retry_errors_resumes_a_done_step_and_redoes_its_readers_with_force(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    fake_server.handler = _fail_some
    data = _reviews(tmp_path / "r.jsonl")
    pipeline = Pipeline(_steps(data), tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    assert len(_rows(pipeline.step_dir("reason"))) == 4  # r3 failed in step 1
    fake_server.handler = _answers
    steps = _steps(data)
    steps[0] = Step("label", "Label: {text}", data=str(data), id_column="id", retry_errors=True)
    retried = Pipeline(steps, tmp_path / "run")
    with pytest.raises(ConfigurationError, match=r"step label makes rows again \(retry_errors"):
        retried.run(pool, progress=False, handle_signals=False)
    result = retried.run(pool, force=True, progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["resume", "redo", "redo"]
    assert len(_rows(pipeline.step_dir("reason"))) == 5


def test_rows_in_memory_that_change_make_a_changed_step(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    rows = [{"text": f"review {i}"} for i in range(3)]
    Pipeline([Step("label", "Label: {text}", data=rows)], tmp_path / "run").run(
        pool, progress=False, handle_signals=False
    )
    edited = [{"text": f"review {i + 1}"} for i in range(3)]
    with pytest.raises(ConfigurationError, match="its dataset changed"):
        Pipeline([Step("label", "Label: {text}", data=edited)], tmp_path / "run").run(
            pool, progress=False, handle_signals=False
        )


def test_a_retry_of_one_step_alone_leaves_its_readers_stale_not_skipped(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    """--steps label with retry_errors: reason is not run now, but marked stale, so
    the next run redoes it with the row the retry answered."""
    fake_server.handler = _fail_some
    data = _reviews(tmp_path / "r.jsonl")
    Pipeline(_steps(data), tmp_path / "run").run(pool, progress=False, handle_signals=False)
    fake_server.handler = _answers
    steps = _steps(data)
    steps[0] = Step("label", "Label: {text}", data=str(data), id_column="id", retry_errors=True)
    retried = Pipeline(steps, tmp_path / "run")
    retried.run(pool, steps=["label"], force=True, progress=False, handle_signals=False)
    plain = Pipeline(_steps(data), tmp_path / "run")
    result = plain.run(pool, progress=False, handle_signals=False)
    assert [s.action for s in result.steps] == ["skip", "redo", "redo"]
    assert sorted(r["id"] for r in _rows(plain.step_dir("reason"))) == [
        "r1",
        "r3",
        "r5",
        "r7",
        "r9",
    ]


def test_three_levels_of_n_keep_every_levels_ids(
    tmp_path: Path, fake_server: FakeServer, pool: VLLMQueueAnnotator
) -> None:
    steps = [
        Step("a", prompts=["Name a fruit."], n=2),
        Step("b", "More: {a_response}", from_step="a", n=2),
        Step("c", "More: {b_response}", from_step="b", n=2),
    ]
    pipeline = Pipeline(steps, tmp_path / "run")
    pipeline.run(pool, progress=False, handle_signals=False)
    row = next(r for r in _rows(pipeline.step_dir("c")) if r["id"] == "0:1:0:1")
    assert (row["prompt_id"], row["answer_index"]) == ("0:1:0", 1)
    assert (row["input_prompt_id"], row["input_answer_index"]) == ("0:1", 0)
    assert (row["input_input_prompt_id"], row["input_input_answer_index"]) == (0, 1)


_HOOK_CALLS: list[float] = []


def _slow_copy(row: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.02)
    _HOOK_CALLS.append(time.monotonic())
    return row


async def test_a_cancelled_arun_lets_its_file_work_finish_before_the_lock_goes(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Cancelled while a step's rows are being written (in a thread that cannot be
    stopped half way), arun waits for that work before it lets go of the pipeline's
    lock: no other run can start while this one still writes."""
    fake_server.handler = _answers
    data = _reviews(tmp_path / "r.jsonl", 40)
    steps = [
        Step("label", "Label: {text}", data=str(data), id_column="id"),
        Step("reason", "Why: {text}", from_step="label", preprocess=_slow_copy),
    ]
    pipeline = Pipeline(steps, tmp_path / "run")
    _HOOK_CALLS.clear()
    async with VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST) as pool:
        task = asyncio.ensure_future(pipeline.arun(pool, progress=False))
        for _ in range(3000):  # bounded: until the hook runs (the rows are being written)
            if _HOOK_CALLS:
                break
            await asyncio.sleep(0.01)
        assert _HOOK_CALLS, "the step's rows were never written"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    released = time.monotonic()
    assert len(_HOOK_CALLS) == 40 and _HOOK_CALLS[-1] <= released
    assert (tmp_path / "run" / "inputs" / "reason.jsonl").is_file()
    DirectoryLock.acquire(tmp_path / "run", "check").release()
