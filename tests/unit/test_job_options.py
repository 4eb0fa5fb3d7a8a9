"""Every job option is declared once (``jobs.spec.OPTIONS``) and reaches every surface:
``Annotator.annotate``, ``VLLMQueueAnnotator.annotate``, ``llm-annotator run`` (or it is
declared Python-only), a pipeline step (or a pipeline refuses it by name), and the
fingerprint records exactly the options declared fingerprinted."""

from __future__ import annotations

import dataclasses
import inspect
import json
import typing
from pathlib import Path
from typing import Any

import orjson
import pytest

from llm_annotator import VLLMOnlineRuntimeOptions, VLLMQueueAnnotator
from llm_annotator.cli.pipeline import NOT_IN_PIPELINE, load_pipeline
from llm_annotator.cli.run import SETTINGS
from llm_annotator.cli.settings import READERS, SAMPLING_SETTINGS, job_keywords
from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs import spec
from llm_annotator.jobs.annotate import Annotator
from llm_annotator.jobs.shards.shard import Shard
from llm_annotator.jobs.spec import (
    ANNOTATOR_ARGS,
    OPTIONS,
    AnnotatorArgs,
    JobArgs,
    JobSpec,
    PoolJobArgs,
)
from llm_annotator.pipeline import Step
from tests.unit.conftest import FakeServer
from tests.unit.helpers import TEMPLATE, pool_of, rows, settings

_POSITIONAL = ("data", "prompt_template", "output_dir")
_PYTHON_ONLY = {name for name, option in OPTIONS.items() if option.reads is None}


def _kwargs_of(function: Any) -> set[str]:
    """The keywords of a ``**kwargs: Unpack[SomeTypedDict]`` parameter (the TypedDict
    one of ``jobs.spec``; a module may import it for type checking only)."""
    (kwargs,) = (
        p for p in inspect.signature(function).parameters.values() if p.kind is p.VAR_KEYWORD
    )
    unpacked = typing.get_args(eval(kwargs.annotation, vars(spec), {"Unpack": typing.Unpack}))[0]
    return set(unpacked.__annotations__)


def test_every_spec_field_is_one_declared_option_with_its_default() -> None:
    """JobSpec's fields past the three positional ones are the declared options, in
    order, each carrying its declaration and taking its default from it; JobArgs
    types the same keywords."""
    fields = dataclasses.fields(JobSpec)
    assert tuple(f.name for f in fields[:3]) == _POSITIONAL
    assert [f.name for f in fields[3:]] == list(OPTIONS)
    for field in fields[3:]:
        assert field.metadata["option"] is OPTIONS[field.name]
        assert field.default == OPTIONS[field.name].default, field.name
    assert set(JobArgs.__annotations__) == set(OPTIONS)


def test_annotator_annotate_takes_every_option(tmp_path: Path) -> None:
    """``Annotator.annotate`` types every option as a keyword, and its spec takes each."""
    assert _kwargs_of(Annotator.annotate) == set(OPTIONS)
    assert _kwargs_of(Annotator.aannotate) == set(OPTIONS)
    every = {name: option.default for name, option in OPTIONS.items()}
    spec = JobSpec.of(rows(1), TEMPLATE, tmp_path, every)
    assert {name: getattr(spec, name) for name in OPTIONS} == every
    for line in ("            " + name + " (" for name in OPTIONS):
        assert line in (Annotator.annotate.__doc__ or ""), line


def test_the_pool_takes_every_option_and_every_annotator_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``VLLMQueueAnnotator.annotate`` keeps its three positional arguments, takes the
    job options and the Annotator's own settings (``flush_interval`` and
    ``sync_interval`` included) as keywords, and hands each on."""
    annotator_keywords = {
        name
        for name, parameter in typing.get_type_hints(Annotator.__init__).items()
        if name not in ("client", "return", "batch_size", "max_concurrent_batches")
    }
    assert set(AnnotatorArgs.__annotations__) == annotator_keywords == ANNOTATOR_ARGS
    assert set(PoolJobArgs.__annotations__) == set(OPTIONS) | ANNOTATOR_ARGS
    assert _kwargs_of(VLLMQueueAnnotator.annotate) == set(OPTIONS) | ANNOTATOR_ARGS
    assert _kwargs_of(VLLMQueueAnnotator.aannotate) == set(OPTIONS) | ANNOTATOR_ARGS
    for method, named in (
        (VLLMQueueAnnotator.annotate, ()),
        (VLLMQueueAnnotator.aannotate, ("stop",)),
    ):
        parameters = list(inspect.signature(method).parameters.values())[1:-1]
        assert [p.name for p in parameters] == [*_POSITIONAL, *named], method
        assert [p.kind for p in parameters[:3]] == [inspect.Parameter.POSITIONAL_OR_KEYWORD] * 3
    seen: dict[str, Any] = {}

    def record(self: Annotator, data: Any, template: str, out: Any, **job: Any) -> None:
        seen.update(job, runner=self)

    monkeypatch.setattr(Annotator, "annotate", record)
    made: dict[str, Any] = {
        "progress": False,
        "stop_grace": 1.5,
        "flush_interval": 3.0,
        "sync_interval": 4.0,
        "metrics_port": 0,
        "metrics_host": "127.0.0.2",
        "timeline": False,
    }
    job = {name: f"<{name}>" for name in OPTIONS}
    pool = VLLMQueueAnnotator(["http://127.0.0.1:9/v1"])
    try:
        pool.annotate(rows(1), TEMPLATE, tmp_path, **made, **job)  # type: ignore[arg-type]
    finally:
        pool.close()
    runner = seen.pop("runner")
    assert seen == job
    assert {name: getattr(runner, name) for name in made} == made


_SAMPLES: dict[str, tuple[list[str], Any]] = {
    "text": (["some-text"], "some-text"),
    "texts": (["a", "b"], ["a", "b"]),
    "bool": ([], True),
    "count": (["3"], 3),
    "positive_int": (["4"], 4),
    "seed": (["-5"], -5),
    "seconds": (["30"], 30.0),
    "size": (["64M"], 64 * 2**20),
    "retry_errors": (["server_error"], ["server_error"]),
    "hook": (["json:loads"], json.loads),
    "shard": (["1/2"], Shard.parse("1/2")),
}
"""For each kind of setting: what its flag is given, and what the job receives."""


def test_every_option_has_a_run_flag_or_is_declared_python_only(tmp_path: Path) -> None:
    """Each option the command line reads has a row of ``run``'s settings (its flag,
    help and default from its declaration); given on the command line, it reaches the
    job as the option's value. The others are declared Python-only."""
    assert set(_SAMPLES) == set(READERS)
    rows_of = {setting.flag: setting for setting in SETTINGS}
    argv = ["--servers", "http://127.0.0.1:9/v1", "--input", "d.jsonl"]
    argv += ["--prompt-template", TEMPLATE, "--output-dir", str(tmp_path)]
    argv += ["--temperature", "0.5", "--seed", "9"]
    expected: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        if option.reads is None:
            assert option.setting is None and not option.flag_help, name
            continue
        if option.reads == "sampling":
            assert set(SAMPLING_SETTINGS) <= set(rows_of), name
            expected[name] = VLLMOnlineRuntimeOptions(temperature=0.5, seed=9)
            continue
        assert option.setting is not None
        row = rows_of[option.setting]
        assert (row.kind, row.help, row.default) == (
            READERS[option.reads],
            option.flag_help,
            option.default,
        ), name
        given, expected[name] = _SAMPLES[option.reads]
        argv += ["--" + option.setting.replace("_", "-"), *given]
    keywords = job_keywords(settings(*argv))
    assert keywords == expected
    assert set(keywords) | _PYTHON_ONLY == set(OPTIONS)
    JobSpec.of(rows(1), TEMPLATE, tmp_path, keywords)  # every keyword is the job's


def _pipeline(tmp_path: Path, step: str) -> Path:
    path = tmp_path / "pipeline.toml"
    path.write_text(
        f'output_dir = "{tmp_path / "run"}"\n'
        'servers = ["http://127.0.0.1:9/v1"]\n'
        f'[steps.one]\ninput = "{tmp_path / "d.jsonl"}"\nprompt_template = "{{text}}"\n' + step
    )
    return path


_TOML = {
    "text": ('"some-text"', "some-text"),
    "texts": ('["a", "b"]', ["a", "b"]),
    "bool": ("true", True),
    "count": ("3", 3),
    "retry_errors": ('["server_error"]', ["server_error"]),
    "hook": ('"json:loads"', json.loads),
}
"""For each kind of setting a step takes: its value in a pipeline file, and the step's."""


def test_every_option_is_a_step_setting_or_refused_by_a_pipeline(tmp_path: Path) -> None:
    """An option a step takes is a Step field of the same default, handed to the step's
    job, and a step of a pipeline file sets it; any other is no Step field, and a
    pipeline file that sets it is refused by name."""
    step_fields = {field.name: field for field in dataclasses.fields(Step)}
    step = Step("one", "{text}", data="d.jsonl")
    allowed = {name for name, option in OPTIONS.items() if option.in_step}
    assert set(step.job_args()) == allowed
    lines, expected = [], {}
    for name, option in OPTIONS.items():
        if not option.in_step:
            assert name not in step_fields, name
            if option.setting is not None:
                assert option.setting in NOT_IN_PIPELINE, name
                with pytest.raises(ConfigurationError, match=f"steps.one.{option.setting} "):
                    load_pipeline(_pipeline(tmp_path, f"{option.setting} = 1\n"))
            continue
        assert step_fields[name].default == option.default, name
        if option.setting is not None and option.reads is not None:
            text, expected[name] = _TOML[option.reads]
            lines.append(f"{option.setting} = {text}\n")
    built = load_pipeline(_pipeline(tmp_path, "".join(lines))).pipeline.steps[0]
    assert {name: getattr(built, name) for name in expected} == expected


def _check(answer: str) -> str:
    return answer


def _extend(row: dict[str, Any], answer: Any) -> dict[str, Any]:
    return {"extended": True}


_PROBES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "system_message": ({"system_message": "Be brief."}, {}),
    "id_column": ({"id_column": "n"}, {}),
    "options": ({"options": VLLMOnlineRuntimeOptions(temperature=0.5)}, {}),
    "gen_kwargs": ({"gen_kwargs": {"top_k": 5}}, {}),
    "columns": ({"columns": ["text"]}, {}),
    "retry_errors": ({"retry_errors": True}, {}),
    "force": ({"force": True}, {}),
    "write_jsonl": ({"write_jsonl": True}, {}),
    "max_regenerations": ({"max_regenerations": 5}, {}),
    "limit": ({"limit": 2}, {}),
    "shuffle_seed": ({"limit": 2, "shuffle_seed": 1}, {"limit": 2}),
    "validate": ({"validate": _check}, {}),
    "group_by": ({"group_by": "text"}, {}),
    "postprocess": ({"postprocess": _extend}, {}),
}
"""For each option one job in memory can take: the options of a job that sets it, and
of the same job without it."""
_NOT_PROBED = {"shard", "skip_bad_files", "claim_lease", "unit_size"}
"""Options of a corpus or of several processes, which no such job takes."""


def test_the_fingerprint_records_the_options_declared_fingerprinted(
    tmp_path: Path, fake_server: FakeServer
) -> None:
    """Setting an option changes the fingerprint in ``job.json`` exactly when the option
    is declared fingerprinted."""
    assert set(_PROBES) | _NOT_PROBED == set(OPTIONS)
    assert not any(OPTIONS[name].fingerprinted for name in _NOT_PROBED)

    def fingerprint(run: Path, **job: Any) -> Any:
        with pool_of([fake_server]) as pool:
            pool.annotate(rows(4), TEMPLATE, run, progress=False, **job)
        return orjson.loads((run / "job.json").read_bytes())["fingerprint"]

    baseline = fingerprint(tmp_path / "baseline")
    for name, (given, without) in _PROBES.items():
        before = fingerprint(tmp_path / f"{name}-without", **without) if without else baseline
        after = fingerprint(tmp_path / name, **given)
        assert (after != before) is OPTIONS[name].fingerprinted, name
