"""The small real model (SmolLM2-135M-Instruct) on a real vLLM server: answers that
mean something, so that labels can be right or wrong.

The tiny model's answers are noise; these tests check what only a real model shows:
schema-constrained labels agree with gold labels, greedy decoding repeats itself, and
``stop`` and ``max_completion_tokens`` cut a meaningful text where they say.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import orjson
import pyarrow.parquet as pq
import pytest

from llm_annotator import VLLMOnlineClient, VLLMOnlineRuntimeOptions
from llm_annotator.local import LocalServers
from tests.cli import COMMAND

pytestmark = pytest.mark.integration

MIN_ACCURACY = 0.90
"""Measured here with vLLM CPU 0.32 on the 300 bundled reviews: 0.977 (293 of 300; among
the misses "The speaker crackles and the bass is muddy." and "A predictable plot and
wooden acting.", both labelled positive). The margin allows for another vLLM or torch
build; a broken pipeline (prompts not rendered, the schema ignored, labels shuffled)
scores about 0.5."""


def test_the_demo_labels_the_reviews_while_a_server_is_killed(
    vllm_python: str, small_model: Path, tmp_path: Path
) -> None:
    """``llm-annotator demo`` as a user runs it: 2 local servers on the small model, one
    SIGKILLed part way through. Its eviction shows live, no row is lost or doubled, every
    answer is a valid label, and most agree with the gold labels."""
    out = tmp_path / "run"
    log = tmp_path / "demo.log"
    done = subprocess.run(
        [COMMAND, "demo", "--output-dir", str(out), "--log-file", str(log)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "LLM_ANNOTATOR_VLLM_PYTHON": vllm_python},
    )
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    shown = done.stdout
    assert "killing server 2 with SIGKILL" in shown
    assert re.search(r"server 2: healthy -> evicted \(.+\); \d+ rows it had taken", shown)
    assert "300 rows in" in shown and "300 answered, 0 errors" in shown
    assert f"annotations: {out / 'annotations.parquet'}" in shown
    assert f"html report: {out / 'report.html'}" in shown  # drawn, its path printed
    assert "<svg" in (out / "report.html").read_text(encoding="utf-8")
    assert "--servers http://" in shown and "--model /path/to/model-folder" in shown
    # The eviction is said once, in words: the pool's record of it goes to the log file.
    assert "member_evicted" not in done.stderr
    events = [orjson.loads(line)["event"] for line in log.read_text(encoding="utf-8").splitlines()]
    assert "member_evicted" in events

    rows = pq.read_table(out / "annotations.parquet").to_pylist()
    assert sorted(r["id"] for r in rows) == list(range(300))  # each once, none lost
    assert all(r["error"] is None and r["valid"] for r in rows)
    # The schema's "label" is the model's; the input's own column became input_label.
    assert {r["label"] for r in rows} <= {"positive", "negative"}
    right = sum(r["label"] == r["input_label"] for r in rows)
    claimed = re.search(r"accuracy against the gold labels: (\d+)/300", shown)
    assert claimed is not None and int(claimed.group(1)) == right  # the summary is true
    per_server = Counter(r["server"] for r in rows)
    report = orjson.loads((out / "report.json").read_bytes())
    killed = re.search(r"server 2: (http://\S+)", shown)
    assert killed is not None
    assert report["per_server"][killed.group(1)]["evictions"] == 1
    assert sum(per_server.values()) == 300 and len(per_server) <= 2
    wrong = [(r["text"], r["label"]) for r in rows if r["label"] != r["input_label"]]
    print(f"accuracy {right / 300:.3f}; wrong: {wrong}")
    assert right / 300 >= MIN_ACCURACY


def test_greedy_decoding_repeats_itself(small_server: LocalServers) -> None:
    """The same conversations at temperature 0 give the same text twice."""
    messages = [
        [{"role": "user", "content": f"Write one sentence about the number {n}."}] for n in range(8)
    ]
    options = VLLMOnlineRuntimeOptions(temperature=0.0, max_completion_tokens=24)
    with VLLMOnlineClient(model="small", base_url=small_server.base_urls[0]) as client:
        first = client.batch_generate(messages=messages, options=options)
        second = client.batch_generate(messages=messages, options=options)
    assert all(r.ok and r.text for r in first)
    assert [r.text for r in first] == [r.text for r in second]


def test_stop_and_max_completion_tokens_cut_where_they_say(small_server: LocalServers) -> None:
    """Counting to ten: a stop string ends the text before it (finish reason stop), and
    a budget of 3 tokens ends it after exactly 3 (finish reason length)."""
    count = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    with VLLMOnlineClient(model="small", base_url=small_server.base_urls[0]) as client:
        free = client.generate(
            messages=count,
            options=VLLMOnlineRuntimeOptions(temperature=0.0, max_completion_tokens=60),
        )
        stopped = client.generate(
            messages=count,
            options=VLLMOnlineRuntimeOptions(temperature=0.0, max_completion_tokens=60, stop=["5"]),
        )
        short = client.generate(
            messages=count,
            options=VLLMOnlineRuntimeOptions(temperature=0.0, max_completion_tokens=3),
        )
    assert free.ok and free.text is not None and "5" in free.text, free.text
    assert stopped.ok and stopped.text is not None
    assert "5" not in stopped.text and stopped.finish_reason == "stop"
    assert free.text.startswith(stopped.text)
    assert short.finish_reason == "length" and short.num_output_tokens == 3


PREFILL_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if answer_start %}{{ answer_start }}{% endif %}{% endif %}"
)
"""SmolLM2's chat format, plus a start of the answer taken from the template's
``answer_start`` variable (SmolLM2's own template reads no variable)."""


def test_chat_template_kwargs_reach_the_template(small_server: LocalServers) -> None:
    """``chat_template_kwargs`` are variables of the chat template: here one writes the
    start of the answer, the prompt grows by it, and the model goes on from it."""
    ask = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    start = "1, 2, 3, 4, 5, 6,"
    plain = VLLMOnlineRuntimeOptions(
        temperature=0.0, max_completion_tokens=12, chat_template=PREFILL_TEMPLATE
    )
    started = VLLMOnlineRuntimeOptions(
        temperature=0.0,
        max_completion_tokens=12,
        chat_template=PREFILL_TEMPLATE,
        chat_template_kwargs={"answer_start": start},
    )
    with VLLMOnlineClient(model="small", base_url=small_server.base_urls[0]) as client:
        without = client.generate(messages=ask, options=plain)
        with_start = client.generate(messages=ask, options=started)
    assert without.ok and with_start.ok, (without.error, with_start.error)
    assert without.num_prompt_tokens is not None and with_start.num_prompt_tokens is not None
    assert with_start.num_prompt_tokens - without.num_prompt_tokens >= 6  # the start's tokens
    assert without.text is not None and without.text.lstrip().startswith("1"), without.text
    assert with_start.text is not None and with_start.text.lstrip().startswith("7"), with_start.text
