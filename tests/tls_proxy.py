"""A real TLS endpoint for the tests: nginx terminating https in front of a server.

The certificate authority and the server's certificate are made in the test with
trustme (nothing is downloaded, nothing is trusted system-wide). nginx comes from the
system (Debian's ``nginx-light``; the test command installs it when missing).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import trustme

_CONFIG = """\
daemon off;
master_process off;
worker_processes 1;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    server {{
        listen 127.0.0.1:{port} ssl;
        server_name localhost;
        ssl_certificate {root}/server.pem;
        ssl_certificate_key {root}/server.key;
        location / {{
            proxy_pass {upstream};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


@dataclass(frozen=True)
class TlsProxy:
    """A running https endpoint."""

    base_url: str
    """``https://localhost:<port>/v1``: the name the certificate is made out to."""
    ca_bundle: Path
    """The PEM file of the authority that signed the certificate."""


def find_nginx() -> str | None:
    for candidate in (shutil.which("nginx"), "/usr/sbin/nginx"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def tls_proxy(upstream_base_url: str, root: Path, nginx: str) -> Iterator[TlsProxy]:
    """Serve ``https://localhost:<port>`` in front of ``upstream_base_url``'s server."""
    root.mkdir(parents=True, exist_ok=True)
    authority = trustme.CA()
    certificate = authority.issue_cert("localhost", "127.0.0.1")
    certificate.private_key_pem.write_to_path(str(root / "server.key"))
    certificate.cert_chain_pems[0].write_to_path(str(root / "server.pem"))
    for extra in certificate.cert_chain_pems[1:]:
        with (root / "server.pem").open("ab") as file:
            file.write(extra.bytes())
    ca_bundle = root / "ca.pem"
    authority.cert_pem.write_to_path(str(ca_bundle))
    upstream = urlsplit(upstream_base_url)
    for _ in range(5):  # a free port may be taken by another process before nginx binds it
        port = _free_port()
        process = _start(nginx, root, port, f"http://{upstream.netloc}")
        if process is not None:
            break
    else:
        raise RuntimeError("nginx could not bind a free port in 5 attempts")
    try:
        yield TlsProxy(base_url=f"https://localhost:{port}/v1", ca_bundle=ca_bundle)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _start(nginx: str, root: Path, port: int, upstream: str) -> subprocess.Popen[bytes] | None:
    """nginx listening on ``port``, or None if the port was taken meanwhile."""
    (root / "nginx.conf").write_text(
        _CONFIG.format(root=root, port=port, upstream=upstream), encoding="utf-8"
    )
    log = root / "nginx.stderr"
    with log.open("wb") as stderr:
        process = subprocess.Popen(
            [nginx, "-p", str(root), "-c", str(root / "nginx.conf")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    deadline = time.monotonic() + 15
    while True:
        if process.poll() is not None:
            said = log.read_text(errors="replace")
            if (root / "error.log").exists():
                said += (root / "error.log").read_text(errors="replace")
            if "Address already in use" in said:
                return None
            raise RuntimeError(f"nginx exited at start: {said[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return process
        if time.monotonic() > deadline:
            process.kill()
            process.wait(timeout=10)
            raise RuntimeError("nginx did not listen within 15 s")
        time.sleep(0.05)
