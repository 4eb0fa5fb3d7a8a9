"""The in-process client on the real CPU build of vLLM, against a real server.

vLLM lives in its own Python, so the offline client runs there, in a subprocess
(``offline_probe.py`` or ``python -m llm_annotator.cli``), with this package and the
packages it lacks beside it (:func:`llm_annotator.local.inprocess.annotator_environment`).

What is checked: the promise of VLLMBaseRuntimeOptions (the engine's sampling parameters
built by the offline client equal the server's, option by option, and greedy decoding
gives the same text request by request), the options that end or shape an answer, and a
whole job in process killed with SIGKILL and resumed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from llm_annotator import VLLMOnlineClient, VLLMOnlineRuntimeOptions
from llm_annotator.local import LocalServers
from llm_annotator.local.inprocess import CPU_ENGINE_ENV, annotator_environment

pytestmark = pytest.mark.integration

PROBE = Path(__file__).with_name("offline_probe.py")
LABEL_SCHEMA = {
    "type": "object",
    "properties": {"sentiment": {"enum": ["positive", "negative"]}},
    "required": ["sentiment"],
}
# Every field of VLLMBaseRuntimeOptions, alone and in the combinations that have a rule
# of their own (extra_body merged last, a schema over a structured_outputs block).
PARAM_CASES: list[dict[str, Any]] = [
    {},
    {"temperature": 0.0},
    {"temperature": 0.8},
    {"top_p": 0.5},
    {"top_k": 5},
    {"top_k": -1},
    {"repetition_penalty": 1.2},
    {"presence_penalty": 0.5},
    {"frequency_penalty": -0.5},
    {"stop": [".", "\n"]},
    {"seed": 7},
    {"max_completion_tokens": 9},
    {"output_schema": LABEL_SCHEMA},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"extra_body": {"min_p": 0.1}},
    {"extra_body": {"stop_token_ids": [5]}},
    {"extra_body": {"ignore_eos": True, "min_tokens": 2}},
    {"temperature": 0.9, "extra_body": {"temperature": 0.3}},
    {
        "output_schema": LABEL_SCHEMA,
        "extra_body": {
            "structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": True}
        },
    },
    {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 10,
        "repetition_penalty": 1.1,
        "stop": ["!"],
        "seed": 1,
        "max_completion_tokens": 30,
    },
]


@pytest.fixture(scope="module")
def in_vllm(vllm_python: str) -> dict[str, str]:
    """The environment under which the vLLM Python imports this package, with the
    settings a CPU engine needs (as for the local servers)."""
    env = dict(os.environ)
    env.update(annotator_environment(vllm_python))
    env.update(CPU_ENGINE_ENV)
    return env


def probe(
    python: str, env: dict[str, str], args: list[str], cases: list[Any], timeout: float
) -> Any:
    done = subprocess.run(
        [python, str(PROBE), *args],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def model_with_defaults(small_model: Path, folder: Path) -> Path:
    """The small model's configuration with sampling defaults in its
    generation_config.json, as many released models have (no weights: only the
    configuration is read)."""
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(small_model / name, folder / name)
    (folder / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": 1,
                "eos_token_id": 2,
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 100,
            }
        )
    )
    return folder


@pytest.mark.parametrize("defaults", ["none", "generation_config"])
def test_sampling_params_equal_the_servers_option_by_option(
    vllm_python: str, in_vllm: dict[str, str], small_model: Path, tmp_path: Path, defaults: str
) -> None:
    """For each case, the SamplingParams vLLM's server builds from the online client's
    body equal the offline client's, on every field that decides the decoding; with and
    without the model's own defaults."""
    model = small_model if defaults == "none" else model_with_defaults(small_model, tmp_path / "m")
    results = probe(vllm_python, in_vllm, ["params", str(model)], PARAM_CASES, timeout=300)
    assert len(results) == len(PARAM_CASES)
    differing = {json.dumps(r["case"]): r["differ"] for r in results if r["differ"]}
    assert not differing, f"offline and server sampling parameters differ: {differing}"
    assert all(r["compared"] >= 30 for r in results)
    if defaults == "generation_config":
        assert results[0]["defaults"]["temperature"] == 0.6
        # The comparison sees a difference where there is one: the same options built
        # without the model's defaults differ from the server's wherever the case
        # leaves a defaulted field unset.
        assert set(results[0]["control_differ"]) == {
            "temperature",
            "top_p",
            "top_k",
            "repetition_penalty",
        }
        # Greedy decoding (temperature 0) makes vLLM drop top_p and top_k itself.
        assert results[1]["control_differ"] == ["repetition_penalty"]


SHOUT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if shout %} Answer in capital letters.{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _review(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Is this review positive or negative? {text}"}]


# Greedy decoding, each option that ends or shapes an answer.
GREEDY_CASES: list[dict[str, Any]] = [
    {"messages": _review("The food was awful and cold."), "options": {"max_completion_tokens": 24}},
    {"messages": _review("Absolutely loved it."), "options": {"max_completion_tokens": 5}},
    {"messages": _review("Great value."), "options": {"max_completion_tokens": 40, "stop": ["."]}},
    {
        "messages": _review("The speaker crackles."),
        "options": {
            "max_completion_tokens": 20,
            "output_schema": LABEL_SCHEMA,
            "extra_body": {
                "structured_outputs": {"json": LABEL_SCHEMA, "disable_any_whitespace": True}
            },
        },
    },
    {
        "messages": [
            {"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": "What colour is the sky?"},
        ],
        "options": {"max_completion_tokens": 16, "repetition_penalty": 1.3},
    },
    # A chat template of the request's own, then the same with a template argument
    # that changes the prompt (the server takes both with --trust-request-chat-template).
    {
        "messages": _review("Great value."),
        "options": {"max_completion_tokens": 12, "chat_template": SHOUT_TEMPLATE},
    },
    {
        "messages": _review("Great value."),
        "options": {
            "max_completion_tokens": 12,
            "chat_template": SHOUT_TEMPLATE,
            "chat_template_kwargs": {"shout": True},
        },
    },
    # No limit: the answer runs to its end of sequence or to the context's end.
    {"messages": [{"role": "user", "content": "Say hello."}], "options": {}},
    # More than the prompt leaves of the context: the server lowers the limit to what
    # is left, the engine stops there by itself.
    {
        "messages": _review("Fine."),
        "options": {"max_completion_tokens": 500, "extra_body": {"ignore_eos": True}},
    },
    # More than the whole context: refused by both (400 on the server).
    {"messages": _review("Fine."), "options": {"max_completion_tokens": 5000}},
]


def test_greedy_answers_equal_a_servers_request_by_request(
    vllm_python: str, in_vllm: dict[str, str], small_model: Path, small_server: LocalServers
) -> None:
    """Same model folder, same dtype and context, temperature 0, one request at a
    time on each side: the same text, finish reason and token counts."""
    cases = [{**case, "options": {"temperature": 0.0, **case["options"]}} for case in GREEDY_CASES]
    with VLLMOnlineClient(base_url=small_server.base_urls[0], on_error="ignore") as client:
        online = [
            client.generate(
                messages=case["messages"], options=VLLMOnlineRuntimeOptions(**case["options"])
            )
            for case in cases
        ]
    offline = probe(
        vllm_python, in_vllm, ["generate", str(small_model), "float32", "512"], cases, timeout=600
    )
    for case, server, local in zip(cases[:-1], online, offline, strict=False):
        assert local["error"] is None and server.ok, (local, server)
        seen = {
            "text": local["text"],
            "finish_reason": local["finish_reason"],
            "num_prompt_tokens": local["num_prompt_tokens"],
            "num_output_tokens": local["num_output_tokens"],
        }
        expected = {
            "text": server.text,
            "finish_reason": server.finish_reason,
            "num_prompt_tokens": server.num_prompt_tokens,
            "num_output_tokens": server.num_output_tokens,
        }
        assert seen == expected, case
    # The options did what they say, on both sides alike.
    assert online[1].num_output_tokens == 5 and online[1].finish_reason == "length"
    assert "." not in (online[2].text or "") and online[2].finish_reason == "stop"
    assert json.loads(online[3].text or "")["sentiment"] in ("positive", "negative")
    plain, shouted = online[5], online[6]
    assert (plain.num_prompt_tokens or 0) < (shouted.num_prompt_tokens or 0)
    assert online[8].finish_reason == "length"
    assert (online[8].num_prompt_tokens or 0) + (online[8].num_output_tokens or 0) == 512
    assert online[9].error_type == offline[9]["error_type"] == "bad_request"
    assert "max_model_len=512" in (online[9].error or "") and "max_model_len=512" in (
        offline[9]["error"] or ""
    )


def _rows(path: Path, n: int) -> Path:
    reviews = ["I loved it.", "It broke on day one.", "Great service.", "Cold food."]
    with path.open("wb") as file:
        for i in range(n):
            file.write(orjson.dumps({"id": f"r{i:04d}", "text": reviews[i % 4]}) + b"\n")
    return path


def _written(run: Path) -> list[str]:
    ids = []
    for shard in sorted((run / "shards").glob("*.jsonl")):
        for line in shard.read_bytes().split(b"\n"):
            try:
                ids.append(orjson.loads(line)["id"])
            except orjson.JSONDecodeError:
                continue  # empty, or the last line cut by the kill
    return ids


def test_a_job_in_process_killed_and_resumed_writes_each_id_once(
    vllm_python: str, in_vllm: dict[str, str], small_model: Path, tmp_path: Path
) -> None:
    """``llm-annotator run --offline-model`` under the vLLM Python, SIGKILLed once a
    fifth of its rows are written: the engine's processes go with it, and the run
    again sends only the rest; the output has each id once, every one answered."""
    n = 160
    data = _rows(tmp_path / "reviews.jsonl", n)
    run = tmp_path / "run"
    args = [
        vllm_python,
        "-m",
        "llm_annotator.cli",
        "run",
        "--offline-model",
        str(small_model),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--enforce-eager",  # as the local servers run: a start in seconds
        "--input",
        str(data),
        "--id-column",
        "id",
        "--prompt-template",
        "Is this review positive or negative? {text}",
        "--output-schema",
        str(_schema_file(tmp_path)),
        "--max-completion-tokens",
        "32",
        "--temperature",
        "0",
        "--batch-size",
        "16",
        "--max-concurrent-batches-per-client",
        "2",
        "--output-dir",
        str(run),
        "--log-format",
        "json",
    ]
    log = tmp_path / "first.log"
    with log.open("wb") as sink:
        first = subprocess.Popen(
            args,
            stdout=sink,
            stderr=sink,
            stdin=subprocess.DEVNULL,
            env=in_vllm,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while len(_written(run)) < n // 5:
            assert first.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        _wait_group_gone(first.pid, timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
        _kill_group(first.pid)
    done_before = _written(run)
    assert len(done_before) == len(set(done_before))
    assert n // 5 <= len(done_before) < n

    second = subprocess.run(
        args,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=in_vllm,
        timeout=600,
        check=False,
    )
    assert second.returncode == 0, second.stderr[-4000:]
    report = orjson.loads((run / "report.json").read_bytes())
    assert report["this_run"]["resumed_rows"] == len(done_before)
    assert report["this_run"]["sent_rows"] == n - len(done_before)
    table = pq.read_table(run / "annotations.parquet").to_pylist()
    assert [row["id"] for row in table] == [f"r{i:04d}" for i in range(n)]
    assert all(row["error"] is None for row in table), [r for r in table if r["error"]][:2]
    assert {row["sentiment"] for row in table} <= {"positive", "negative"}


def _schema_file(folder: Path) -> Path:
    path = folder / "schema.json"
    path.write_text(json.dumps(LABEL_SCHEMA))
    return path


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_group_gone(pgid: int, timeout: float) -> None:
    """The engine's processes end once the process that started them is killed."""
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        assert time.monotonic() < deadline, "vLLM's engine outlived the killed job"
        time.sleep(0.2)


def _kill_group(pgid: int) -> None:
    if _group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)
