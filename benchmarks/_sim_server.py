"""A simulated continuous-batching vLLM server, for pool benchmarks.

A server serves at most ``capacity`` requests at once; requests beyond that wait in a
first-come, first-served line inside the server, as in vLLM's scheduler. A request that
enters service with ``active`` requests in service (itself included) takes::

    base_latency * (1 + alpha * active / capacity)

seconds, so a full server answers a request every ``base_latency * (1 + alpha) /
capacity`` seconds: its throughput at full load, and its highest, is
``capacity / (base_latency * (1 + alpha))`` requests per second
(:attr:`ServerModel.throughput`).

It answers like vLLM's OpenAI server: ``POST /v1/chat/completions`` with a fixed chat
completion, ``GET /health`` with 200, ``GET /v1/models`` with one model. Like vLLM
(whose chat route cancels a request whose client disconnected, and aborts it in the
engine), it drops a request whose client went away, waiting or in service; and like
vLLM its ``GET /metrics`` gives the gauges ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` and the counter ``vllm:request_success_total``. Two more routes
serve the benchmark: ``GET /bench/stats`` (what the server measured since the last
reset) and ``POST /bench/reset``.

Run as a script it binds a free loopback port and prints ``READY <port>`` on stdout;
:class:`SimServer` starts such a process and talks to it from the benchmark. With
``--servers K`` one process serves K independent servers (each its own model, line and
counters) on K ports and prints ``READY <port1>,<port2>,...``; on any of its ports
``GET /bench/group`` then gives the counters of every server of the process, in the
order of the ports, so that a benchmark of hundreds of servers reads them in one call
a process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _nginx import CHAT_COMPLETION, raise_nofile_limit

LOOPBACK = "127.0.0.1"
READY = "READY "


@dataclass(frozen=True, slots=True)
class ServerModel:
    """The parameters of one simulated server.

    Attributes:
        name: A short label for tables.
        base_latency: Seconds one request takes on an otherwise empty server.
        capacity: Requests served at once; more wait inside the server.
        alpha: How much a full server slows each request down: at full load a request
            takes ``base_latency * (1 + alpha)``.
    """

    name: str
    base_latency: float
    capacity: int
    alpha: float

    def __post_init__(self) -> None:
        if self.base_latency <= 0 or self.capacity < 1 or self.alpha < 0:
            raise ValueError(f"bad server model {self!r}")

    @property
    def throughput(self) -> float:
        """Requests per second at full load, the most this server can answer."""
        return self.capacity / (self.base_latency * (1 + self.alpha))


@dataclass(frozen=True, slots=True)
class ServerStats:
    """What one server measured between a reset and the snapshot.

    Attributes:
        completed: Requests answered.
        busy: Seconds with at least one request in service.
        full: Seconds with all ``capacity`` slots in service.
        slot_seconds: Integral of the requests in service over time.
        overshoot: Seconds the service sleeps overran their planned length, summed
            (a CPU-starved server runs slower than its model).
        last_finish: ``time.monotonic()`` of the last answer, or None.
        max_waiting: The longest line of requests waiting for a slot.
        aborted: Requests dropped because their client went away.
        received: Chat requests that came in (answered, dropped or still held).
        max_held: The most requests the server held at once, in service and waiting
            together (what its clients had sent it and not yet had answered).
    """

    completed: int
    busy: float
    full: float
    slot_seconds: float
    overshoot: float
    last_finish: float | None
    max_waiting: int
    aborted: int
    received: int = 0
    max_held: int = 0


class _Load:
    """The server's counters, integrated over time as requests enter and leave service."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.active = 0
        self.waiting = 0
        self.served = 0
        """Requests answered since the server started (never reset)."""
        self.reset()

    def reset(self) -> None:
        self.mark = time.monotonic()
        self.completed = 0
        self.busy = 0.0
        self.full = 0.0
        self.slot_seconds = 0.0
        self.overshoot = 0.0
        self.last_finish: float | None = None
        self.max_waiting = self.waiting
        self.aborted = 0
        self.received = 0
        self.max_held = self.active + self.waiting

    def advance(self) -> float:
        now = time.monotonic()
        elapsed = now - self.mark
        if self.active:
            self.busy += elapsed
            self.slot_seconds += self.active * elapsed
            if self.active >= self.capacity:
                self.full += elapsed
        self.mark = now
        return now

    def snapshot(self) -> ServerStats:
        self.advance()
        return ServerStats(
            completed=self.completed,
            busy=self.busy,
            full=self.full,
            slot_seconds=self.slot_seconds,
            overshoot=self.overshoot,
            last_finish=self.last_finish,
            max_waiting=self.max_waiting,
            aborted=self.aborted,
            received=self.received,
            max_held=self.max_held,
        )

    def as_dict(self) -> dict[str, Any]:
        snapshot = self.snapshot()
        return {name: getattr(snapshot, name) for name in ServerStats.__slots__}


def _bodies(model: str) -> tuple[bytes, bytes]:
    completion = {**CHAT_COMPLETION, "id": "chatcmpl-sim", "model": model}
    models = {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": 1700000000, "owned_by": "sim"}],
    }
    return json.dumps(completion).encode(), json.dumps(models).encode()


def _app(model: ServerModel, served_model: str, load: _Load) -> Any:
    """The aiohttp application of one simulated server, counting into ``load``."""
    from aiohttp import web

    slots = asyncio.Semaphore(model.capacity)  # FIFO: waiters are woken in order
    completion_body, models_body = _bodies(served_model)

    async def chat(request: web.Request) -> web.Response:
        try:
            return await serve_one(request)
        except asyncio.CancelledError:  # the client went away
            load.aborted += 1
            raise

    async def serve_one(request: web.Request) -> web.Response:
        await request.read()
        load.received += 1
        load.waiting += 1
        load.max_waiting = max(load.max_waiting, load.waiting)
        load.max_held = max(load.max_held, load.active + load.waiting)
        try:
            await slots.acquire()
        finally:
            load.waiting -= 1
        try:
            load.advance()
            load.active += 1
            planned = model.base_latency * (1 + model.alpha * load.active / model.capacity)
            started = time.monotonic()
            try:
                await asyncio.sleep(planned)
            finally:
                now = load.advance()
                load.active -= 1
            load.overshoot += max(0.0, now - started - planned)
            load.completed += 1
            load.served += 1
            load.last_finish = now
        finally:
            slots.release()
        return web.Response(body=completion_body, content_type="application/json")

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(_request: web.Request) -> web.Response:
        return web.Response(body=models_body, content_type="application/json")

    labels = f'{{model_name="{served_model}"}}'

    async def metrics(_request: web.Request) -> web.Response:
        text = (
            f"vllm:num_requests_running{labels} {load.active}\n"
            f"vllm:num_requests_waiting{labels} {load.waiting}\n"
            f"vllm:request_success_total{labels} {load.served}\n"
        )
        return web.Response(text=text, content_type="text/plain")

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response(load.as_dict())

    async def reset(_request: web.Request) -> web.Response:
        load.reset()
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/bench/stats", stats)
    app.router.add_post("/bench/reset", reset)
    return app


async def serve(
    model: ServerModel, served_model: str, host: str = LOOPBACK, servers: int = 1
) -> None:
    """Serve ``servers`` independent copies of ``model``, each on a free port of
    ``host``, until cancelled; print ``READY <port>[,<port>...]``."""
    from aiohttp import web

    loads = [_Load(model.capacity) for _ in range(servers)]

    async def group(_request: web.Request) -> web.Response:
        return web.json_response([load.as_dict() for load in loads])

    runners = []
    ports = []
    try:
        for load in loads:
            app = _app(model, served_model, load)
            app.router.add_get("/bench/group", group)
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, 0))
            runner = web.AppRunner(
                app, access_log=None, handle_signals=False, handler_cancellation=True
            )
            await runner.setup()
            runners.append(runner)
            await web.SockSite(runner, listener, backlog=8192).start()
            ports.append(listener.getsockname()[1])
        print(f"{READY}{','.join(map(str, ports))}", flush=True)
        await asyncio.Event().wait()
    finally:
        for runner in runners:
            await runner.cleanup()


class SimServer:
    """One simulated server in its own process, as the benchmark sees it.

    Args:
        model: The server's parameters.
        served_model: The model name it lists and answers with.
        cpu: Pin the process to this CPU, or None.
    """

    def __init__(self, model: ServerModel, served_model: str, cpu: int | None) -> None:
        self.model = model
        self.served_model = served_model
        self.cpu = cpu
        self.port = 0
        self._attached_pid: int | None = None
        self._process: subprocess.Popen[str] | None = None
        # Open for the life of this object: the process writes to it until it ends.
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115

    @property
    def base_url(self) -> str:
        """The OpenAI base URL, ``http://127.0.0.1:<port>/v1``."""
        return f"http://{LOOPBACK}:{self.port}/v1"

    @classmethod
    def attach(cls, model: ServerModel, served_model: str, port: int, pid: int) -> SimServer:
        """A handle on a server another process started (its counters and CPU time are
        read over HTTP and from /proc; it cannot be stopped or killed from here)."""
        server = cls(model, served_model, None)
        server.port, server._attached_pid = port, pid
        return server

    @property
    def pid(self) -> int:
        """The server process's id."""
        if self._process is None and self._attached_pid is not None:
            return self._attached_pid
        assert self._process is not None
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the process is running."""
        if self._process is None and self._attached_pid is not None:
            return Path(f"/proc/{self._attached_pid}").exists()
        return self._process is not None and self._process.poll() is None

    def start(self, timeout: float = 20.0) -> None:
        """Start the process and wait for its port.

        Raises:
            RuntimeError: If it exits or stays silent for ``timeout`` seconds.
        """
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--base-latency",
            repr(self.model.base_latency),
            "--capacity",
            str(self.model.capacity),
            "--alpha",
            repr(self.model.alpha),
            "--served-model",
            self.served_model,
        ]
        if self.cpu is not None:
            command += ["--cpu", str(self.cpu)]
        self._process = process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=self._stderr, text=True
        )
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], timeout)
        line = process.stdout.readline() if ready else ""
        if not line.startswith(READY):
            self.stop()
            raise RuntimeError(
                f"simulated server {self.model.name} did not start: {self.stderr_tail()}"
            )
        self.port = int(line[len(READY) :])

    def _call(self, method: str, path: str) -> bytes:
        request = urllib.request.Request(f"http://{LOOPBACK}:{self.port}{path}", method=method)
        with urllib.request.urlopen(request, timeout=10) as answer:
            body: bytes = answer.read()
            return body

    def reset(self) -> None:
        """Zero the server's counters."""
        self._call("POST", "/bench/reset")

    def stats(self) -> ServerStats:
        """The counters since the last reset."""
        data: dict[str, Any] = json.loads(self._call("GET", "/bench/stats"))
        return ServerStats(**data)

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) the process has used; 0 when it is gone."""
        try:
            with open(f"/proc/{self.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, AssertionError):
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        """SIGKILL the process: the server is gone at once, its sockets reset."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait()

    def stop(self) -> None:
        """Terminate the process (SIGKILL after a few seconds) and reap it."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stderr_tail(self, chars: int = 2000) -> str:
        """The end of the process's stderr."""
        self._stderr.seek(0)
        return self._stderr.read()[-chars:].strip()


def _exit_on_signal(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> None:
    """Serve one simulated server (``--servers K``: K of them) until SIGTERM."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-latency", type=float, required=True)
    parser.add_argument("--capacity", type=int, required=True)
    parser.add_argument("--alpha", type=float, required=True)
    parser.add_argument("--served-model", default="sim")
    parser.add_argument("--cpu", type=int)
    parser.add_argument("--servers", type=int, default=1, help="servers, one port each")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {args.cpu})
    model = ServerModel("sim", args.base_latency, args.capacity, args.alpha)
    raise_nofile_limit()  # every request held is a connection
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        runner(serve(model, args.served_model, servers=args.servers))


if __name__ == "__main__":
    main()
