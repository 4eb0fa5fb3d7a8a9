"""VLLMOfflineClient against a stand-in for vLLM's engine (the real one runs in
tests/integration/test_offline_vllm.py): ordering, per-sample errors, a shared
continuous batch, cancelling, a dying engine, closing, and the options' sampling rule."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, ClassVar

import pyarrow.parquet as pq
import pytest

from llm_annotator import (
    Annotator,
    ConfigurationError,
    ProviderError,
    VLLMBaseRuntimeOptions,
    VLLMOfflineClient,
    VLLMOfflineRuntimeOptions,
)
from llm_annotator.cli import main
from llm_annotator.clients._sampling import sampling_kwargs
from llm_annotator.clients.vllm_offline_client import engine_arguments


class FakeSamplingParams:
    __struct_fields__: ClassVar[tuple[str, ...]] = (
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "max_tokens",
        "structured_outputs",
        "ignore_eos",
    )

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.max_tokens = kwargs.get("max_tokens")

    @classmethod
    def from_optional(cls, **kwargs: Any) -> FakeSamplingParams:
        return cls(**kwargs)

    def clone(self) -> FakeSamplingParams:
        return FakeSamplingParams(**self.kwargs)


@dataclasses.dataclass
class FakeStructured:
    json: Any = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


@dataclasses.dataclass
class FakeCompletion:
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: Any = None


@dataclasses.dataclass
class FakeOutput:
    request_id: str
    outputs: list[FakeCompletion]
    prompt_token_ids: list[int]
    finished: bool = True


class FakeEngine:
    """Answers each request after ``steps`` engine steps; records what it held."""

    def __init__(self, steps: int = 3) -> None:
        self.steps = steps
        self.requests: dict[str, tuple[list[dict[str, str]], Any, int]] = {}
        self.aborted: list[str] = []
        self.max_held = 0
        self.fail_with: BaseException | None = None
        self.shut_down = False
        self.engine_core = types.SimpleNamespace(shutdown=self._shutdown)
        self.lock = threading.Lock()

    def _shutdown(self) -> None:
        self.shut_down = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def abort_request(self, ids: list[str]) -> None:
        for request_id in ids:
            self.aborted.append(request_id)
            self.requests.pop(request_id, None)

    def step(self) -> list[FakeOutput]:
        if self.fail_with is not None:
            raise self.fail_with
        time.sleep(0.001)
        self.max_held = max(self.max_held, len(self.requests))
        done = []
        for request_id, (conversation, params, left) in list(self.requests.items()):
            if left > 1:
                self.requests[request_id] = (conversation, params, left - 1)
                continue
            del self.requests[request_id]
            text = "echo: " + conversation[-1]["content"]
            tokens = params.kwargs.get("max_tokens") or 5
            done.append(
                FakeOutput(
                    request_id,
                    [FakeCompletion(text, list(range(tokens)), "length", None)],
                    list(range(len(conversation[-1]["content"]))),
                )
            )
        return done


class FakeLLM:
    instances: ClassVar[list[FakeLLM]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.llm_engine = FakeEngine()
        self.model_config = types.SimpleNamespace(
            get_diff_sampling_param=lambda: {"temperature": 0.6, "top_p": 0.95},
            max_model_len=512,
        )
        self.counter = 0
        self.chats: list[dict[str, Any]] = []
        FakeLLM.instances.append(self)

    def enqueue_chat(
        self, conversations: list[Any], params: Any, use_tqdm: bool, **chat: Any
    ) -> list[str]:
        (conversation,) = conversations
        if "too long" in conversation[-1]["content"]:
            raise ValueError("This model's maximum context length is 512 tokens")
        self.chats.append(chat)
        request_id = str(self.counter)
        self.counter += 1
        self.llm_engine.requests[request_id] = (conversation, params, self.llm_engine.steps)
        return [f"{request_id}-a1b2c3d4"]  # the engine's suffixed id


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> type[FakeLLM]:
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM  # type: ignore[attr-defined]
    module.sampling_params = types.SimpleNamespace(  # type: ignore[attr-defined]
        SamplingParams=FakeSamplingParams, StructuredOutputsParams=FakeStructured
    )
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances.clear()
    return FakeLLM


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_a_batch_is_answered_in_order_with_token_counts(fake_vllm: type[FakeLLM]) -> None:
    with VLLMOfflineClient("/models/m", max_model_len=512, served_model_name="m") as client:
        responses = client.batch_generate(
            messages=[_user(f"row {i}") for i in range(20)],
            options=VLLMOfflineRuntimeOptions(max_completion_tokens=7),
        )
    assert [r.text for r in responses] == [f"echo: row {i}" for i in range(20)]
    assert all(r.num_output_tokens == 7 and r.finish_reason == "length" for r in responses)
    assert responses[3].num_prompt_tokens == len("row 3")
    assert {r.model for r in responses} == {"m"}
    assert {r.provider for r in responses} == {"vllm_offline"}
    assert fake_vllm.instances[0].kwargs["max_model_len"] == 512


def test_one_failed_sample_is_one_error_response(fake_vllm: type[FakeLLM]) -> None:
    with VLLMOfflineClient("/models/m", on_error="ignore") as client:
        responses = client.batch_generate(messages=[_user("a"), _user("too long"), _user("b")])
    assert [r.ok for r in responses] == [True, False, True]
    assert responses[1].error_type == "bad_request"
    assert "maximum context length" in (responses[1].error or "")


def test_more_tokens_than_the_context_is_refused_as_by_a_server(
    fake_vllm: type[FakeLLM],
) -> None:
    with VLLMOfflineClient("/models/m", on_error="ignore") as client:
        responses = client.batch_generate(
            messages=[_user("a"), _user("b")],
            options=VLLMOfflineRuntimeOptions(max_completion_tokens=513),
        )
    assert [r.error_type for r in responses] == ["bad_request", "bad_request"]
    assert "max_model_len=512" in (responses[0].error or "")
    assert not fake_vllm.instances[0].llm_engine.aborted


def test_on_error_raise_raises_the_sample_error(fake_vllm: type[FakeLLM]) -> None:
    with (
        VLLMOfflineClient("/models/m", on_error="raise") as client,
        pytest.raises(ProviderError, match="maximum context length") as caught,
    ):
        client.generate(messages=_user("too long"))
    assert caught.value.kind.value == "bad_request"


def test_concurrent_calls_share_one_continuous_batch(fake_vllm: type[FakeLLM]) -> None:
    """Requests of calls made at once are in the engine together, as on a server."""

    async def run(client: VLLMOfflineClient) -> list[Any]:
        return await asyncio.gather(
            *(
                client.abatch_generate(messages=[_user(f"{b}-{i}") for i in range(10)])
                for b in range(4)
            )
        )

    with VLLMOfflineClient("/models/m") as client:
        fake_vllm.instances[0].llm_engine.steps = 50
        batches = asyncio.run(run(client))
    assert [len(b) for b in batches] == [10, 10, 10, 10]
    assert fake_vllm.instances[0].llm_engine.max_held == 40


def test_a_cancelled_call_aborts_its_requests(fake_vllm: type[FakeLLM]) -> None:
    async def run(client: VLLMOfflineClient, engine: FakeEngine) -> None:
        task = asyncio.ensure_future(client.abatch_generate(messages=[_user("x"), _user("y")]))
        for _ in range(200):  # bounded: the driver takes them within milliseconds
            if len(engine.requests) == 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if len(engine.aborted) == 2:
                break
            await asyncio.sleep(0.01)

    with VLLMOfflineClient("/models/m") as client:
        engine = fake_vllm.instances[0].llm_engine
        engine.steps = 10**9  # never answers
        asyncio.run(run(client, engine))
        assert sorted(engine.aborted) == ["0", "1"]  # the ids they were added under
        assert not engine.requests


def test_a_dead_engine_raises_rather_than_answering_errors(fake_vllm: type[FakeLLM]) -> None:
    """With no engine every later request would fail too: the call raises (whatever
    on_error says), so a job stops instead of writing error rows to the end."""
    with VLLMOfflineClient("/models/m", on_error="ignore") as client:
        assert client.is_healthy()
        fake_vllm.instances[0].llm_engine.fail_with = RuntimeError("EngineCore died")
        with pytest.raises(ProviderError, match="EngineCore died") as first:
            client.batch_generate(messages=[_user("a"), _user("b")])
        with pytest.raises(ProviderError, match="run the same job again") as later:
            client.generate(messages=_user("c"))
        assert not client.is_healthy()
    assert first.value.kind.value == later.value.kind.value == "engine_dead"


def test_a_job_stops_when_the_engine_dies_and_resumes_on_a_new_one(
    fake_vllm: type[FakeLLM], tmp_path: Path
) -> None:
    rows = [{"id": f"r{i:03d}", "text": f"t{i}"} for i in range(200)]
    run = tmp_path / "run"
    with VLLMOfflineClient("/models/m", served_model_name="m") as client:
        engine = fake_vllm.instances[0].llm_engine
        real_step = engine.step
        answered = 0

        def dying_step() -> list[FakeOutput]:
            nonlocal answered
            if answered >= 50:
                raise RuntimeError("EngineCore died")
            outputs = real_step()
            answered += len(outputs)
            return outputs

        engine.step = dying_step  # type: ignore[method-assign]
        with pytest.raises(ProviderError, match="EngineCore died"):
            Annotator(client, batch_size=10, max_concurrent_batches=1, progress=False).annotate(
                rows, "Say {text}", run, id_column="id", handle_signals=False
            )
    with VLLMOfflineClient("/models/m", served_model_name="m") as client:
        result = Annotator(client, batch_size=10, progress=False).annotate(
            rows, "Say {text}", run, id_column="id", handle_signals=False
        )
    assert result.num_resumed >= 40
    assert result.num_succeeded == 200 and result.num_failed == 0
    table = pq.read_table(result.output_path).to_pylist()
    assert [r["id"] for r in table] == [r["id"] for r in rows]


def test_close_releases_the_engine_once(fake_vllm: type[FakeLLM]) -> None:
    client = VLLMOfflineClient("/models/m", on_error="ignore")
    engine = fake_vllm.instances[0].llm_engine
    client.close()
    client.close()
    assert engine.shut_down
    assert not client.is_healthy()
    with pytest.raises(ProviderError, match="closed"):
        client.generate(messages=_user("a"))


def test_online_and_base_options_work_in_process(fake_vllm: type[FakeLLM]) -> None:
    """A step moves between the clients with its options as they are."""
    from llm_annotator import VLLMOnlineRuntimeOptions

    with VLLMOfflineClient("/models/m") as client:
        online = client.generate(
            messages=_user("a"),
            options=VLLMOnlineRuntimeOptions(max_completion_tokens=3, add_generation_prompt=False),  # type: ignore[arg-type]
        )
        base = client.generate(
            messages=_user("b"),
            options=VLLMBaseRuntimeOptions(max_completion_tokens=4),  # type: ignore[arg-type]
        )
    assert (online.num_output_tokens, base.num_output_tokens) == (3, 4)
    assert fake_vllm.instances[0].chats[0]["add_generation_prompt"] is False


def test_chat_options_reach_the_chat_renderer(fake_vllm: type[FakeLLM]) -> None:
    options = VLLMOfflineRuntimeOptions(
        chat_template_kwargs={"enable_thinking": False},
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    with VLLMOfflineClient("/models/m") as client:
        client.generate(messages=_user("a"), options=options)
    (chat,) = fake_vllm.instances[0].chats
    assert chat == {
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def test_an_unknown_engine_parameter_is_refused_by_name(fake_vllm: type[FakeLLM]) -> None:
    with (
        VLLMOfflineClient("/models/m") as client,
        pytest.raises(ConfigurationError, match="no parameter banana"),
    ):
        client.generate(
            messages=_user("a"), options=VLLMOfflineRuntimeOptions(extra_body={"banana": 1})
        )


@pytest.mark.parametrize("key", ["detokenize", "output_kind", "extra_args"])
def test_engine_bookkeeping_fields_are_refused(key: str) -> None:
    with pytest.raises(ConfigurationError, match=f"extra_body sets {key}"):
        sampling_kwargs(VLLMBaseRuntimeOptions(extra_body={key: False}), {})


def test_without_vllm_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"llm-annotator\[offline\]"):
        VLLMOfflineClient("/models/m")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"seed": "1"}, "seed"),
        ({"engine_kwargs": {"dtype": "half"}}, "engine_kwargs sets dtype"),
    ],
)
def test_engine_settings_out_of_range_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        engine_arguments("/models/m", **kwargs)


def test_engine_arguments_leave_unset_settings_to_vllm() -> None:
    assert engine_arguments(
        "/m", enable_prefix_caching=False, seed=3, engine_kwargs={"enforce_eager": True}
    ) == {
        "model": "/m",
        "tensor_parallel_size": 1,
        "dtype": "auto",
        "enable_prefix_caching": False,
        "seed": 3,
        "enforce_eager": True,
    }


_SCHEMA = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}}


@pytest.mark.parametrize(
    ("options", "defaults", "expected"),
    [
        # A value the request sets wins over the model's default and the OpenAI one.
        (VLLMBaseRuntimeOptions(temperature=0.0), {"temperature": 0.6}, {"temperature": 0.0}),
        # Unset: the model's default (generation_config.json) ...
        (VLLMBaseRuntimeOptions(), {"temperature": 0.6, "top_k": 20}, {"temperature": 0.6}),
        (VLLMBaseRuntimeOptions(), {"top_k": 20}, {"top_k": 20}),
        # ... else the OpenAI default.
        (VLLMBaseRuntimeOptions(), {}, {"temperature": 1.0, "top_p": 1.0, "top_k": 0}),
        (VLLMBaseRuntimeOptions(), {}, {"max_tokens": None, "n": 1, "stop_token_ids": None}),
        (VLLMBaseRuntimeOptions(max_completion_tokens=9), {}, {"max_tokens": 9}),
        (VLLMBaseRuntimeOptions(stop=["\n"], seed=4), {}, {"stop": ["\n"], "seed": 4}),
        # extra_body is merged last, as into a server request's body.
        (VLLMBaseRuntimeOptions(extra_body={"min_p": 0.1}), {}, {"min_p": 0.1}),
        (
            VLLMBaseRuntimeOptions(temperature=0.5, extra_body={"temperature": 0.0}),
            {},
            {"temperature": 0.0},
        ),
        (
            VLLMBaseRuntimeOptions(max_completion_tokens=9, extra_body={"max_tokens": 3}),
            {},
            {"max_tokens": 3},
        ),
        # The model's stop tokens follow the request's, each once.
        (
            VLLMBaseRuntimeOptions(extra_body={"stop_token_ids": [5, 7]}),
            {"stop_token_ids": [7, 9]},
            {"stop_token_ids": [5, 7, 9]},
        ),
        # A schema is the engine's json constraint and overrides a structured_outputs one.
        (
            VLLMBaseRuntimeOptions(
                output_schema=_SCHEMA,
                extra_body={
                    "structured_outputs": {
                        "json": {"type": "string"},
                        "disable_any_whitespace": True,
                    }
                },
            ),
            {},
            {"structured_outputs": {"json": _SCHEMA, "disable_any_whitespace": True}},
        ),
        (
            VLLMBaseRuntimeOptions(extra_body={"response_format": {"type": "json_object"}}),
            {},
            {"structured_outputs": {"json_object": True}},
        ),
        # extra_body's response_format replaces output_schema's, as in a server body.
        (
            VLLMBaseRuntimeOptions(
                output_schema=_SCHEMA, extra_body={"response_format": {"type": "text"}}
            ),
            {},
            {"structured_outputs": None},
        ),
        # No limit asked: the model's own (max_new_tokens), as on the server.
        (VLLMBaseRuntimeOptions(), {"max_tokens": 64}, {"max_tokens": 64}),
        (VLLMBaseRuntimeOptions(max_completion_tokens=9), {"max_tokens": 64}, {"max_tokens": 9}),
    ],
)
def test_sampling_follows_the_servers_rule(
    options: VLLMBaseRuntimeOptions, defaults: dict[str, Any], expected: dict[str, Any]
) -> None:
    built = sampling_kwargs(options, defaults)
    assert {key: built.get(key) for key in expected} == expected


def test_an_annotator_job_runs_in_process(fake_vllm: type[FakeLLM], tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "text": f"t{i}"} for i in range(300)]
    with VLLMOfflineClient("/models/m", served_model_name="m") as client:
        result = Annotator(client, batch_size=32, progress=False).annotate(
            rows, "Say {text}", tmp_path / "run", id_column="id", handle_signals=False
        )
    table = pq.read_table(result.output_path).to_pylist()
    assert result.num_succeeded == 300
    assert sorted(r["id"] for r in table) == sorted(r["id"] for r in rows)
    assert {r["id"]: r["response"] for r in table}["r7"] == "echo: Say t7"


def _run_args(tmp_path: Path, *extra: str) -> list[str]:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(f'{{"text": "t{i}"}}\n' for i in range(50)))
    return [
        "run",
        "--input",
        str(data),
        "--prompt-template",
        "Say {text}",
        "--output-dir",
        str(tmp_path / "run"),
        "--log-format",
        "json",
        *extra,
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--offline-model", "/m", "--servers", "http://127.0.0.1:9/v1"],
            "drop --servers, or drop --offline-model",
        ),
        (["--servers", "http://127.0.0.1:9/v1", "--dtype", "float32"], "give --offline-model"),
        (["--offline-model", "/m", "--timeout", "30", "--no-hedge-tail"], "drop --timeout"),
        ([], "or --offline-model DIR"),
    ],
)
def test_the_command_refuses_offline_settings_that_do_not_go_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(_run_args(tmp_path, *extra)) == 1
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_a_wrong_input_is_refused_before_the_engine_loads(
    fake_vllm: type[FakeLLM], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _run_args(tmp_path, "--offline-model", "/models/m")
    args[args.index("--input") + 1] = str(tmp_path / "missing.jsonl")
    assert main(args) == 1
    assert "cannot read the input file" in capsys.readouterr().err
    assert not fake_vllm.instances


def test_the_command_without_vllm_says_what_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main(_run_args(tmp_path, "--offline-model", str(tmp_path))) == 1
    err = capsys.readouterr().err
    assert "pip install 'llm-annotator[offline]'" in err
    assert "Traceback" not in err


def test_the_command_runs_a_job_in_process(
    fake_vllm: type[FakeLLM], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _run_args(
        tmp_path,
        "--offline-model",
        "/models/m",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",
    )
    assert main(args) == 0
    assert "50 succeeded" in capsys.readouterr().out
    (llm,) = fake_vllm.instances
    assert llm.kwargs == {
        "model": "/models/m",
        "tensor_parallel_size": 1,
        "dtype": "float32",
        "max_model_len": 512,
        "enforce_eager": True,
    }
    assert llm.llm_engine.shut_down


_REAPED_PARENT = """
import subprocess, sys, time
from llm_annotator.clients._reaper import descendants, start_reaper
before = descendants()
engine = subprocess.Popen(["sleep", "600"])
reaper = start_reaper(before)
if sys.argv[1] == "release":
    reaper.release()
print("PID", engine.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("close", ["sigkill", "release"])
def test_the_engines_processes_die_with_a_killed_parent(close: str) -> None:
    """A process holding an engine is SIGKILLed: what the engine started goes too; a
    closed engine's reaper leaves everything alone."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _REAPED_PARENT, close], stdout=subprocess.PIPE, text=True
    )
    engine_pid = 0
    try:
        assert parent.stdout is not None
        engine_pid = next(int(line.split()[1]) for line in parent.stdout if line.startswith("PID "))
        assert _alive(engine_pid)
        parent.kill()
        parent.wait(timeout=10)
        # Long enough for the reaper to act (it does within milliseconds).
        deadline = time.monotonic() + (10 if close == "sigkill" else 2)
        while _alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(engine_pid) == (close == "release")
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if parent.stdout is not None:
            parent.stdout.close()
        if engine_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine_pid, signal.SIGKILL)
