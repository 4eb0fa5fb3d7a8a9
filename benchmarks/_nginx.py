"""A throwaway nginx that answers like an OpenAI-compatible server, for benchmarks.

nginx returns one fixed chat completion for every ``POST /v1/chat/completions``, so a
benchmark against it measures the client's own cost per request: the server answers in
microseconds and never becomes the bottleneck of a single-core client.

The server runs in the foreground (``daemon off``) in its own process group, with its
config, pid file, error log and temp folders in a private temporary directory, and
listens on several free loopback ports. :class:`CannedServer` is a context manager;
it also stops nginx at interpreter exit, so an exception or Ctrl-C never leaves it
running.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

LOOPBACK = "127.0.0.1"
MODEL = "bench"
ANSWER = "positive"
"""The text of every canned chat completion."""

CHAT_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 1700000000,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": ANSWER},
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
}
"""The body of every chat-completion answer."""

MODELS: dict[str, Any] = {
    "object": "list",
    "data": [
        {
            "id": MODEL,
            "object": "model",
            "created": 1700000000,
            "owned_by": "bench",
            "max_model_len": 512,
        }
    ],
}
"""The body of ``GET /v1/models``."""

_CONFIG = """\
daemon off;
master_process on;
worker_processes 1;
worker_rlimit_nofile {nofile};
pid {root}/nginx.pid;
error_log {root}/error.log warn;

events {{
    worker_connections {worker_connections};
    multi_accept on;
}}

http {{
{access_log}
    server_tokens off;
    keepalive_requests 1000000;
    keepalive_timeout 60s;
    tcp_nodelay on;
{temp_paths}
    server {{
{listens}
        location = /v1/chat/completions {{
            if ($request_method != POST) {{
                return 405;
            }}
            default_type application/json;
            return 200 '{chat_completion}';
        }}
        location = /v1/models {{
            default_type application/json;
            return 200 '{models}';
        }}
{status_location}        location = /health {{
            default_type text/plain;
            return 200 '';
        }}
        location / {{
            return 404;
        }}
    }}
}}
"""


class NginxError(RuntimeError):
    """nginx could not be found, installed, started or reached."""


def raise_nofile_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit.

    Thousands of requests in flight need thousands of sockets; child processes inherit
    the raised limit.

    Returns:
        The soft limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _group_stats(groups: set[int]) -> Iterator[tuple[int, list[str]]]:
    """(pid, the ``/proc/PID/stat`` fields after the command name) of each running
    process in ``groups``; a process that ends meanwhile is skipped."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After the command name: state, ppid, pgrp, ..., utime (12th), stime (13th).
        if int(fields[2]) in groups:
            yield int(entry), fields


def group_cpu_seconds(groups: Iterable[int]) -> float:
    """CPU seconds (user + system) of the running processes in the given process groups.

    Read from ``/proc``: a process that has ended no longer counts.
    """
    ticks = sum(int(f[11]) + int(f[12]) for _, f in _group_stats(set(groups)))
    return ticks / os.sysconf("SC_CLK_TCK")


def pin_group(group: int, cpus: set[int]) -> int:
    """Pin every thread of the running processes in process group ``group`` to
    ``cpus``; the number of threads pinned (processes it starts later inherit it)."""
    pinned = 0
    for pid, _ in _group_stats({group}):
        with contextlib.suppress(OSError):  # it ended meanwhile
            for thread in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(thread), cpus)
                pinned += 1
    return pinned


def find_nginx(*, install: bool = True) -> str:
    """The path of the nginx binary, installing Debian's ``nginx-light`` if allowed.

    Args:
        install: Install the package with ``apt-get`` when nginx is missing and this
            process runs as root.

    Returns:
        The absolute path of the nginx executable.

    Raises:
        NginxError: nginx is missing and cannot be installed here.
    """
    candidates = [shutil.which("nginx"), "/usr/sbin/nginx"]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    if not install or os.geteuid() != 0:
        raise NginxError(
            "nginx is not installed; install it with `sudo apt-get install -y nginx-light` "
            "(or the `nginx` package) and run the benchmark again"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install_cmd = ["apt-get", "install", "-y", "--no-install-recommends", "nginx-light"]
    result = subprocess.run(install_cmd, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        # The package lists may be missing on a fresh machine: refresh them once.
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=600)
        result = subprocess.run(install_cmd, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise NginxError(f"`apt-get install nginx-light` failed:\n{result.stderr[-2000:]}")
    for path in [shutil.which("nginx"), "/usr/sbin/nginx"]:
        if path and os.access(path, os.X_OK):
            return path
    raise NginxError("nginx-light was installed but no nginx binary was found")


def free_ports(count: int) -> list[int]:
    """Ports on the loopback address that are free right now.

    The sockets are all held open while the ports are chosen, so the ``count`` ports
    are distinct. Another process could take one before nginx binds it;
    :meth:`CannedServer.start` retries with new ports when that happens.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _temp_path_directives(built: str, root: Path) -> str:
    """``*_temp_path`` directives that move nginx's temp folders under ``root``.

    Debian builds nginx with temp folders under ``/var/lib/nginx``, which a non-root
    user cannot create. Only modules compiled in accept their directive, so the list
    follows ``built``, the output of ``nginx -V``.
    """
    lines = [f"    client_body_temp_path {root}/client_body;"]
    for module in ("proxy", "fastcgi", "uwsgi", "scgi"):
        if f"--without-http_{module}_module" not in built:
            lines.append(f"    {module}_temp_path {root}/{module};")
    return "\n".join(lines)


def _quote_for_nginx(body: dict[str, Any]) -> str:
    """``body`` as compact JSON that can sit inside a single-quoted nginx string."""
    text = json.dumps(body, separators=(",", ":"))
    if "'" in text or "$" in text or "\\" in text:
        raise ValueError("canned bodies must not contain quotes, backslashes or '$'")
    return text


class CannedServer:
    """nginx on loopback ports, answering every chat completion with a fixed body.

    Args:
        ports: How many loopback ports to listen on.
        cpu: The CPU to pin nginx to, or None to leave its affinity alone.
        backlog: The listen backlog of each port (the kernel caps it at
            ``net.core.somaxconn``). nginx's own default, 511, drops connection
            attempts when thousands of clients connect at once.
        worker_connections: nginx's limit on open connections of its one worker.
        start_timeout: Seconds to wait for every port to answer ``/health``.
        access_log: A file that gets a line per request, ``<unix time with ms>
            <method> <uri>`` (written as each request is served), or None for no log.

    Examples:
        A benchmark runs its clients inside the ``with`` block::

            with CannedServer(ports=4, cpu=1) as server:
                print(server.base_urls)
    """

    def __init__(
        self,
        *,
        ports: int = 4,
        cpu: int | None = None,
        backlog: int = 4096,
        worker_connections: int = 16384,
        start_timeout: float = 15.0,
        access_log: Path | None = None,
    ) -> None:
        if ports < 1:
            raise ValueError(f"ports must be at least 1, got {ports}")
        self.num_ports = ports
        self.cpu = cpu
        self.backlog = backlog
        self.worker_connections = worker_connections
        self.start_timeout = start_timeout
        self.access_log = access_log
        self.ports: list[int] = []
        self.nginx_path: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._root: Path | None = None
        self._built_with = ""

    @property
    def has_status(self) -> bool:
        """Whether this nginx has the stub_status module (for connection counts)."""
        return "http_stub_status_module" in self._built_with

    def counters(self) -> tuple[int, int] | None:
        """(connections accepted, requests served) since nginx started, or None.

        The query's own connection and request are not counted.
        """
        if not self.has_status or not self.ports:
            return None
        url = f"http://{LOOPBACK}:{self.ports[0]}/nginx_status"
        try:
            with urllib.request.urlopen(url, timeout=5.0) as answer:
                text = answer.read().decode()
        except OSError:
            return None
        # "Active connections: 1\nserver accepts handled requests\n 5 5 9\n..."
        numbers = text.splitlines()[2].split()
        return int(numbers[0]) - 1, int(numbers[2]) - 1

    @property
    def base_urls(self) -> list[str]:
        """The OpenAI base URL (``http://127.0.0.1:PORT/v1``) of each port."""
        return [f"http://{LOOPBACK}:{port}/v1" for port in self.ports]

    @property
    def pid(self) -> int | None:
        """The nginx master's process id while it runs."""
        return self._process.pid if self._process is not None else None

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user + system) nginx's running processes have used, or None.

        Sums every process of the group nginx was started in, from ``/proc``.
        """
        if self._process is None:
            return None
        return group_cpu_seconds([self._process.pid])

    def start(self) -> None:
        """Start nginx and wait until every port answers ``GET /health``.

        Raises:
            NginxError: nginx could not be started or did not become ready in time.
        """
        if self._process is not None:
            return
        self.nginx_path = find_nginx()
        self._built_with = subprocess.run(
            [self.nginx_path, "-V"], capture_output=True, text=True, timeout=30
        ).stderr
        raise_nofile_limit()
        root = Path(tempfile.mkdtemp(prefix="canned-nginx-"))
        root.chmod(0o755)  # nginx workers may run as an unprivileged user
        self._root = root
        atexit.register(self.stop)
        last_error = ""
        for _attempt in range(3):
            self.ports = free_ports(self.num_ports)
            config = root / "nginx.conf"
            config.write_text(self._config(root))
            self._process = self._spawn(config)
            last_error = self._wait_ready()
            if not last_error:
                return
            self._terminate()
            if "Address already in use" not in last_error:
                break
        self.stop()
        raise NginxError(f"nginx did not start: {last_error}")

    def stop(self) -> None:
        """Stop nginx (its whole process group) and delete its files. Safe to call twice."""
        self._terminate()
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

    def error_log(self) -> str:
        """The tail of nginx's error log, for diagnostics."""
        if self._root is None:
            return ""
        path = self._root / "error.log"
        try:
            return path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _config(self, root: Path) -> str:
        assert self.nginx_path is not None
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = self.worker_connections + 1024
        # Root may raise the limit past the hard one; anyone else stays below it.
        nofile = wanted if os.geteuid() == 0 else min(wanted, hard)
        listens = "\n".join(
            f"        listen {LOOPBACK}:{port} backlog={self.backlog};" for port in self.ports
        )
        return _CONFIG.format(
            root=root,
            nofile=nofile,
            worker_connections=self.worker_connections,
            temp_paths=_temp_path_directives(self._built_with, root),
            access_log=(
                "    log_format times '$msec $request_method $uri';\n"
                f"    access_log {self.access_log} times;"
                if self.access_log is not None
                else "    access_log off;"
            ),
            status_location=(
                "        location = /nginx_status {\n            stub_status;\n        }\n"
                if self.has_status
                else ""
            ),
            listens=listens,
            chat_completion=_quote_for_nginx(CHAT_COMPLETION),
            models=_quote_for_nginx(MODELS),
        )

    def _spawn(self, config: Path) -> subprocess.Popen[bytes]:
        assert self.nginx_path is not None
        assert self._root is not None
        command = [self.nginx_path, "-p", str(self._root), "-e", "error.log", "-c", str(config)]
        previous = os.sched_getaffinity(0)
        if self.cpu is not None:
            # nginx and its worker inherit the affinity this process has when it forks.
            os.sched_setaffinity(0, {self.cpu})
        try:
            with open(self._root / "stderr.log", "wb") as stderr:
                return subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                    start_new_session=True,
                )
        finally:
            if self.cpu is not None:
                os.sched_setaffinity(0, previous)

    def _wait_ready(self) -> str:
        """Poll ``/health`` on every port; return "" when all answer, else the reason."""
        assert self._process is not None
        deadline = time.monotonic() + self.start_timeout
        pending = list(self.ports)
        while pending and time.monotonic() < deadline:
            if self._process.poll() is not None:
                assert self._root is not None
                stderr = (self._root / "stderr.log").read_text(errors="replace").strip()
                return f"nginx exited with code {self._process.returncode}: {stderr}"
            port = pending[0]
            try:
                url = f"http://{LOOPBACK}:{port}/health"
                with urllib.request.urlopen(url, timeout=1.0) as answer:
                    if answer.status == 200:
                        pending.pop(0)
                        continue
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        if pending:
            return f"ports {pending} did not answer /health within {self.start_timeout} s"
        return ""

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            # SIGTERM is nginx's fast shutdown: the master stops its worker and exits.
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        # Whatever is left of the group nginx was started in (a stray worker) goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
