"""What the unit tests share: fast pool settings, conversations and rows, handlers for
the fake servers, and the ``llm-annotator run`` command line against one of them.

Test modules import these from here, never from one another.
"""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pyarrow.parquet as pq
from aiohttp import web

from llm_annotator import VLLMQueueAnnotator
from llm_annotator.cli import build_parser
from tests.cli import COMMAND
from tests.unit.conftest import FakeServer, echo

FAST: dict[str, Any] = {"health_check_interval": 0.2, "health_check_timeout": 0.5}
"""Pool settings that make a health check quick on loopback."""

TEMPLATE = "Label: {text}"


def conversations(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"sample {i}"}] for i in range(n)]


def index_of(request: dict[str, Any]) -> int:
    words = request["messages"][0]["content"].split()
    return int(words[1]) if len(words) > 1 and words[1].isdigit() else -1  # -1: a test completion


def delayed_echo(seconds: float) -> Any:
    """A handler that answers like ``echo`` after ``seconds``."""

    async def handle(request: dict[str, Any]) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return await echo(request)

    return handle


def assert_all_answered_in_order(responses: list[Any], n: int) -> None:
    assert len(responses) == n
    bad = [r for r in responses if not r.ok]
    assert not bad, bad[:3]
    assert [r.text for r in responses] == [f"sample {i}" for i in range(n)]


def rows(n: int) -> list[dict[str, Any]]:
    return [{"text": f"t{i}", "n": i} for i in range(n)]


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    return path


def read_output(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()  # type: ignore[no-any-return]


def sent_texts(servers: list[FakeServer]) -> Counter[str]:
    return Counter(r["messages"][-1]["content"] for s in servers for r in s.requests)


def pool_of(servers: list[FakeServer], **kwargs: Any) -> VLLMQueueAnnotator:
    return VLLMQueueAnnotator([s.base_url for s in servers], batch_size=16, **FAST, **kwargs)


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["run", *argv])


def settings(*argv: str) -> dict[str, Any]:
    from llm_annotator.cli.run import settings_from

    return settings_from(parse(*argv))


def write_rows(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"text": f"t{i}"}) + b"\n" for i in range(n)))
    return path


def command(server: FakeServer, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        COMMAND,
        "run",
        "--servers",
        server.base_url,
        "--input",
        str(data),
        "--prompt-template",
        "Label: {text}",
        "--output-dir",
        str(out),
        "--log-format",
        "json",
        "--batch-size",
        "8",
        *extra,
    ]
