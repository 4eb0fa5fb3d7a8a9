"""Annotation jobs against in-process fake servers: outputs, resume, bad input, schemas."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from llm_annotator import (
    FingerprintMismatchError,
    InputError,
    PromptError,
    RunInterruptedError,
    VLLMOnlineClient,
    VLLMOnlineRuntimeOptions,
    VLLMQueueAnnotator,
)
from llm_annotator.jobs.annotate import Annotator
from tests.unit.conftest import FakeServer, completion, echo, error
from tests.unit.helpers import TEMPLATE, pool_of, read_output, rows, sent_texts, write_jsonl

FakeServers = Callable[[int], list[FakeServer]]


def test_annotate_writes_one_row_per_input_with_columns(
    fake_servers: FakeServers, tmp_path: Path
) -> None:
    """Every input row comes out once, sorted by id, with its input columns and the
    answer's columns; the report counts what happened."""
    servers = fake_servers(2)
    data = write_jsonl(tmp_path / "data.jsonl", rows(300))
    with pool_of(servers) as pool:
        result = pool.annotate(data, TEMPLATE, tmp_path / "run", progress=False)
    assert (result.num_rows, result.num_succeeded, result.num_failed) == (300, 300, 0)
    assert result.output_path == tmp_path / "run" / "annotations.parquet"
    table = read_output(result.output_path)
    assert [r["id"] for r in table] == list(range(300))
    first = table[0]
    assert first["response"] == "Label: t0"
    assert first["text"] == "t0" and first["n"] == 0
    assert first["finish_reason"] == "stop"
    assert first["num_prompt_tokens"] == 5 and first["num_output_tokens"] == 2
    assert first["error"] is None and first["error_type"] is None
    assert first["server"] in {s.base_url for s in servers}
    report = orjson.loads(result.report_path.read_bytes())
    assert report["succeeded"] == 300
    assert report["by_finish_reason"] == {"stop": 300}
    assert set(report["per_server"]) == {s.base_url for s in servers}
    assert max(sent_texts(servers).values()) == 1


def test_rerun_sends_nothing_and_a_stopped_run_resumes_without_resending(
    fake_servers: FakeServers, tmp_path: Path
) -> None:
    """A job stopped part way resumes: rows written before are not sent again, and the
    output holds every id exactly once; a finished job run again sends nothing."""
    servers = fake_servers(2)
    answered = 0

    async def slow(request: dict[str, Any]) -> web.StreamResponse:
        nonlocal answered
        await asyncio.sleep(0.005)
        answered += 1
        return await echo(request)

    for server in servers:
        server.handler = slow
    data = rows(1000)
    out = tmp_path / "run"

    async def first_run(pool: VLLMQueueAnnotator) -> None:
        stop = asyncio.Event()

        async def stop_at_100() -> None:
            for _ in range(3000):  # 30 s at most
                if answered >= 100:
                    break
                await asyncio.sleep(0.01)
            stop.set()

        stopper = asyncio.ensure_future(stop_at_100())
        try:
            await pool.aannotate(data, TEMPLATE, out, progress=False, stop=stop)
        finally:
            stopper.cancel()
            await pool.aclose()

    with pytest.raises(RunInterruptedError) as stopped:
        asyncio.run(first_run(pool_of(servers)))
    written = stopped.value.num_done
    assert 100 <= written < 1000
    first_sent = sent_texts(servers)
    assert sum(first_sent.values()) == written  # in-flight requests finished and were kept
    for server in servers:
        server.requests.clear()
        server.handler = echo
    with pool_of(servers) as pool:
        result = pool.annotate(data, TEMPLATE, out, progress=False)
    assert result.num_resumed == written
    assert result.num_sent == 1000 - written
    second_sent = sent_texts(servers)
    assert not set(first_sent) & set(second_sent)
    assert [r["id"] for r in read_output(result.output_path)] == list(range(1000))
    for server in servers:
        server.requests.clear()
    with pool_of(servers) as pool:
        again = pool.annotate(data, TEMPLATE, out, progress=False)
    assert again.num_sent == 0
    assert sum(len(s.requests) for s in servers) == 0


def test_changed_settings_are_refused_unless_forced(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Resuming with another template is refused with what changed; force resumes."""
    out = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        pool.annotate(rows(10), TEMPLATE, out, progress=False)
        with pytest.raises(FingerprintMismatchError, match="prompt_template") as refused:
            pool.annotate(rows(10), "Other: {text}", out, progress=False)
        assert any("prompt_template" in line for line in refused.value.changes)
        result = pool.annotate(rows(10), "Other: {text}", out, progress=False, force=True)
    assert result.num_sent == 0  # forced: the rows done stay done


def test_retry_errors_sends_only_the_error_rows(fake_server: FakeServer, tmp_path: Path) -> None:
    """Rows that ended in error are sent again with retry_errors, and only those."""
    failing = {3, 7, 11}

    async def some_fail(request: dict[str, Any]) -> web.StreamResponse:
        n = int(request["messages"][-1]["content"].split("t")[-1])
        if n in failing:
            return error(400, "this prompt is too long")
        return await echo(request)

    fake_server.handler = some_fail
    out = tmp_path / "run"
    with pool_of([fake_server]) as pool:
        first = pool.annotate(rows(20), TEMPLATE, out, progress=False)
        assert first.num_failed == 3
        fake_server.requests.clear()
        fake_server.handler = echo
        second = pool.annotate(rows(20), TEMPLATE, out, progress=False, retry_errors=True)
    assert set(sent_texts([fake_server])) == {f"Label: t{i}" for i in failing}
    assert (second.num_failed, second.num_succeeded, second.num_sent) == (0, 20, 3)
    table = read_output(second.output_path)
    assert [r["id"] for r in table] == list(range(20))


def test_bad_rows_become_error_rows_and_the_rest_goes_on(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A malformed JSONL line and a row without the template's field become error rows
    that name the file, the line and the field; the other rows are annotated."""
    data = tmp_path / "data.jsonl"
    data.write_bytes(b'{"text": "a"}\n{"text": \n{"other": 1}\n{"text": "d"}\n')
    with pool_of([fake_server]) as pool:
        result = pool.annotate(data, TEMPLATE, tmp_path / "run", progress=False)
    assert (result.num_rows, result.num_succeeded, result.num_failed) == (4, 2, 2)
    table = {r["id"]: r for r in read_output(result.output_path)}
    assert table[1]["error_type"] == "input_error"
    assert "data.jsonl line 2" in table[1]["error"]
    assert "line 3" in table[2]["error"] and "text" in table[2]["error"]
    assert table[3]["response"] == "Label: d"
    assert len(fake_server.requests) == 2


def test_only_the_job_writes_the_store_and_many_bad_rows_stay_bounded(
    fake_server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10,000 rows of which all but every 1,000th lack the template's field: every row
    gets its record, the good ones answered, and every record is written by the job's
    own task (never from inside the pool's input reader), with at most a bounded
    number of error records waiting for it at any time."""
    from llm_annotator.jobs.loop import runner as job_module
    from llm_annotator.jobs.rundir.store import ResultStore

    records = [{"text": f"t{i}"} if i % 1000 == 0 else {"other": i} for i in range(10_000)]
    data = write_jsonl(tmp_path / "data.jsonl", records)
    writers: set[asyncio.Task[Any] | None] = set()
    waiting: list[int] = []
    original_append = ResultStore.append
    original_put = job_module.JobRun._put_ready

    def append(self: ResultStore, record: dict[str, Any]) -> None:
        writers.add(asyncio.current_task())
        original_append(self, record)

    async def put_ready(self: Any, record: dict[str, Any], row: Any, content: str) -> None:
        waiting.append(len(self.ready))
        await original_put(self, record, row, content)

    monkeypatch.setattr(ResultStore, "append", append)
    monkeypatch.setattr(job_module.JobRun, "_put_ready", put_ready)

    async def job() -> tuple[Any, asyncio.Task[Any] | None]:
        async with pool_of([fake_server]) as pool:
            result = await pool.aannotate(data, TEMPLATE, tmp_path / "run", progress=False)
        return result, asyncio.current_task()

    result, job_task = asyncio.run(job())
    assert (result.num_rows, result.num_succeeded, result.num_failed) == (10_000, 10, 9_990)
    assert len(fake_server.requests) == 10
    assert writers == {job_task}
    assert max(waiting) < job_module._READY_LIMIT


def test_answers_wait_for_the_job_while_it_syncs(
    fake_server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the job is slow to sync its store (a network file system), the answers it
    has not written yet stay bounded: the pump stops reading, so the pool stops taking
    rows; every row still comes out once."""
    from llm_annotator.jobs.loop import runner
    from llm_annotator.jobs.rundir.store import ResultStore

    monkeypatch.setattr(runner, "_ANSWERS_LIMIT", 8)
    original_sync = ResultStore.sync
    held: list[int] = []
    original_conclude = runner.JobRun._conclude

    def slow_sync(self: ResultStore) -> None:
        time.sleep(0.05)
        original_sync(self)

    def conclude(self: Any, item: Any, response: Any) -> None:
        held.append(len(self.answers))
        original_conclude(self, item, response)

    monkeypatch.setattr(ResultStore, "sync", slow_sync)
    monkeypatch.setattr(runner.JobRun, "_conclude", conclude)
    data = write_jsonl(tmp_path / "data.jsonl", rows(300))
    with pool_of([fake_server]) as pool:
        runner_ = Annotator(pool, progress=False, flush_interval=0, sync_interval=0)
        result = runner_.annotate(data, TEMPLATE, tmp_path / "run")
    assert (result.num_rows, result.num_failed) == (300, 0)
    assert len(held) == 300 and max(held) < 8


def test_problems_found_before_the_run_send_nothing(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """An unknown column, an unsafe template, a missing file and repeated ids are
    refused before any request, with the file and the field named."""
    table = tmp_path / "data.csv"
    table.write_text("text,id\na,1\nb,1\n", encoding="utf-8")
    with pool_of([fake_server]) as pool:
        with pytest.raises(PromptError, match="body"):
            pool.annotate(table, "Label: {body}", tmp_path / "a", progress=False)
        with pytest.raises(PromptError, match="__class__"):
            pool.annotate(table, "{text.__class__}", tmp_path / "b", progress=False)
        with pytest.raises(InputError, match=r"missing\.jsonl"):
            pool.annotate(tmp_path / "missing.jsonl", TEMPLATE, tmp_path / "c", progress=False)
        with pytest.raises(InputError, match="1"):
            pool.annotate(table, TEMPLATE, tmp_path / "d", id_column="id", progress=False)
    assert fake_server.requests == []


def test_invalid_answers_are_regenerated_then_kept_with_their_text(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """With an output schema, an invalid answer is generated again; one that stays
    invalid is an error row that keeps the raw text; valid ones are parsed."""
    schema = {
        "type": "object",
        "properties": {"label": {"enum": ["pos", "neg"]}},
        "required": ["label"],
    }
    tries: Counter[str] = Counter()

    async def flaky(request: dict[str, Any]) -> web.StreamResponse:
        text = request["messages"][-1]["content"]
        tries[text] += 1
        if text == "Label: t0":
            return completion("not json")
        if text == "Label: t1" and tries[text] == 1:
            return completion('{"label": "maybe"}')
        return completion('{"label": "pos"}')

    fake_server.handler = flaky
    options = VLLMOnlineRuntimeOptions(max_completion_tokens=8, output_schema=schema)
    with pool_of([fake_server]) as pool:
        result = pool.annotate(rows(3), TEMPLATE, tmp_path / "run", options=options)
    table = {r["id"]: r for r in read_output(result.output_path)}
    assert tries["Label: t0"] == 3  # the first try and two regenerations
    assert table[0]["valid"] is False
    assert table[0]["error_type"] == "invalid_output"
    assert table[0]["response"] == "not json"
    assert tries["Label: t1"] == 2
    assert (table[1]["label"], table[1]["valid"], table[1]["error"]) == ("pos", True, None)
    assert tries["Label: t2"] == 1


def test_a_fixed_seed_is_not_regenerated(fake_server: FakeServer, tmp_path: Path) -> None:
    """With a seed the same answer would come back, so an invalid one is kept at once."""
    fake_server.handler = lambda request: _const(completion("nope"))
    options = VLLMOnlineRuntimeOptions(seed=1, output_schema={"type": "object"})
    with pool_of([fake_server]) as pool:
        result = pool.annotate(rows(2), TEMPLATE, tmp_path / "run", options=options)
    assert result.num_failed == 2
    assert len(fake_server.requests) == 2


async def _const(response: web.StreamResponse) -> web.StreamResponse:
    return response


def test_a_single_client_annotates_too(fake_server: FakeServer, tmp_path: Path) -> None:
    """Annotator works with one client, in batches, and keeps a chosen column subset."""
    with VLLMOnlineClient(base_url=fake_server.base_url, max_retries=0) as client:
        annotator = Annotator(client, batch_size=7, max_concurrent_batches=2, progress=False)
        result = annotator.annotate(
            rows(50), TEMPLATE, tmp_path / "run", columns=["n"], write_jsonl=True
        )
    table = read_output(result.output_path)
    assert [r["id"] for r in table] == list(range(50))
    assert "text" not in table[0] and table[0]["n"] == 0
    assert result.jsonl_path is not None
    lines = result.jsonl_path.read_bytes().splitlines()
    assert [orjson.loads(line)["id"] for line in lines] == list(range(50))


def test_a_row_the_store_claims_without_a_result_fails_the_job_loudly(
    fake_servers: FakeServers, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the done-id set claimed a row it never saw (an 8-byte hash collision), the job
    would skip it; it must end in a JobError that says rows are missing, not a quiet
    success."""
    from llm_annotator import JobError
    from llm_annotator.jobs.rundir.store import ResultStore

    servers = fake_servers(1)
    data = write_jsonl(tmp_path / "data.jsonl", rows(20))
    real = ResultStore.is_done

    def claims_row_7(self: ResultStore, row_id: Any) -> bool:
        return row_id == 7 or real(self, row_id)

    monkeypatch.setattr(ResultStore, "is_done", claims_row_7)
    with (
        pool_of(servers) as pool,
        pytest.raises(JobError, match="1 of the 20 input rows have no result"),
    ):
        pool.annotate(data, TEMPLATE, tmp_path / "run", progress=False)
    assert len(servers[0].requests) == 19


def test_the_job_arguments_are_the_same_everywhere(tmp_path: Path) -> None:
    """JobArgs (the typed keywords) and JobSpec (the arguments with their defaults) name
    the same arguments, and an unknown keyword is refused by name before anything runs."""
    import dataclasses

    from llm_annotator.jobs.annotate import JobArgs, JobSpec

    fields = {f.name for f in dataclasses.fields(JobSpec)}
    assert set(JobArgs.__annotations__) == fields - {"data", "prompt_template", "output_dir"}
    client = VLLMOnlineClient(base_url="http://127.0.0.1:9/v1", model="m")
    with pytest.raises(TypeError, match="'retry_error'"):
        Annotator(client).annotate(rows(1), TEMPLATE, tmp_path / "run", retry_error=True)  # type: ignore[call-arg]
    assert not (tmp_path / "run").exists()
