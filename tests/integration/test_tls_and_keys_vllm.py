"""TLS and API keys against real vLLM: nginx with a certificate made in the test in
front of a shared server, and a server of its own started with ``--api-key``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import structlog

from llm_annotator import (
    ErrorKind,
    ServersUnusableError,
    VLLMOnlineClient,
    VLLMOnlineRuntimeOptions,
    VLLMQueueAnnotator,
    server_is_healthy,
)
from llm_annotator.local import LocalServers, start_local_servers
from tests.cli import run_job
from tests.conftest import REQUIRE_VLLM_ENV
from tests.tls_proxy import TlsProxy, find_nginx, tls_proxy

pytestmark = pytest.mark.integration

KEY = "vllm-test-key-4c9e1d7a"
SHORT = VLLMOnlineRuntimeOptions(max_completion_tokens=4, temperature=0.0)
MESSAGES = [{"role": "user", "content": "hello"}]


def write_rows(path: Path, n: int) -> Path:
    path.write_bytes(b"".join(orjson.dumps({"text": f"row {i}"}) + b"\n" for i in range(n)))
    return path


def run_command(
    server: str, data: Path, output_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_job(
        server,
        data,
        output_dir,
        "--max-completion-tokens",
        "4",
        *extra,
        template="{text}",
        env=env,
    )


# -- TLS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def https_vllm(
    vllm_servers: LocalServers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TlsProxy]:
    """nginx terminating TLS in front of the first shared vLLM server."""
    nginx = find_nginx()
    if nginx is None:
        message = "nginx is not installed (Debian: apt-get install nginx-light)"
        if os.environ.get(REQUIRE_VLLM_ENV):
            pytest.fail(message)
        pytest.skip(message)
    with tls_proxy(vllm_servers.base_urls[0], tmp_path_factory.mktemp("nginx"), nginx) as proxy:
        yield proxy


def test_https_with_the_ca_bundle_works(https_vllm: TlsProxy, vllm_servers: LocalServers) -> None:
    """verify='ca.pem' (the authority that signed nginx's certificate): health, model
    discovery and generation all go over TLS."""
    bundle = str(https_vllm.ca_bundle)
    with VLLMOnlineClient(base_url=https_vllm.base_url, verify=bundle) as client:
        assert client.is_healthy()
        response = client.generate(messages=MESSAGES, options=SHORT)
    assert response.ok, response.error
    assert client.model == vllm_servers.model
    assert server_is_healthy(https_vllm.base_url, 5.0, verify=bundle)
    assert not server_is_healthy(https_vllm.base_url, 5.0)


def test_https_without_the_bundle_fails_fast_as_tls(https_vllm: TlsProxy) -> None:
    """Without the bundle the certificate is not trusted: a 'tls' error at once, for the
    client and for a pool, which stops before the run starts and says why."""
    with VLLMOnlineClient(model="tiny", base_url=https_vllm.base_url, max_retries=0) as client:
        started = time.monotonic()
        response = client.generate(messages=MESSAGES, options=SHORT)
    assert response.error_type == ErrorKind.TLS
    assert "certificate" in (response.error or "")
    assert time.monotonic() - started < 2
    started = time.monotonic()
    with (
        VLLMQueueAnnotator([https_vllm.base_url], model="tiny") as pool,
        pytest.raises(ServersUnusableError, match="certificate") as caught,
    ):
        pool.batch_generate(messages=[MESSAGES] * 4, options=SHORT)
    assert time.monotonic() - started < 5
    assert https_vllm.base_url in str(caught.value)
    assert "no answer to GET /health" not in str(caught.value)


def test_verify_false_works_and_warns_once(https_vllm: TlsProxy) -> None:
    """verify=False skips the check: it works, and one warning says so."""
    with (
        structlog.testing.capture_logs() as logs,
        VLLMQueueAnnotator([https_vllm.base_url], verify=False) as pool,
    ):
        responses = pool.batch_generate(messages=[MESSAGES] * 8, options=SHORT)
    assert all(r.ok for r in responses), [r.error for r in responses]
    warnings = [e for e in logs if e["event"] == "tls_verification_disabled"]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"


def test_the_command_takes_a_ca_bundle(https_vllm: TlsProxy, tmp_path: Path) -> None:
    """`llm-annotator run --ca-bundle ca.pem` annotates over https; without it, it exits
    1 at once naming the TLS failure."""
    data = write_rows(tmp_path / "rows.jsonl", 12)
    good = run_command(
        https_vllm.base_url, data, tmp_path / "a", "--ca-bundle", str(https_vllm.ca_bundle)
    )
    assert good.returncode == 0, good.stderr[-3000:]
    assert "rows: 12 (12 succeeded, 0 failed)" in good.stdout
    bad = run_command(https_vllm.base_url, data, tmp_path / "b")
    assert bad.returncode == 1, bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr
    assert "TLS certificate is not trusted" in bad.stderr and "--ca-bundle" in bad.stderr


# -- API keys --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_vllm(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A vLLM server of its own, started with ``--api-key``; its base URL."""
    servers = start_local_servers(
        1,
        tiny_model,
        python=vllm_python,
        extra_args=["--api-key", KEY],
        log_dir=tmp_path_factory.mktemp("vllm-keyed-logs"),
    )
    with servers:
        yield servers.base_urls[0]


def test_the_right_key_works_from_the_argument_and_from_vllm_api_key(
    keyed_vllm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """api_key= or VLLM_API_KEY: vLLM accepts the requests (model discovery included)."""
    with VLLMOnlineClient(base_url=keyed_vllm, api_key=KEY) as client:
        assert client.generate(messages=MESSAGES, options=SHORT).ok
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-not-for-vllm")
    with VLLMOnlineClient(base_url=keyed_vllm) as client:
        assert client.generate(messages=MESSAGES, options=SHORT).ok
    with VLLMQueueAnnotator([keyed_vllm], batch_size=4) as pool:
        assert all(r.ok for r in pool.batch_generate(messages=[MESSAGES] * 8, options=SHORT))


@pytest.mark.parametrize("key", [None, "wrong"], ids=["no-key", "wrong-key"])
def test_a_wrong_or_missing_key_is_auth_and_stops_the_pool(
    keyed_vllm: str, key: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM answers 401: the client says 'auth', the pool stops within seconds naming the
    server (model asked for or named)."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with VLLMOnlineClient(model="tiny", base_url=keyed_vllm, api_key=key, max_retries=0) as c:
        response = c.generate(messages=MESSAGES, options=SHORT)
    assert response.error_type == ErrorKind.AUTH
    for model in (None, "tiny"):
        started = time.monotonic()
        with (
            VLLMQueueAnnotator([keyed_vllm], api_key=key, model=model) as pool,
            pytest.raises(ServersUnusableError, match="HTTP 401") as caught,
        ):
            pool.batch_generate(messages=[MESSAGES] * 4, options=SHORT)
        assert time.monotonic() - started < 5
        assert keyed_vllm in str(caught.value)


def test_the_command_with_key_file_env_and_wrong_key(
    keyed_vllm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--api-key-file and --api-key-env annotate; a wrong key exits 1 before anything is
    sent; the key is in no output of any of the three runs."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    data = write_rows(tmp_path / "rows.jsonl", 10)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n", encoding="utf-8")
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("not-the-key\n", encoding="utf-8")
    by_file = run_command(keyed_vllm, data, tmp_path / "a", "--api-key-file", str(key_file))
    by_env = run_command(
        keyed_vllm, data, tmp_path / "b", "--api-key-env", "MY_KEY", env={"MY_KEY": KEY}
    )
    wrong = run_command(keyed_vllm, data, tmp_path / "c", "--api-key-file", str(wrong_file))
    for done in (by_file, by_env):
        assert done.returncode == 0, done.stderr[-3000:]
        assert "rows: 10 (10 succeeded, 0 failed)" in done.stdout
    assert wrong.returncode == 1, wrong.stderr[-3000:]
    assert "HTTP 401" in wrong.stderr and keyed_vllm in wrong.stderr
    assert "Traceback" not in wrong.stderr
    texts = [d.stdout + d.stderr for d in (by_file, by_env, wrong)]
    for path in tmp_path.rglob("*"):
        if path.is_file() and path not in (key_file,):
            texts.append(path.read_bytes().decode("utf-8", errors="replace"))
    assert not [t for t in texts if KEY in t]
