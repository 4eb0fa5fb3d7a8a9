"""A run directory resumes by content: new ids are sent, unchanged rows kept, changed
rows refused without force (sent again with it), and the output holds only the current
input's rows, the others counted as left out.

Also here: a second signal at any phase of a job (the consolidation too) is one
:class:`RunInterruptedError` with the signal, never a ``CancelledError``.
"""

from __future__ import annotations

import io
import os
import signal
import threading
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from llm_annotator import (
    FingerprintMismatchError,
    JobError,
    RunInterruptedError,
    VLLMQueueAnnotator,
)
from llm_annotator.cli.status import show_status
from llm_annotator.errors import RunDirectoryError
from llm_annotator.jobs.rundir.consolidate import INPUT_IDS_FILE, consolidate
from llm_annotator.jobs.shards.merge import merge
from llm_annotator.jobs.watch.status import run_status
from tests.unit.conftest import FakeServer, echo, error
from tests.unit.helpers import FAST, TEMPLATE, write_jsonl


def pool_of(server: FakeServer) -> VLLMQueueAnnotator:
    return VLLMQueueAnnotator([server.base_url], batch_size=16, **FAST)


def ids_of(path: Path) -> list[Any]:
    return list(pq.read_table(path, columns=["id"]).column("id").to_pylist())


def test_another_input_in_the_same_directory_sends_its_rows_and_leaves_the_others_out(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Same settings, another input of other ids: not refused; its 100 rows are sent,
    the output holds them only, the 100 others are counted as left out (in the result,
    report.json and status), and status.json does not say 200 of 100."""
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": i, "text": f"a{i}"} for i in range(100)])
    second = write_jsonl(
        tmp_path / "b.jsonl", [{"id": 1000 + i, "text": f"b{i}"} for i in range(100)]
    )
    out = tmp_path / "run"
    with pool_of(fake_server) as pool:
        pool.annotate(first, TEMPLATE, out, id_column="id", progress=False)
        sent = len(fake_server.requests)
        result = pool.annotate(second, TEMPLATE, out, id_column="id", progress=False)
    assert len(fake_server.requests) == sent + 100
    assert ids_of(result.output_path) == [1000 + i for i in range(100)]
    texts = pq.read_table(result.output_path, columns=["text"]).column("text").to_pylist()
    assert all(text.startswith("b") for text in texts)
    assert (result.num_rows, result.num_resumed, result.num_left_out) == (100, 0, 100)
    report = orjson.loads(result.report_path.read_bytes())
    assert report["left_out_rows"] == 100
    status = orjson.loads((out / "status.json").read_bytes())
    assert status["done"] == 100 and status["total"] == 100, status
    shown = run_status(out)
    assert (shown.done, shown.total, shown.stored, shown.mixed_inputs) == (100, 100, 200, True)
    printed = io.StringIO()
    show_status(shown, printed)
    assert "rows of this input: 100 of 100 done (100.0%)" in printed.getvalue()
    assert "other inputs (left out of the output): 200 ids in all" in printed.getvalue()
    assert "rows by server (every input):" in printed.getvalue()
    (out / "status.json").unlink()  # the job's own count is gone: not guessed
    unknown = run_status(out)
    assert (unknown.done, unknown.stored) == (None, 200)
    printed = io.StringIO()
    show_status(unknown, printed)
    assert "rows of this input: not known yet" in printed.getvalue()
    job = orjson.loads((out / "job.json").read_bytes())
    assert job["input"]["where"] == str(second) and job["mixed_inputs"] is True
    assert [entry["where"] for entry in job["input_history"]] == [str(first)]


def test_a_grown_dataset_resumes_and_sends_only_its_new_rows(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Two rows annotated, then the same two plus a third: the first two are kept and
    only the third is sent, by id and by position alike."""
    for id_column in ("id", None):
        out = tmp_path / f"run-{id_column}"
        first = write_jsonl(tmp_path / "a.jsonl", [{"id": i, "text": f"t{i}"} for i in range(2)])
        grown = write_jsonl(tmp_path / "b.jsonl", [{"id": i, "text": f"t{i}"} for i in range(3)])
        with pool_of(fake_server) as pool:
            pool.annotate(first, TEMPLATE, out, id_column=id_column, progress=False)
            fake_server.requests.clear()
            result = pool.annotate(grown, TEMPLATE, out, id_column=id_column, progress=False)
        assert [r["messages"][-1]["content"] for r in fake_server.requests] == ["Label: t2"]
        assert (result.num_rows, result.num_resumed, result.num_sent) == (3, 2, 1)
        assert ids_of(result.output_path) == [0, 1, 2]


def test_rows_whose_content_changed_are_refused_then_sent_again_with_force(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """The same ids in another order resume sending nothing. The same ids with other
    text are refused, counted and named (the first few ids), before any request; with
    force exactly the changed rows are sent again and the output holds their new text,
    also when consolidated again later."""
    records = [{"id": f"r{i}", "text": f"t{i}"} for i in range(30)]
    first = write_jsonl(tmp_path / "a.jsonl", records)
    reordered = write_jsonl(tmp_path / "b.jsonl", list(reversed(records)))
    edited = [{**r, "text": "x"} if i % 3 == 0 else r for i, r in enumerate(records)]
    changed = write_jsonl(tmp_path / "c.jsonl", edited)
    out = tmp_path / "run"
    with pool_of(fake_server) as pool:
        pool.annotate(first, TEMPLATE, out, id_column="id", progress=False)
        sent = len(fake_server.requests)
        again = pool.annotate(reordered, TEMPLATE, out, id_column="id", progress=False)
        assert len(fake_server.requests) == sent
        assert (again.num_rows, again.num_resumed, again.num_left_out) == (30, 30, 0)
        with pytest.raises(FingerprintMismatchError) as refused:
            pool.annotate(changed, TEMPLATE, out, id_column="id", progress=False)
        assert len(fake_server.requests) == sent
        message = str(refused.value)
        assert "answers to 10 rows whose content changed" in message, message
        assert "'r0', 'r3', 'r6', 'r9', 'r12', ..." in message and "--force" in message
        assert "\n" not in message
        result = pool.annotate(changed, TEMPLATE, out, id_column="id", progress=False, force=True)
    assert len(fake_server.requests) == sent + 10
    assert (result.num_rows, result.num_resumed, result.num_sent) == (30, 20, 10)
    table = pq.read_table(result.output_path).to_pylist()
    assert "_input_hash" not in table[0]
    texts = {row["id"]: row["text"] for row in table}
    assert texts == {r["id"]: r["text"] for r in edited}
    consolidate(out)  # again, on its own: the stale records stay out
    texts = {
        row["id"]: row["text"] for row in pq.read_table(out / "annotations.parquet").to_pylist()
    }
    assert texts == {r["id"]: r["text"] for r in edited}


def test_a_changed_row_whose_new_answer_fails_never_gets_its_old_answer_back(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A changed row sent again with force whose new request fails: its output row is
    the error, not the answer to its old text (a success would otherwise win)."""
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": i, "text": f"t{i}"} for i in range(4)])
    changed = write_jsonl(
        tmp_path / "b.jsonl", [{"id": i, "text": "bad" if i == 2 else f"t{i}"} for i in range(4)]
    )
    out = tmp_path / "run"

    async def refuse_bad(request: dict[str, Any]) -> Any:
        if "bad" in request["messages"][-1]["content"]:
            return error(400, "this prompt is refused")
        return await echo(request)

    with pool_of(fake_server) as pool:
        pool.annotate(first, TEMPLATE, out, id_column="id", progress=False)
        fake_server.handler = refuse_bad
        result = pool.annotate(changed, TEMPLATE, out, id_column="id", progress=False, force=True)
    rows = {row["id"]: row for row in pq.read_table(result.output_path).to_pylist()}
    assert rows[2]["text"] == "bad" and rows[2]["error"], rows[2]
    assert (result.num_succeeded, result.num_failed) == (3, 1)


def test_changed_rows_that_had_only_errors_are_sent_again_without_force(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A row that failed (an unreadable line, then fixed) replaces no answer: sent again
    without force, and counted as resumed no more."""
    data = tmp_path / "a.jsonl"
    data.write_text('{"id": 0, "text": "t0"}\n{"id": 1, "text": \n{"id": 2, "text": "t2"}\n')
    out = tmp_path / "run"
    with pool_of(fake_server) as pool:
        first = pool.annotate(data, TEMPLATE, out, id_column=None, progress=False)
        assert first.num_failed == 1
        data.write_text(
            '{"id": 0, "text": "t0"}\n{"id": 1, "text": "t1"}\n{"id": 2, "text": "t2"}\n'
        )
        fake_server.requests.clear()
        result = pool.annotate(data, TEMPLATE, out, id_column=None, progress=False)
    assert [r["messages"][-1]["content"] for r in fake_server.requests] == ["Label: t1"]
    assert (result.num_succeeded, result.num_failed, result.num_resumed) == (3, 0, 2)


def test_rows_by_position_of_another_content_are_refused(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Without an id column, rows are their positions: other content at the same
    positions is changed content, refused without force."""
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(10)])
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(10)])
    out = tmp_path / "run"
    with pool_of(fake_server) as pool:
        pool.annotate(first, TEMPLATE, out, progress=False)
        with pytest.raises(FingerprintMismatchError, match="answers to 10 rows whose content"):
            pool.annotate(second, TEMPLATE, out, progress=False)
        again = pool.annotate(first, TEMPLATE, out, progress=False)
    assert again.num_resumed == 10


def test_a_directory_made_before_inputs_were_recorded_resumes_and_keeps_its_input(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """An older job.json has no input: the job resumes (no refusal), records the
    input, and since the directory may hold another input's rows, writes only the
    current input's (here: 20 of the 50 ids it holds)."""
    data = write_jsonl(tmp_path / "a.jsonl", [{"id": i, "text": f"t{i}"} for i in range(50)])
    out = tmp_path / "run"
    with pool_of(fake_server) as pool:
        pool.annotate(data, TEMPLATE, out, id_column="id", progress=False)
        job = orjson.loads((out / "job.json").read_bytes())
        for key in ("input", "input_history", "mixed_inputs"):
            del job[key]
        (out / "job.json").write_bytes(orjson.dumps(job))
        smaller = write_jsonl(tmp_path / "b.jsonl", [{"id": i, "text": f"t{i}"} for i in range(20)])
        sent = len(fake_server.requests)
        result = pool.annotate(smaller, TEMPLATE, out, id_column="id", progress=False)
    assert len(fake_server.requests) == sent
    assert ids_of(result.output_path) == list(range(20))
    assert (result.num_resumed, result.num_left_out) == (20, 30)
    assert orjson.loads((out / "job.json").read_bytes())["input"]["rows"] == 20


def test_a_second_signal_during_the_consolidation_is_one_interrupted_error(
    fake_server: FakeServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM twice while the results are consolidated: the job ends with
    RunInterruptedError naming the signal (the CLI's exit 128 + signal), not a
    CancelledError out of the sync facade; every row written is kept."""
    data = write_jsonl(tmp_path / "a.jsonl", [{"text": f"t{i}"} for i in range(20)])
    real = consolidate
    consolidating = threading.Event()
    release = threading.Event()

    def slow_consolidate(*args: Any, **kwargs: Any) -> Any:
        consolidating.set()
        release.wait(20)
        return real(*args, **kwargs)

    def signal_twice() -> None:
        if consolidating.wait(20):
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(0.3)
            os.kill(os.getpid(), signal.SIGTERM)
            threading.Event().wait(0.3)
        release.set()

    monkeypatch.setattr("llm_annotator.jobs.annotate.consolidate", slow_consolidate)
    sender = threading.Thread(target=signal_twice, daemon=True)
    sender.start()
    with pool_of(fake_server) as pool, pytest.raises(RunInterruptedError) as stopped:
        pool.annotate(data, TEMPLATE, tmp_path / "run", progress=False)
    sender.join(30)
    assert consolidating.is_set(), "the consolidation never started"
    assert stopped.value.signum == signal.SIGTERM
    assert "second signal" in str(stopped.value) or "SIGTERM" in str(stopped.value)
    shards = list((tmp_path / "run" / "shards").glob("part-*.jsonl"))
    written = sum(len(path.read_bytes().splitlines()) for path in shards)
    assert written == 20


def test_shards_forced_onto_another_input_merge_only_its_rows(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A job of 2 shards, then the same shards forced onto another input: each shard
    keeps only the new input's rows, and so does the merge, with the others counted as
    left out; while one shard is on the first input and one on the second, nothing is
    merged (the output would mix them). A shard whose list of kept ids is gone or of
    the wrong shape stops the merge with one line naming it, writing nothing."""
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": i, "text": f"a{i}"} for i in range(60)])
    second = write_jsonl(
        tmp_path / "b.jsonl", [{"id": 500 + i, "text": f"b{i}"} for i in range(40)]
    )
    out = tmp_path / "run"
    with pool_of(fake_server) as pool:
        for index in (0, 1):
            pool.annotate(first, TEMPLATE, out, id_column="id", progress=False, shard=(index, 2))
        results = [
            pool.annotate(
                second, TEMPLATE, out, id_column="id", progress=False, shard=(0, 2), force=True
            )
        ]
        assert results[0].merged_path is None  # shard 1 is still on the first input
        with pytest.raises(JobError, match="over 2 different inputs") as mixed:
            merge(out)
        assert f"{first}: shard 1" in str(mixed.value)
        assert f"{second}: shard 0" in str(mixed.value)
        results.append(
            pool.annotate(
                second, TEMPLATE, out, id_column="id", progress=False, shard=(1, 2), force=True
            )
        )
    merged = results[1].merged_path
    assert merged is not None
    assert ids_of(merged) == [500 + i for i in range(40)]
    texts = pq.read_table(merged, columns=["text"]).column("text").to_pylist()
    assert all(text.startswith("b") for text in texts)
    assert sum(r.num_left_out for r in results) == 60
    report = orjson.loads((out / "report.json").read_bytes())
    assert (report["rows"], report["left_out_rows"]) == (40, 60), report
    ids_file = out / "shard-0000-of-0002" / INPUT_IDS_FILE
    kept = ids_file.read_bytes()
    ids_file.unlink()
    merged.unlink()
    with pytest.raises(JobError, match=r"shard 0 .* also holds rows of another input") as gone:
        merge(out)
    assert "--shard 0/2" in str(gone.value) and not merged.exists()
    ids_file.write_bytes(kept[:-1])
    with pytest.raises(RunDirectoryError, match="not a list of id hashes"):
        merge(out)
    ids_file.write_bytes(kept[8:] + kept[:8])
    with pytest.raises(RunDirectoryError, match="not a sorted list"):
        merge(out)
    ids_file.write_bytes(kept)
    assert ids_of(merge(out).output_path) == [500 + i for i in range(40)]


def test_a_refused_change_leaves_job_json_as_it_was(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A run refused for changed rows sends nothing and writes nothing: job.json still
    names the input it was made over, not mixed."""
    out = tmp_path / "run"
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": i, "text": f"t{i}"} for i in range(5)])
    edited = write_jsonl(tmp_path / "b.jsonl", [{"id": i, "text": f"x{i}"} for i in range(5)])
    with pool_of(fake_server) as pool:
        pool.annotate(first, TEMPLATE, out, id_column="id", progress=False)
        before = (out / "job.json").read_bytes()
        with pytest.raises(FingerprintMismatchError):
            pool.annotate(edited, TEMPLATE, out, id_column="id", progress=False)
    assert orjson.loads((out / "job.json").read_bytes()) == orjson.loads(before)


def test_retry_errors_sends_again_a_changed_row_whose_new_answer_failed(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """A changed row sent again with force fails; a later run with retry_errors sends it
    once more (its old answer is stale, so its error decides), and the output then
    holds its new answer."""
    first = write_jsonl(tmp_path / "a.jsonl", [{"id": i, "text": f"t{i}"} for i in range(4)])
    changed = write_jsonl(
        tmp_path / "b.jsonl", [{"id": i, "text": "bad" if i == 2 else f"t{i}"} for i in range(4)]
    )
    out = tmp_path / "run"

    async def refuse_bad(request: dict[str, Any]) -> Any:
        if "bad" in request["messages"][-1]["content"]:
            return error(500, "EngineCore failed", "InternalServerError")
        return await echo(request)

    with pool_of(fake_server) as pool:
        pool.annotate(first, TEMPLATE, out, id_column="id", progress=False)
        fake_server.handler = refuse_bad
        failed = pool.annotate(changed, TEMPLATE, out, id_column="id", progress=False, force=True)
        assert failed.num_failed == 1
        fake_server.handler = echo
        fake_server.requests.clear()
        again = pool.annotate(
            changed, TEMPLATE, out, id_column="id", progress=False, retry_errors=True
        )
    assert [r["messages"][-1]["content"] for r in fake_server.requests] == ["Label: bad"]
    rows = {row["id"]: row for row in pq.read_table(again.output_path).to_pylist()}
    assert rows[2]["response"] == "Label: bad" and not rows[2]["error"]


def test_results_made_before_contents_were_recorded_meet_another_input_refused(
    fake_server: FakeServer, tmp_path: Path
) -> None:
    """Records without a content hash (an older version's) cannot tell a changed row:
    over another input (by position) the run is refused as before, and with force keeps
    them; over the same input it resumes."""
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": f"t{i}"} for i in range(4)])
    edited = write_jsonl(tmp_path / "b.jsonl", [{"text": f"x{i}"} for i in range(4)])
    out = tmp_path / "run"
    with pool_of(fake_server) as pool:
        pool.annotate(first, TEMPLATE, out, progress=False)
        for shard in (out / "shards").glob("*.jsonl"):
            records = [orjson.loads(line) for line in shard.read_bytes().splitlines()]
            shard.write_bytes(
                b"".join(
                    orjson.dumps({k: v for k, v in r.items() if k != "_input_hash"}) + b"\n"
                    for r in records
                )
            )
        sent = len(fake_server.requests)
        assert pool.annotate(first, TEMPLATE, out, progress=False).num_resumed == 4
        with pytest.raises(FingerprintMismatchError, match="before row contents were recorded"):
            pool.annotate(edited, TEMPLATE, out, progress=False)
        forced = pool.annotate(edited, TEMPLATE, out, progress=False, force=True)
    assert len(fake_server.requests) == sent and forced.num_resumed == 4
