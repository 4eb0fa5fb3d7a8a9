"""``llm-annotator pipeline run|describe``: a TOML file of steps, checked whole before
anything runs, run over a fake server, described, overridden with ``--set``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from llm_annotator.cli import main
from tests.unit.conftest import FakeServer, completion
from tests.unit.helpers import write_jsonl


async def _answers(request: dict[str, Any]) -> web.StreamResponse:
    prompt = request["messages"][-1]["content"]
    if prompt.startswith("Label: "):
        return completion("negative" if int(prompt.rsplit(" ", 1)[1]) % 2 else "positive")
    return completion(f"answer to {prompt}")


def _file(tmp_path: Path, server: FakeServer | None, steps: str, top: str = "") -> Path:
    write_jsonl(tmp_path / "reviews.jsonl", [{"id": f"r{i}", "text": f"r {i}"} for i in range(6)])
    url = server.base_url if server is not None else "http://127.0.0.1:9/v1"
    path = tmp_path / "pipeline.toml"
    path.write_text(
        f'output_dir = "{tmp_path / "run"}"\n'
        f'input = "{tmp_path / "reviews.jsonl"}"\n'
        'id_column = "id"\n'
        f'servers = ["{url}"]\n' + top + "\n" + steps
    )
    return path


_STEPS = """
[steps.label]
prompt_template = "Label: {text}"

[steps.reason]
from = "label"
where = "label_response == 'negative'"
prompt_template = "Why: {text}"

[steps.judge]
from = "reason"
prompt_template = "Judge: {reason_response}"
"""


def _run(*argv: str) -> int:
    return main(["pipeline", *argv])


@pytest.mark.parametrize(
    ("steps", "said"),
    [
        (
            _STEPS.replace('prompt_template = "Why', 'promt_template = "Why'),
            "unknown setting steps.reason.promt_template",
        ),
        (
            _STEPS.replace('from = "reason"', 'from = "reasons"'),
            "reads from_step 'reasons', which is not a step; the steps are label, reason, judge",
        ),
        (
            _STEPS.replace("[steps.label]\n", '[steps.label]\nfrom = "judge"\n'),
            "steps read each other in a cycle: label -> judge -> reason -> label",
        ),
        (
            _STEPS.replace('where = "label_response', 'where = "len(label_response)'),
            "a call (len(label_response)) is not allowed",
        ),
        (
            _STEPS + '\nshard = "0/2"\n',
            "steps.judge.shard is a setting of llm-annotator run that a pipeline does not take",
        ),
        (
            _STEPS.replace("[steps.judge]", '[steps.judge]\nserver_group = "big"'),
            "steps.judge.server_group 'big' is not a [server_groups.NAME] table",
        ),
        (
            _STEPS.replace("[steps.judge]", '[steps.judge]\nserver_group = ["a"]'),
            "steps.judge.server_group must be a group's name",
        ),
        (
            _STEPS.replace("[steps.label]", "[steps.label]\ninput = []"),
            "steps.label.input must be a path or a list of paths",
        ),
        ("force = true\n" + _STEPS, "force is not a setting of the file: give --force"),
        (
            _STEPS.replace("[steps.judge]", "[steps.judge]\nn = 0"),
            "step 'judge': n must be an integer >= 1",
        ),
    ],
)
def test_a_bad_file_is_one_line_naming_the_step_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], steps: str, said: str
) -> None:
    path = _file(tmp_path, None, steps)
    for action in ("run", "describe"):
        assert _run(action, str(path)) == 1
        err = capsys.readouterr().err
        assert said in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_set_naming_no_step_is_refused_with_the_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _file(tmp_path, None, _STEPS)
    assert _run("run", str(path), "--set", "reasons.n=2") == 1
    assert "'reasons' is not a step of" in capsys.readouterr().err


def test_run_describe_and_a_changed_step_refused_then_forced(
    tmp_path: Path, fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The file runs its three steps; describe says each is done; a --set that changes
    the second step is refused, naming the third; --force redoes the two."""
    fake_server.handler = _answers
    path = _file(tmp_path, fake_server, _STEPS)
    assert _run("run", str(path)) == 0
    out = capsys.readouterr().out
    assert "step label: done: 6 rows (6 succeeded, 0 failed)" in out
    assert "step reason: done: 3 rows" in out and "step judge: done: 3 rows" in out
    assert len(fake_server.requests) == 12
    assert _run("describe", str(path)) == 0
    out = capsys.readouterr().out
    assert "label: reads the dataset" in out
    assert "reason: reads the rows of step label where label_response == 'negative'" in out
    assert out.count("done: 3 of 3 rows; a run would skip it") == 2
    changed = ("--set", "reason.prompt_template='Why now: {text}'")
    assert _run("run", str(path), *changed) == 1
    err = capsys.readouterr().err
    assert "step reason changed since it ran (prompt_template:" in err
    assert "(judge) would be redone too" in err
    assert len(fake_server.requests) == 12
    assert _run("describe", str(path), *changed) == 0
    assert "a run would redo it (reads step reason, whose rows change)" in capsys.readouterr().out
    assert _run("run", str(path), *changed, "--force") == 0
    assert "step label: skipped, done before: 6 rows" in capsys.readouterr().out
    assert len(fake_server.requests) == 18
    reason = pq.read_table(tmp_path / "run" / "steps" / "reason" / "annotations.parquet")
    assert {r.startswith("answer to Why now") for r in reason.column("response").to_pylist()} == {
        True
    }
    report = orjson.loads((tmp_path / "run" / "report.json").read_bytes())
    assert [s["action"] for s in report["steps"]] == ["skip", "redo", "redo"]
    assert main(["report", str(tmp_path / "run")]) == 0
    page = (tmp_path / "run" / "report.html").read_text()
    for step in ("label", "reason", "judge"):
        assert f"<h2>Step {step}</h2>" in page
    assert "<td>reason</td><td>the rows of step label where" in page


def test_generation_and_hooks_from_the_file(
    tmp_path: Path, fake_server: FakeServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.handler = _answers
    (tmp_path / "hooks.py").write_text(
        "def keep_odd(row):\n"
        "    return row if row['prompt_id'] % 2 else None\n"
        "def size(row, answer):\n"
        "    return {'size': len(answer)}\n"
    )
    steps = f"""
[steps.ideas]
prompt = "Name a fruit."
copies = 4
n = 2

[steps.more]
from = "ideas"
prompt_template = "More about: {{ideas_response}}"
preprocess = "{tmp_path / "hooks.py"}:keep_odd"
postprocess = "{tmp_path / "hooks.py"}:size"
"""
    path = _file(tmp_path, fake_server, steps)
    assert _run("run", str(path), "--steps", "ideas,more") == 0, capsys.readouterr().err
    ideas = pq.read_table(tmp_path / "run" / "steps" / "ideas" / "annotations.parquet")
    assert sorted(ideas.column("id").to_pylist()) == sorted(
        f"{p}:{a}" for p in range(4) for a in range(2)
    )
    more = pq.read_table(tmp_path / "run" / "steps" / "more" / "annotations.parquet").to_pylist()
    assert sorted(r["id"] for r in more) == ["1:0", "1:1", "3:0", "3:1"]
    assert all(r["size"] == len(r["response"]) for r in more)
