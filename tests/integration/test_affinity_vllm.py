"""Prefix affinity on real vLLM servers: a job's documents each go to one server, the
servers' own prefix-cache counters show it in the job's report, and a server stopped
mid-run hands its documents to the other with every row answered once.

The two shared tiny-model servers keep their caches between tests, so every test's
documents carry a word of their own (nothing here is cached before the test).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
import pytest

from llm_annotator import VLLMOnlineRuntimeOptions, VLLMQueueAnnotator
from llm_annotator.local import LocalServers
from tests.integration.test_jobs_vllm import wait_until_idle

pytestmark = pytest.mark.integration

TEMPLATE = (
    "You answer questions about a document in one word. Read it closely.\n\n"
    "Document:\n{document}\n\nQuestion: {question}"
)
OPTIONS = VLLMOnlineRuntimeOptions(max_completion_tokens=2, temperature=0.0)
WORDS = ["river", "stone", "garden", "window", "letter", "silver", "morning", "harbor"]


def documents(count: int, questions: int, *, seed: int) -> list[dict[str, Any]]:
    """``count`` documents of 40 words (each with a word of this call alone),
    ``questions`` rows each, shuffled so that a document's rows lie far apart."""
    salt = uuid.uuid4().hex
    draw = random.Random(seed)
    rows = []
    for d in range(count):
        text = f"{salt} document {d}: " + " ".join(draw.choice(WORDS) for _ in range(40))
        for q in range(questions):
            rows.append({"id": f"d{d}-q{q}", "doc": d, "document": text, "question": f"q{q}?"})
    draw.shuffle(rows)
    return rows


def test_a_jobs_documents_each_go_to_one_server_and_the_report_shows_the_cache(
    vllm_servers: LocalServers, tmp_path: Path
) -> None:
    """40 documents of 4 questions over the two servers with ``prefix_affinity``: every
    row once, nearly every document answered by one server, and report.json gives each
    server's prefix-cache hit rate from its ``/metrics``."""
    wait_until_idle(vllm_servers)
    rows = documents(40, 4, seed=1)
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    with VLLMQueueAnnotator(vllm_servers.base_urls, prefix_affinity=True) as pool:
        result = pool.annotate(
            data, TEMPLATE, tmp_path / "run", id_column="id", options=OPTIONS, progress=False
        )
        stats = pool.statistics()
    assert result.num_failed == 0
    table = pq.read_table(tmp_path / "run" / "annotations.parquet").to_pylist()
    assert sorted(r["id"] for r in table) == sorted(r["id"] for r in rows)
    servers_of: dict[int, set[str]] = defaultdict(set)
    for record in table:
        servers_of[record["doc"]].add(record["server"])
    on_one = sum(len(servers) == 1 for servers in servers_of.values())
    assert on_one >= 0.8 * len(servers_of), dict(servers_of)
    assert {r["server"] for r in table} == set(vllm_servers.base_urls)  # both worked
    report = orjson.loads((tmp_path / "run" / "report.json").read_bytes())
    for url in vllm_servers.base_urls:
        member = stats.member(url)
        assert member.prefix_cache_queries and member.prefix_cache_hits is not None
        assert 0 < report["per_server"][url]["prefix_cache_hit_rate"] <= 1
    # 3 of every 4 rows find their document cached, and every row its instructions.
    hits = sum(m.prefix_cache_hits or 0 for m in stats.members)
    queries = sum(m.prefix_cache_queries or 0 for m in stats.members)
    assert hits / queries > 0.5, (hits, queries)


def test_a_stopped_servers_documents_go_to_the_other(vllm_servers: LocalServers) -> None:
    """SIGSTOP one server once it has answered some rows and a quarter of the stream is
    done, with affinity: it is evicted, the documents it had begun are finished by the
    other, and every row comes back exactly once. (A server may join a second or two
    after the other, on a busy machine: the stop waits for its first answers.)"""
    wait_until_idle(vllm_servers)
    rows = documents(100, 8, seed=2)
    victim = vllm_servers[1]
    stopped_at: float | None = None
    answered: dict[str, str] = {}
    late: list[str] = []
    """Rows answered after the stop."""

    def victims_answers() -> int:
        return sum(server == victim.base_url for server in answered.values())

    async def scenario() -> None:
        nonlocal stopped_at
        samples = [(r["id"], [{"role": "user", "content": TEMPLATE.format(**r)}]) for r in rows]
        doc_of = {r["id"]: r["doc"] for r in rows}
        async with VLLMQueueAnnotator(
            vllm_servers.base_urls, prefix_affinity=True, batch_size=32, hedge_tail=False
        ) as pool:
            async for key, response in pool.astream(samples, options=OPTIONS, group=doc_of.get):
                assert response.ok, response.error
                assert key not in answered
                answered[key] = response.server or ""
                if stopped_at is not None:
                    late.append(key)
                elif len(answered) >= len(rows) // 4 and victims_answers() >= 10:
                    victim.pause()
                    stopped_at = time.monotonic()
            assert stopped_at is not None, "the second server answered under 10 rows in all"
            assert pool.statistics().member(victim.base_url).evictions == 1

    try:
        asyncio.run(scenario())
    finally:
        victim.resume()
        victim.wait_healthy(timeout=120)
    assert sorted(answered) == sorted(r["id"] for r in rows)
    doc_of = {r["id"]: r["doc"] for r in rows}
    before = {doc_of[key] for key, server in answered.items() if server == victim.base_url}
    after = {doc_of[key] for key in late}
    assert before & after, "no document begun on the stopped server was finished elsewhere"
