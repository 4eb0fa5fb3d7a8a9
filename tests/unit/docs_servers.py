"""Fake vLLM servers for the guides' Python blocks: loopback OpenAI-compatible servers
(``tests.unit.conftest``) whose fake model answers every chat completion with JSON that
follows the request's output schema, or with a word when there is none.

The blocks run as a reader would run them, so the answers must be ones the client
accepts: valid against the schema (enums, required properties, string lengths), and no
longer than the request's token limit.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import web

from tests.unit.conftest import FakeServer, completion, running_fake_server

PLAIN_ANSWER = "positive"
"""What the fake model says to a request without an output schema."""


def schema_instance(schema: Any, seed: int) -> Any:
    """A value valid against ``schema`` (the subset of JSON Schema the guides use: types,
    enums, consts, objects with every property, string and array lengths, bounds,
    ``anyOf``). ``seed`` picks among an enum's values, so that different prompts get
    different labels.

    Examples:
        >>> schema_instance({"type": "string", "enum": ["yes", "no"]}, 3)
        'no'
        >>> schema_instance({"type": "object", "properties": {"n": {"type": "integer"}}}, 0)
        {'n': 0}
    """
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][seed % len(schema["enum"])]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return schema_instance(schema[key][0], seed)
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        properties = schema.get("properties", {})
        return {name: schema_instance(sub, seed) for name, sub in properties.items()}
    if kind == "array":
        return [schema_instance(schema.get("items", {}), seed)] * schema.get("minItems", 0)
    if kind == "string":
        length = max(schema.get("minLength", 0), min(schema.get("maxLength", 24), 24))
        return ("fake answer " * (length // 12 + 1))[:length]
    if kind in ("integer", "number"):
        return schema.get("minimum", 0)
    if kind == "boolean":
        return True
    return None


async def follow_schema(request: dict[str, Any]) -> web.StreamResponse:
    """The fake model: JSON that follows the request's ``response_format`` schema, the
    choice among enum values made by the prompt (the same prompt, the same answer)."""
    prompt = orjson.dumps(request.get("messages"))
    seed = zlib.crc32(prompt)
    response_format = request.get("response_format") or {}
    schema = response_format.get("json_schema", {}).get("schema")
    if schema is None:
        return completion(PLAIN_ANSWER)
    return completion(orjson.dumps(schema_instance(schema, seed)).decode())


@contextlib.contextmanager
def fake_vllm_servers(count: int) -> Iterator[list[FakeServer]]:
    """``count`` fake servers on loopback ports, answering with :func:`follow_schema`;
    all stopped at the end."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(running_fake_server()) for _ in range(count)]
        for server in servers:
            server.handler = follow_schema
        yield servers
