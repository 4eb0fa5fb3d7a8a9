"""Several answers per prompt: one request with ``n`` against ``n`` requests, on vLLM.

A pipeline step with ``n = K`` sends each row's prompt K times, one request per answer,
so that each answer is a row stored once like any other. vLLM also takes ``n`` in one
request. This script measures, side by side on one real vLLM server (the small model,
on CPUs, prefix caching on), what the two cost for P prompts of about 300 tokens:

* ``one request, n=K``: P requests, each asking K answers;
* ``K requests, n=1``: P x K requests (what a step with ``n`` sends).

Every answer is exactly ``--tokens`` tokens long (``min_tokens`` = ``max_tokens``), so
both generate the same. Figures: wall time, and the prompt tokens the server computed
(from its ``/metrics``: prefix-cache queries minus hits). Each round uses prompts no
other round used; the cases alternate over ``--rounds`` rounds, as the machine is noisy.
Requests are sent by plain HTTP, at most ``--concurrency`` at a time, in both cases.

    python benchmarks/n_answers.py                         # starts a server (about 3 min)
    python benchmarks/n_answers.py --url http://127.0.0.1:8000/v1 --model small
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from llm_annotator.clients.metrics import engine_load
from llm_annotator.local import ensure_small_model, find_vllm_python, start_local_servers

WORDS = [
    "river",
    "stone",
    "market",
    "lantern",
    "harbor",
    "orchard",
    "signal",
    "copper",
    "meadow",
    "window",
    "ledger",
    "basket",
    "engine",
    "garden",
    "timber",
    "canyon",
    "violet",
    "thunder",
    "compass",
    "pepper",
    "marble",
]


@dataclass
class Figures:
    seconds: float = 0.0
    computed: float = 0.0
    answers: int = 0


def prompts(count: int, seed: int) -> list[str]:
    """``count`` prompts of about 300 tokens, each its own (a word of the round's own)."""
    rng = random.Random(seed)
    return [
        f"Round {seed} note {i}: "
        + " ".join(rng.choice(WORDS) for _ in range(220))
        + "\nWrite a one-line title for this note."
        for i in range(count)
    ]


async def run_case(url: str, model: str, texts: list[str], n: int, tokens: int, limit: int) -> int:
    """Ask ``n`` answers to each prompt: one request with ``n``, or ``n`` requests."""
    gate = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def ask(text: str, k: int) -> int:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": text}],
                "n": k,
                "temperature": 1.0,
                "max_tokens": tokens,
                "min_tokens": tokens,
            }
            async with gate:
                response = await client.post("/chat/completions", json=body)
            response.raise_for_status()
            return len(response.json()["choices"])

        if n > 1:
            counts = await asyncio.gather(*(ask(text, n) for text in texts))
        else:
            counts = await asyncio.gather(*(ask(text, 1) for text in texts))
    return sum(counts)


def computed(url: str) -> float:
    load = engine_load(httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).content)
    if load is None:
        raise SystemExit(f"{url}: its /metrics has no vLLM engine figures")
    return (load.prefix_cache_queries or 0.0) - (load.prefix_cache_hits or 0.0)


@contextlib.contextmanager
def server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    python = find_vllm_python()
    model = ensure_small_model(python=python)
    with start_local_servers(
        1, model, python=python, max_model_len=1024, extra_args=["--enable-prefix-caching"]
    ) as servers:
        yield servers.base_urls[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    with server(args.url) as url:
        totals = {"one request, n=K": Figures(), "K requests, n=1": Figures()}
        seed = 0
        for _ in range(args.rounds):
            for name, figures in totals.items():
                seed += 1
                texts = prompts(args.prompts, seed)
                if name.startswith("K requests"):
                    texts = [text for text in texts for _ in range(args.n)]
                n = args.n if name.startswith("one request") else 1
                before, started = computed(url), time.perf_counter()
                figures.answers += asyncio.run(
                    run_case(url, args.model, texts, n, args.tokens, args.concurrency)
                )
                figures.seconds += time.perf_counter() - started
                figures.computed += computed(url) - before
    print(
        f"{args.prompts} prompts of about 300 tokens x {args.n} answers of {args.tokens} "
        f"tokens, {args.rounds} rounds, 1 vLLM server (small model, CPU, prefix caching)\n"
    )
    print(f"{'case':<20} {'seconds':>8} {'answers/s':>10} {'prompt tokens computed':>23}")
    for name, figures in totals.items():
        print(
            f"{name:<20} {figures.seconds:>8.1f} {figures.answers / figures.seconds:>10.1f} "
            f"{figures.computed:>23,.0f}"
        )
    one, many = totals.values()
    print(
        f"\nK requests / one request: {many.seconds / one.seconds:.2f}x the time, "
        f"{many.computed / max(one.computed, 1):.2f}x the prompt tokens computed"
    )


if __name__ == "__main__":
    main()
