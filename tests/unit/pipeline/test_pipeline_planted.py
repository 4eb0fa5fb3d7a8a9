"""A pipeline's directory is its own, as a job's run directory is: a link, a FIFO or a
folder planted where the pipeline or a step's job writes is refused for every step
before the first request, with one line naming it; temporaries have fresh random names,
so nothing planted under a fixed hidden name is written through or waited on."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import orjson
import pytest

from llm_annotator import VLLMQueueAnnotator
from llm_annotator.cli import main
from llm_annotator.errors import ConfigurationError, RunDirectoryError
from llm_annotator.pipeline import Pipeline, PipelineResult, Step
from tests.unit.conftest import FakeServer
from tests.unit.helpers import FAST, write_jsonl

OUTSIDE = b"a file outside the pipeline's directory\n"


def _steps(data: Path) -> list[Step]:
    """Three steps; the second and third write their rows to inputs/ first."""
    return [
        Step("label", "Label: {text}", data=str(data), id_column="id"),
        Step("reason", "Why: {label_response}", from_step="label"),
        Step("judge", "Judge: {reason_response}", from_step="reason"),
    ]


def _reviews(tmp_path: Path) -> Path:
    rows = [{"id": f"r{i}", "text": f"review {i}"} for i in range(4)]
    return write_jsonl(tmp_path / "reviews.jsonl", rows)


def _plant(entry: Path, kind: str, outside: Path) -> None:
    """A link to ``outside``, a FIFO, a folder, or a file half written."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    if kind == "link":
        entry.symlink_to(outside, target_is_directory=outside.is_dir())
    elif kind == "fifo":
        os.mkfifo(entry)
    elif kind == "directory":
        entry.mkdir()
    else:
        entry.write_bytes(b'{"id": "half a row written by a run that was killed", "te')


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(OUTSIDE)
    return outside


def _run_in_thread(pipeline: Pipeline, server: FakeServer) -> BaseException | object:
    """The run's result or error; None if it blocked (a FIFO waited on)."""
    outcome: list[BaseException | object] = []

    def attempt() -> None:
        try:
            with VLLMQueueAnnotator([server.base_url], batch_size=4, **FAST) as pool:
                outcome.append(pipeline.run(pool, progress=False, handle_signals=False))
        except BaseException as error:
            outcome.append(error)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(60)
    return outcome[0] if outcome else None


@pytest.mark.parametrize("kind", ["link", "fifo", "file"])
@pytest.mark.parametrize("name", [".reason.jsonl.partial", ".judge.jsonl.partial"])
def test_an_entry_at_a_fixed_hidden_name_is_neither_written_through_nor_waited_on(
    tmp_path: Path, fake_server: FakeServer, name: str, kind: str
) -> None:
    """A step's rows go to a temporary of a fresh random name: a link, a FIFO or a
    leftover of an earlier version planted at the old hidden name is not written
    through or opened; the run ends with every step done, and inputs/ holds only each
    step's rows (the leftover is removed)."""
    outside = _outside(tmp_path)
    out = tmp_path / "run"
    _plant(out / "inputs" / name, kind, outside)
    pipeline = Pipeline(_steps(_reviews(tmp_path)), out)
    outcome = _run_in_thread(pipeline, fake_server)
    assert outcome is not None, f"the run blocked on a {kind} at inputs/{name}"
    assert not isinstance(outcome, BaseException), outcome
    assert outside.read_bytes() == OUTSIDE
    assert sorted(os.listdir(out / "inputs")) == ["judge.jsonl", "reason.jsonl"]
    assert not (out / "inputs" / "reason.jsonl").is_symlink()
    assert len(fake_server.requests) == 4 * 3


@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        ("inputs/reason.jsonl", "link"),
        ("inputs/reason.jsonl", "fifo"),
        ("inputs/reason.jsonl", "directory"),
        ("inputs/judge.jsonl", "link"),
        ("inputs/judge", "link"),
        ("inputs/judge", "file"),
        ("inputs", "link"),
        ("steps/judge", "link"),
        ("steps/judge/job.json", "link"),
        ("steps/reason/.lock", "fifo"),
        ("steps/reason/timeline.jsonl", "link"),
        ("steps/judge/annotations.parquet", "directory"),
        ("steps/judge/annotations", "link"),
        ("report.json", "fifo"),
    ],
)
def test_an_entry_planted_for_a_later_step_is_refused_before_any_request(
    tmp_path: Path, fake_server: FakeServer, entry: str, kind: str
) -> None:
    """Every step's rows and run directory are checked before the first step sends a
    request: the run stops with one line naming the entry, no request sent, and what a
    link leads to untouched (a folder's link leads to a folder)."""
    outside = _outside(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    folder = entry in ("inputs", "inputs/judge", "steps/judge", "steps/judge/annotations")
    _plant(out / entry, kind, elsewhere if folder else outside)
    pipeline = Pipeline(_steps(_reviews(tmp_path)), out)
    outcome = _run_in_thread(pipeline, fake_server)
    assert outcome is not None, f"the run blocked on a {kind} at {entry}"
    assert isinstance(outcome, RunDirectoryError), outcome
    assert str(out / entry) in str(outcome)
    assert len(str(outcome).splitlines()) == 1
    assert fake_server.requests == []
    assert outside.read_bytes() == OUTSIDE
    assert os.listdir(elsewhere) == []


def test_a_resumed_step_reads_the_rows_it_began_with_whatever_is_left_at_old_names(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """A step begun (its run stopped) is resumed from the rows written when it began:
    a half-written file and a FIFO at the old fixed hidden names are not read, the rows
    are not written again, and nothing is sent again."""
    out = tmp_path / "run"
    pipeline = Pipeline(_steps(_reviews(tmp_path)), out)
    with VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST) as pool:
        pipeline.run(pool, progress=False, handle_signals=False)
    record = orjson.loads((out / "pipeline.json").read_bytes())
    record["steps"]["reason"]["state"] = "begun"
    (out / "pipeline.json").write_bytes(orjson.dumps(record))
    rows = (out / "inputs" / "reason.jsonl").read_bytes()
    _plant(out / "inputs" / ".reason.jsonl.partial", "file", out)
    _plant(out / "inputs" / ".judge.jsonl.partial", "fifo", out)
    sent = len(fake_server.requests)
    outcome = _run_in_thread(pipeline, fake_server)
    assert isinstance(outcome, PipelineResult), outcome
    assert [step.action for step in outcome.steps] == ["skip", "resume", "skip"]
    assert (out / "inputs" / "reason.jsonl").read_bytes() == rows
    assert len(fake_server.requests) == sent


def test_a_step_whose_rows_fail_leaves_no_temporary(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """A filter on a column no row has stops the step once its rows are read: the
    temporary they were going to is removed, and no file is left under the step's
    name."""
    steps = _steps(_reviews(tmp_path))
    steps[1] = Step("reason", "Why: {label_response}", from_step="label", where="nope == 1")
    pipeline = Pipeline(steps, tmp_path / "run")
    with (
        VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST) as pool,
        pytest.raises(ConfigurationError, match="names 'nope'"),
    ):
        pipeline.run(pool, progress=False, handle_signals=False)
    assert os.listdir(tmp_path / "run" / "inputs") == []


def test_a_corpus_step_writes_its_unit_files_whole_and_leaves_no_temporary(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Rows from a corpus go to one file per unit in inputs/NAME/, made in a folder of
    a fresh name and renamed into place; a leftover of an earlier version is removed."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_jsonl(corpus / "a.jsonl", [{"id": f"a{i}", "text": f"review {i}"} for i in range(3)])
    write_jsonl(corpus / "b.jsonl", [{"id": f"b{i}", "text": f"review {i}"} for i in range(2)])
    out = tmp_path / "run"
    (out / "inputs" / ".reason.partial").mkdir(parents=True)
    steps = [
        Step("label", "Label: {text}", data=str(corpus), id_column="id"),
        Step("reason", "Why: {label_response}", from_step="label"),
    ]
    with VLLMQueueAnnotator([fake_server.base_url], batch_size=4, **FAST) as pool:
        Pipeline(steps, out).run(pool, progress=False, handle_signals=False)
    assert os.listdir(out / "inputs") == ["reason"]
    units = sorted(os.listdir(out / "inputs" / "reason"))
    assert units == ["a.jsonl.jsonl", "b.jsonl.jsonl"]
    assert len(fake_server.requests) == 5 * 2


def test_the_command_says_one_line_naming_the_entry_and_exits_1(
    tmp_path: Path, fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _reviews(tmp_path)
    out = tmp_path / "run"
    (out / "inputs").mkdir(parents=True)
    (out / "inputs" / "reason.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    path = tmp_path / "pipeline.toml"
    path.write_text(
        f'output_dir = "{out}"\ninput = "{data}"\nid_column = "id"\n'
        f'servers = ["{fake_server.base_url}"]\n'
        '[steps.label]\nprompt_template = "Label: {text}"\n'
        '[steps.reason]\nfrom = "label"\nprompt_template = "Why: {label_response}"\n'
    )
    assert main(["pipeline", "run", str(path)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert f"{out / 'inputs' / 'reason.jsonl'} is a symbolic link" in lines[0]
    assert "Traceback" not in err
    assert fake_server.requests == []
    assert not (tmp_path / "elsewhere.jsonl").exists()
