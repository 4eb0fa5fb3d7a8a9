"""Shared fixtures.

The vLLM fixtures start real servers on the tiny model (no download, random weights)
and only when a test asks for them: ``vllm_servers`` (two servers shared by the whole
run) and ``start_vllm`` (a factory for servers a test may kill or break). Without a
Python that has vLLM (see ``scripts/vllm-env.sh``) the tests that use them are skipped,
unless ``LLM_ANNOTATOR_REQUIRE_VLLM`` is set (the test command sets it): then they fail.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from llm_annotator.errors import ConfigurationError
from llm_annotator.local import (
    LocalServers,
    ensure_small_model,
    ensure_tiny_model,
    find_vllm_python,
    start_local_servers,
)

StartVLLM = Callable[..., LocalServers]

REQUIRE_VLLM_ENV = "LLM_ANNOTATOR_REQUIRE_VLLM"
"""Set (as the test command does) to fail, not skip, the vLLM tests when vLLM is missing."""


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The Python interpreter that has vLLM; skips the test if there is none."""
    try:
        return find_vllm_python()
    except ConfigurationError as error:
        if os.environ.get(REQUIRE_VLLM_ENV):
            pytest.fail(f"{REQUIRE_VLLM_ENV} is set but no vLLM is available: {error}")
        pytest.skip(f"no vLLM available: {error}")


@pytest.fixture(scope="session")
def tiny_model(vllm_python: str) -> Path:
    """The tiny model folder (written once into the cache, then reused)."""
    return ensure_tiny_model(python=vllm_python)


@pytest.fixture(scope="session")
def small_model(vllm_python: str) -> Path:
    """The small real model folder (SmolLM2-135M-Instruct, converted once into the
    cache from its PyPI package, then reused)."""
    return ensure_small_model(python=vllm_python)


@pytest.fixture(scope="session")
def small_server(
    vllm_python: str, small_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalServers]:
    """One vLLM server on the small real model, shared by the tests that need answers
    that mean something (served as ``small``). Tests must leave it running.

    It accepts a chat template sent with a request (vLLM refuses one with a 400 unless
    ``--trust-request-chat-template`` is given)."""
    servers = start_local_servers(  # by its built-in name, as serve-local --model small
        1,
        "small",
        python=vllm_python,
        log_dir=tmp_path_factory.mktemp("vllm-small-logs"),
        extra_args=["--trust-request-chat-template"],
    )
    with servers:
        yield servers


@pytest.fixture(scope="session")
def vllm_servers(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalServers]:
    """Two vLLM servers on the tiny model, started once and shared by the whole run.

    Tests must leave them running and healthy (resume what they pause).
    """
    servers = start_local_servers(
        2,
        tiny_model,
        python=vllm_python,
        log_dir=tmp_path_factory.mktemp("vllm-shared-logs"),
    )
    with servers:
        yield servers


@pytest.fixture
def start_vllm(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StartVLLM]:
    """A factory ``start_vllm(n=1, **kwargs) -> LocalServers`` for servers of one test.

    Keyword arguments go to :func:`llm_annotator.local.start_local_servers`; every
    server started is stopped when the test ends.
    """
    started: list[LocalServers] = []

    def start(n: int = 1, **kwargs: Any) -> LocalServers:
        kwargs.setdefault("model", tiny_model)
        kwargs.setdefault("python", vllm_python)
        kwargs.setdefault("log_dir", tmp_path_factory.mktemp("vllm-logs"))
        servers = start_local_servers(n, **kwargs)
        started.append(servers)
        return servers

    yield start
    for servers in started:
        servers.stop(grace=5.0)


@pytest.fixture
def blackhole_url() -> Iterator[str]:
    """A loopback URL whose listener never accepts and whose backlog is full.

    New connections then wait for a handshake that never completes: a connect timeout,
    as from a host that drops packets.
    """
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers: list[socket.socket] = []
    for _ in range(8):  # bounded: the backlog of 0 fills after one or two
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for filler in fillers:
            filler.close()
        listener.close()
