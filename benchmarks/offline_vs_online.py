"""In-process vLLM (VLLMOfflineClient) against one local vLLM server, on the same model.

The small real model (SmolLM2-135M-Instruct, built once into the cache) with the same
engine settings on both sides: float32, a 512-token context, eager mode, 128 sequences
and 2,048 tokens a step, one unpinned compute thread (as the project's local servers
run). Each round runs both ways, one after the
other so they never share the CPUs, in an order that alternates from round to round:

* online: ``start_local_servers(1, "small")``, then one ``VLLMOnlineClient`` sends the N
  conversations with ``batch_generate`` (all in flight at once), then the server stops;
* offline: a subprocess under the vLLM Python builds a ``VLLMOfflineClient`` and sends
  the same N conversations with ``batch_generate``.

Timed: the N answers, from the first request to the last answer; the engine's start-up
is shown apart. Requests are greedy (temperature 0) with ``max_completion_tokens`` 16,
so both sides decode the same tokens; the summary also gives how many answers were the
same text on both sides (the batches differ, so a few may not). Each run shows the
share of the machine's CPUs busy meanwhile, whoever used them.

Run it as::

    python benchmarks/offline_vs_online.py            # N=400, 2 rounds, about 4 minutes
    python benchmarks/offline_vs_online.py --quick    # N=100, 1 round, about 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import busy_seconds, cpu_count
from llm_annotator import VLLMOnlineClient, VLLMOnlineRuntimeOptions
from llm_annotator.local import (
    ensure_small_model,
    find_vllm_python,
    start_local_servers,
)
from llm_annotator.local.inprocess import CPU_ENGINE_ENV, annotator_environment

REVIEWS = [
    "The food was awful and cold.",
    "Absolutely loved it, I would order again tomorrow.",
    "The speaker crackles and the bass is muddy.",
    "Fast delivery and the fit is perfect.",
    "It stopped working after two days.",
]
OPTIONS: dict[str, Any] = {"temperature": 0.0, "max_completion_tokens": 16}

# The engine's batch limits, set on both sides (the server's and the in-process
# engine's defaults differ on CPUs: 128 / 2048 and 256 / 4096).
SERVER_ARGS = ("--max-num-seqs", "128", "--max-num-batched-tokens", "2048")

_OFFLINE_WORKER = textwrap.dedent(
    """
    import json, os, sys, time

    def busy():
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
        return (sum(ticks) - ticks[3] - ticks[4] - sum(ticks[8:10])) / os.sysconf("SC_CLK_TCK")

    def main():
        from llm_annotator import VLLMOfflineClient, VLLMOfflineRuntimeOptions
        spec = json.load(sys.stdin)
        began = time.perf_counter()
        with VLLMOfflineClient(
            spec["model"], dtype="float32", max_model_len=512,
            max_num_seqs=128,
            engine_kwargs={"enforce_eager": True, "max_num_batched_tokens": 2048},
        ) as client:
            ready, busy_before = time.perf_counter(), busy()
            responses = client.batch_generate(
                messages=spec["conversations"],
                options=VLLMOfflineRuntimeOptions(**spec["options"]),
            )
            done, busy_after = time.perf_counter(), busy()
        print("RESULT " + json.dumps({
            "startup": ready - began,
            "seconds": done - ready,
            "texts": [r.text for r in responses],
            "errors": sum(not r.ok for r in responses),
            "busy": busy_after - busy_before,
        }), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def conversations(count: int) -> list[list[dict[str, str]]]:
    return [
        [
            {
                "role": "user",
                "content": f"Is review {i} positive or negative? {REVIEWS[i % len(REVIEWS)]}",
            }
        ]
        for i in range(count)
    ]


def run_online(model: Path, python: str, convs: list[Any]) -> dict[str, Any]:
    began = time.perf_counter()
    options = VLLMOnlineRuntimeOptions(**OPTIONS)
    with tempfile.TemporaryDirectory() as logs:
        servers = start_local_servers(
            1, model, python=python, log_dir=Path(logs), extra_args=list(SERVER_ARGS)
        )
        with servers, VLLMOnlineClient(base_url=servers.base_urls[0]) as client:
            client.batch_generate(messages=convs[:1], options=options)  # model discovery
            ready, busy_before = time.perf_counter(), busy_seconds()
            responses = client.batch_generate(messages=convs, options=options)
            done, busy_after = time.perf_counter(), busy_seconds()
    return {
        "startup": ready - began,
        "seconds": done - ready,
        "texts": [r.text for r in responses],
        "errors": sum(not r.ok for r in responses),
        "busy": (busy_after or 0.0) - (busy_before or 0.0),
    }


def run_offline(model: Path, python: str, env: dict[str, str], convs: list[Any]) -> dict[str, Any]:
    spec = {"model": str(model), "conversations": convs, "options": OPTIONS}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(_OFFLINE_WORKER)
    try:
        done = subprocess.run(
            [python, script.name],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            env=env,
            timeout=900,
            check=False,
        )
    finally:
        os.unlink(script.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the offline worker failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="N=100, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.rounds = 100, 1
    python = find_vllm_python()
    model = ensure_small_model(python=python)
    env = {**os.environ, **annotator_environment(python), **CPU_ENGINE_ENV}
    convs = conversations(args.samples)
    print(f"{args.samples} conversations, {OPTIONS}, small model, float32, context 512")
    print(
        f"{'round':>5} {'way':8} {'start s':>8} {'rows/s':>8} {'s':>7} "
        f"{'CPUs busy %':>11} {'errors':>6}"
    )
    rates: dict[str, list[float]] = {"online": [], "offline": []}
    texts: dict[str, list[Any]] = {}
    for round_ in range(args.rounds):
        order = ["online", "offline"] if round_ % 2 == 0 else ["offline", "online"]
        for way in order:
            if way == "online":
                result = run_online(model, python, convs)
            else:
                result = run_offline(model, python, env, convs)
            rate = args.samples / result["seconds"]
            rates[way].append(rate)
            texts[way] = result["texts"]
            busy = 100 * result["busy"] / (result["seconds"] * cpu_count())
            print(
                f"{round_ + 1:>5} {way:8} {result['startup']:>8.1f} {rate:>8.1f} "
                f"{result['seconds']:>7.1f} {busy:>11.0f} {result['errors']:>6}"
            )
    same = sum(a == b for a, b in zip(texts["online"], texts["offline"], strict=True))
    online, offline = statistics.median(rates["online"]), statistics.median(rates["offline"])
    print(f"\nmedian rows/s: online {online:.1f}, offline {offline:.1f} ({offline / online:.2f}x)")
    print(f"same text on both sides: {same} of {args.samples}")


if __name__ == "__main__":
    main()
