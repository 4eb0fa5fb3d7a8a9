"""Prefix affinity against today's dispatch, on real vLLM servers with prefix caching.

Annotation prompts share long prefixes: here, documents of about 400 tokens each asked
several questions, in a shuffled input (a document's questions lie far apart). vLLM
caches prefixes per server, so a document computed on one server is nearly free there
and paid again on another. This script runs the same job (``VLLMQueueAnnotator.annotate``
with the template's first field, the document, as the default group) side by side:

* ``one server``: all rows to one server alone: the hit rate the cache reaches when
  every document meets it (the reference);
* ``2 servers, affinity off``: today's dispatch;
* ``2 servers, affinity on``: ``prefix_affinity=True`` (with the template's static
  text sent to each server once first);
* the same two over *unique* prompts (every row its own document, as many rows as
  there are documents): what affinity costs when there is nothing to share.

Each case uses documents no earlier case used (a word of its own in each), so no case
finds another's prefixes cached. Figures come from the servers' own ``/metrics``
(``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``, in tokens), read before
and after each case: the hit rate, the prompt tokens the servers computed (queried
minus hit), and the rows per second of the job (wall time, one run per case: compare
only within one run of the script).

The *document part* of the hit rate leaves out the template's static text (the same
for every row): hits less what a row with a document of its own hits (measured by the
unique-prompt case without affinity), over queries less the static text's tokens.
vLLM caches whole blocks only: on this CPU backend a block is 128 tokens (on GPUs
usually 16), so the static text here (about 100 tokens) is never cached on its own,
and of a document only its whole blocks are.

The servers run the small real model (SmolLM2-135M-Instruct) in float32 on CPUs with
a 6 GiB KV cache each (about 140,000 tokens: every document of the full run fits one
server's cache), one compute thread each. Run it as (about 20 and 6 minutes)::

    python benchmarks/prefix_affinity.py            # 200 documents x 5 questions
    python benchmarks/prefix_affinity.py --quick    # 40 documents x 5 questions
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from llm_annotator import VLLMOnlineClient, VLLMOnlineRuntimeOptions, VLLMQueueAnnotator
from llm_annotator.clients.metrics import engine_load
from llm_annotator.local import ensure_small_model, find_vllm_python, start_local_servers

INSTRUCTIONS = (
    "You are a careful annotator. You will read a document taken from a field report "
    "and answer one question about it. Answer with a single word taken from the "
    "document, in lower case, with no punctuation and no explanation. If the document "
    "does not say, answer unknown. Do not repeat the question. Do not add a greeting."
)
TEMPLATE = INSTRUCTIONS + "\n\nDocument:\n{document}\n\nQuestion: {question}"
QUESTIONS = [
    "Which place is named first?",
    "Which tool is named last?",
    "Which colour comes up most?",
    "Which animal is named?",
    "Which season is it?",
    "Which river is named?",
    "Which metal is named?",
]
WORDS = [
    "the",
    "river",
    "stone",
    "garden",
    "window",
    "letter",
    "silver",
    "morning",
    "harbor",
    "lantern",
    "field",
    "road",
    "village",
    "copper",
    "autumn",
    "winter",
    "spring",
    "summer",
    "horse",
    "falcon",
    "hammer",
    "chisel",
    "rope",
    "barrel",
    "north",
    "south",
    "east",
    "west",
    "bridge",
    "tower",
    "market",
    "orchard",
    "meadow",
    "forest",
    "valley",
    "hill",
    "lake",
    "red",
    "blue",
    "green",
    "yellow",
    "grey",
    "white",
    "black",
    "amber",
    "cold",
    "warm",
    "wet",
    "dry",
    "early",
    "late",
    "quiet",
]
OPTIONS = VLLMOnlineRuntimeOptions(max_completion_tokens=4, temperature=0.0)
DOCUMENT_WORDS = 300
"""Words a document has: about 400 tokens of the small model's tokenizer."""


@dataclass
class Case:
    name: str
    servers: int
    affinity: bool
    unique: bool


@dataclass
class Figures:
    rows: int
    seconds: float
    queries: float
    hits: float
    per_server: list[float | None]

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def computed(self) -> float:
        return self.queries - self.hits


def rows_of(documents: int, questions: int, *, unique: bool, seed: int) -> list[dict[str, Any]]:
    """The rows of one case: ``documents x questions`` rows over shared documents, or as
    many rows each with a document of its own; shuffled."""
    draw = random.Random(seed)
    salt = f"{seed:08x}"
    rows = []
    count = documents

    def document(d: int) -> str:
        return f"Report {salt}-{d}. " + " ".join(draw.choice(WORDS) for _ in range(DOCUMENT_WORDS))

    for d in range(count):
        text = document(d)
        for q in range(1 if unique else questions):
            question = QUESTIONS[(d + q) % len(QUESTIONS)]
            rows.append({"id": f"{d}-{q}", "document": text, "question": question})
    draw.shuffle(rows)
    return rows


def read_counters(urls: list[str]) -> list[tuple[float, float] | None]:
    """Each server's prefix-cache counters (queries, hits) in tokens, or None."""
    counters: list[tuple[float, float] | None] = []
    for url in urls:
        body = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).content
        load = engine_load(body)
        if load is None or load.prefix_cache_queries is None or load.prefix_cache_hits is None:
            counters.append(None)
        else:
            counters.append((load.prefix_cache_queries, load.prefix_cache_hits))
    return counters


def run_case(case: Case, urls: list[str], rows: list[dict[str, Any]], folder: Path) -> Figures:
    data = folder / f"{case.name}.jsonl"
    data.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    used = urls[: case.servers]
    before = read_counters(used)
    with VLLMQueueAnnotator(used, prefix_affinity=case.affinity) as pool:
        started = time.perf_counter()
        result = pool.annotate(
            data, TEMPLATE, folder / case.name, id_column="id", options=OPTIONS, progress=False
        )
        seconds = time.perf_counter() - started
    if result.num_failed:
        raise SystemExit(f"{case.name}: {result.num_failed} rows failed")
    after = read_counters(used)
    queries = hits = 0.0
    per_server: list[float | None] = []
    for was, now in zip(before, after, strict=True):
        if was is None or now is None:
            raise SystemExit("a server's /metrics has no prefix-cache counters")
        queries += now[0] - was[0]
        hits += now[1] - was[1]
        per_server.append((now[1] - was[1]) / max(now[0] - was[0], 1.0))
    return Figures(len(rows), seconds, queries, hits, per_server)


def static_tokens(url: str) -> int:
    """Prompt tokens of the template's text before its first field, as the chat template
    wraps it (less the few tokens that open the assistant's turn, which every prompt
    has after its own text rather than here)."""
    with VLLMOnlineClient(base_url=url) as client:
        response = client.generate(
            messages=[{"role": "user", "content": TEMPLATE.split("{document}")[0]}],
            options=VLLMOnlineRuntimeOptions(max_completion_tokens=1),
        )
    return max(0, (response.num_prompt_tokens or 0) - 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 documents, not 200")
    parser.add_argument("--documents", type=int, default=None)
    parser.add_argument("--questions", type=int, default=5)
    args = parser.parse_args()
    documents = args.documents or (40 if args.quick else 200)
    questions = args.questions
    python = find_vllm_python()
    model = ensure_small_model(python=python)
    cases = [
        Case("one server", 1, False, False),
        Case("2 servers, affinity off", 2, False, False),
        Case("2 servers, affinity on", 2, True, False),
        Case("unique prompts, affinity off", 2, False, True),
        Case("unique prompts, affinity on", 2, True, True),
    ]
    print(
        f"{documents} documents of about 400 tokens x {questions} questions, shuffled; "
        f"2 vLLM servers (small model, CPU, prefix caching on)",
        flush=True,
    )
    with (
        tempfile.TemporaryDirectory(prefix="prefix-affinity-") as scratch,
        start_local_servers(
            2,
            model,
            python=python,
            max_model_len=1024,
            kv_cache_gib=6,
            extra_args=["--enable-prefix-caching"],
        ) as servers,
    ):
        urls = servers.base_urls
        static = static_tokens(urls[0])
        results: list[tuple[Case, Figures]] = []
        for seed, case in enumerate(cases, start=1):
            rows = rows_of(documents, questions, unique=case.unique, seed=seed)
            figures = run_case(case, urls, rows, Path(scratch))
            results.append((case, figures))
            print(f"  {case.name}: {figures.seconds:.1f} s", file=sys.stderr, flush=True)
    unique_off = results[3][1]
    static_hits = unique_off.hits / unique_off.rows  # what a row hits with nothing shared

    def document_part(figures: Figures) -> float:
        hits = figures.hits - static_hits * figures.rows
        return hits / max(figures.queries - static * figures.rows, 1.0)

    print(
        f"static prefix: about {static} tokens a prompt, of which {static_hits:.0f} found "
        "cached by a row with nothing else shared\n"
    )
    header = (
        f"{'case':<30} {'rows/s':>7} {'hit rate':>9} {'document part':>14} "
        f"{'tokens computed':>16} {'per server hit rate':>22}"
    )
    print(header)
    print("-" * len(header))
    for case, figures in results:
        document_rate = document_part(figures)
        spread = " / ".join("-" if r is None else f"{100 * r:.0f}%" for r in figures.per_server)
        print(
            f"{case.name:<30} {figures.rows_per_second:>7.1f} {100 * figures.hit_rate:>8.1f}% "
            f"{100 * document_rate:>13.1f}% {figures.computed:>16,.0f} {spread:>22}"
        )
    one = results[0][1]
    on = results[2][1]
    print(
        f"\ndocument-part hit rate, affinity on / one server: "
        f"{document_part(on) / max(document_part(one), 1e-9):.2f} (target >= 0.90)"
    )
    print(
        f"rows/s on unique prompts, affinity on / off: "
        f"{results[4][1].rows_per_second / results[3][1].rows_per_second:.2f} (target >= 1.00 "
        "within noise)"
    )
    print(
        f"rows/s on shared documents, affinity on / off: "
        f"{on.rows_per_second / results[1][1].rows_per_second:.2f}"
    )


if __name__ == "__main__":
    main()
