"""A three-step pipeline run by one process and by elastic workers: wall time, rows a
second over all steps, each worker's peak memory, and when the last step begins.

``llm-annotator pipeline run FILE --processes N`` runs a pipeline as N elastic workers
(``--shard claim`` each) that share every step's units by claims; the steps stream, a
step's unit starting once the unit it reads is finished. This script runs the same
pipeline, side by side in one run:

- ``--processes 1``: the pipeline in one process, no claims;
- ``--processes 2``: two workers, each with half of every server's in-flight budget;
- ``--processes 2 --claim-lease 4`` (``2-short``): the same, but a worker that waits for
  units the other holds looks again every second instead of every 5 s (a quarter of the
  lease, at most 5 s: with the default 60 s lease, 5 s);
- ``--shard claim``: one elastic worker alone (the claims' own cost, no second worker).

The pipeline (a TOML file like ``examples/pipeline/pipeline.toml``, plain prompts, no
output schema): ``label`` reads a corpus of ``--files`` JSONL files of ``--rows`` rows
(``id``, ``text``, ``bucket`` 0-9); ``reason`` reads the rows ``label`` answered with
``where = "bucket < 3"`` (an input column: 30% of the rows; the canned answer is the same
for every row, so a filter on it would keep all or none); ``judge`` reads ``reason``.

The servers: one process of this script (``--serve``) listens on four loopback ports and
answers like vLLM's OpenAI server (``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``), each chat completion ``--latency`` seconds (30 ms) after its request
came in, with no limit on requests in service: a pool of fast GPU servers, whose
answers take time but no CPU of this machine. It is a bare asyncio protocol rather than
aiohttp, so that it costs a few tens of microseconds of CPU a request and leaves the
cores to the workers. Each prompt starts with its step's name, and the server keeps,
for each step, the requests it got and the times of the first and the last.

For each run: wall time from the command's start to its exit; rows a second over all
steps (the rows the three steps wrote over the wall time); the peak RSS (``VmHWM``,
read from ``/proc`` every 50 ms while the run goes on) of each worker process, and of
the ``--processes`` command that starts them; the time from the start to the first
request of each step (of ``judge`` above all), and the gap from a step's last request
to the next step's first; the CPU seconds of the command (its workers included) and of
the server; and the share of the machine's CPUs other work took meanwhile. For the
elastic cases, each worker's part of each step over all its turns (the units it
finished and their rows) from the units' records. Nothing is pinned: the workers and the
server share the machine's cores.

``--against REV`` also runs the cases of ``--against-cases`` (``2``) on the library of
an older commit (a git worktree of it, first on the workers' import path), on the same
servers, in the same rounds.

Run it as::

    python benchmarks/pipeline_workers.py            # 200 files of 100 rows, 2 rounds
    python benchmarks/pipeline_workers.py --quick    # 40 files of 50 rows

Prints the figures; exits 0 unless the harness fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson
import pyarrow.parquet as pq

import _against
import _harness as harness
from _nginx import CHAT_COMPLETION, LOOPBACK, MODEL, MODELS, free_ports, raise_nofile_limit
from llm_annotator.jobs.rundir.partitions import ANNOTATIONS_DIR, RECORDS_DIR

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))
STEPS = ("label", "reason", "judge")
KEPT = 3
"""``reason`` keeps the rows whose ``bucket`` (0-9) is below this: 30%."""
SHORT_LEASE = 4.0
"""The claim lease of case ``2-short``: a worker that waits on units another holds looks
again every quarter of a lease (at most 5 s), so every second rather than every 5 s."""
CASES = {
    "1": ("--processes 1", ()),
    "2": ("--processes 2", ("--processes", "2")),
    "2-short": (
        f"--processes 2, lease {SHORT_LEASE:g} s",
        ("--processes", "2", "--claim-lease", f"{SHORT_LEASE:g}"),
    ),
    "claim": ("--shard claim (one worker)", ("--shard", "claim")),
}
"""The cases: a name for ``--cases``, its label, its flags of ``pipeline run``."""
AT = "@"
"""A case run on an older commit's library is named ``<case>@<commit>`` (``--against``)."""


def base(case: str) -> str:
    """The case a name runs (``2`` for ``2@1a2b3c4``)."""
    return case.split(AT, 1)[0]


def label(case: str) -> str:
    """A case's label in the tables (with the commit, for a case of ``--against``)."""
    name, _, rev = case.partition(AT)
    return CASES[name][0] + (f" at {rev}" if rev else "")


MARKERS = [(step, f'"{step}: '.encode()) for step in STEPS]
"""What the server looks for in a request's body: the start of each step's prompt."""
READY = "READY "
POLL = 0.05
"""Seconds between two reads of the workers' ``/proc/PID/status``."""

PIPELINE = """\
output_dir = {output_dir}
input = {corpus}
id_column = "id"
servers = {servers}
model = {model}
max_completion_tokens = 16
temperature = 0.0

[steps.label]
prompt_template = \"\"\"label: Is the sentiment of this review positive or negative?

{{text}}\"\"\"

[steps.reason]
from = "label"
where = "bucket < {kept}"
prompt_template = \"\"\"reason: In one sentence, what is the customer's main complaint?

{{text}}\"\"\"

[steps.judge]
from = "reason"
prompt_template = \"\"\"judge: Review: {{text}}
Stated complaint: {{reason_response}}
Does the complaint match the review? Answer yes or no.\"\"\"
"""


# --------------------------------------------------------------------------------------
# The servers: one process, four ports, each answer --latency seconds after its request
# --------------------------------------------------------------------------------------


class _Books:
    """What the server counts for each step: requests, first and last (Unix time)."""

    def __init__(self) -> None:
        self.steps: dict[str, list[float]] = {}
        self.other = 0

    def reset(self) -> None:
        self.steps.clear()
        self.other = 0

    def note(self, body: bytes) -> None:
        # The body is the request's JSON: its prompt begins with its step's name.
        for step, marker in MARKERS:
            if marker in body:
                now = time.time()
                books = self.steps.get(step)
                if books is None:
                    self.steps[step] = [1, now, now]
                else:
                    books[0] += 1
                    books[2] = now
                return
        self.other += 1

    def json(self) -> bytes:
        steps = {
            name: {"requests": int(b[0]), "first": b[1], "last": b[2]}
            for name, b in self.steps.items()
        }
        return orjson.dumps({"steps": steps, "other": self.other})


def _response(status: str, body: bytes, kind: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class _Connection(asyncio.Protocol):
    """One client connection: HTTP/1.1 with keep-alive, bodies by Content-Length."""

    def __init__(self, books: _Books, latency: float, answers: dict[str, bytes]) -> None:
        self.books = books
        self.latency = latency
        self.answers = answers
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower()
            length = 0
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : stop if stop >= 0 else None])
            whole = end + 4 + length
            if len(self.buffer) < whole:
                return
            body = bytes(self.buffer[end + 4 : whole])
            del self.buffer[:whole]
            self.request(head.split(b" ", 2), body)

    def request(self, line: list[bytes], body: bytes) -> None:
        method, path = line[0], line[1] if len(line) > 1 else b""
        if method == b"post" and path.endswith(b"/chat/completions"):
            self.books.note(body)
            self.loop.call_later(self.latency, self.send, self.answers["chat"])
        elif path.endswith(b"/models"):
            self.send(self.answers["models"])
        elif path == b"/health":
            self.send(_response("200 OK", b"", "text/plain"))
        elif path == b"/bench/stats":
            self.send(_response("200 OK", self.books.json()))
        elif path == b"/bench/reset" and method == b"post":
            self.books.reset()
            self.send(_response("204 No Content", b""))
        else:
            self.send(_response("404 Not Found", b"", "text/plain"))

    def send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)


async def serve(ports: int, latency: float) -> None:
    """Listen on ``ports`` free loopback ports; print ``READY p1,p2,...``; serve until
    cancelled."""
    loop = asyncio.get_running_loop()
    books = _Books()
    answers = {
        "chat": _response("200 OK", orjson.dumps(CHAT_COMPLETION)),
        "models": _response("200 OK", orjson.dumps(MODELS)),
    }
    servers = []
    for port in free_ports(ports):
        server = await loop.create_server(
            lambda: _Connection(books, latency, answers), LOOPBACK, port, backlog=8192
        )
        servers.append(server)
    bound = [s.sockets[0].getsockname()[1] for s in servers]
    print(f"{READY}{','.join(map(str, bound))}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for server in servers:
            server.close()


def serve_main(ports: int, latency: float) -> None:
    """``--serve``: run the servers in this process until SIGTERM."""
    raise_nofile_limit()

    def stop(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        import uvloop

        with contextlib.suppress(KeyboardInterrupt, SystemExit):
            uvloop.run(serve(ports, latency))
    except ImportError:
        with contextlib.suppress(KeyboardInterrupt, SystemExit):
            asyncio.run(serve(ports, latency))


class Servers:
    """The server process, as the benchmark sees it."""

    def __init__(self, ports: int, latency: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", "--ports", str(ports),
             "--latency", repr(latency)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 20)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith(READY):
            self.stop()
            raise SystemExit(f"the server did not start: {line!r}")
        self.ports = [int(p) for p in line[len(READY) :].split(",")]

    @property
    def urls(self) -> list[str]:
        return [f"http://{LOOPBACK}:{port}/v1" for port in self.ports]

    def _call(self, method: str, path: str) -> bytes:
        url = f"http://{LOOPBACK}:{self.ports[0]}{path}"
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            body: bytes = r.read()
            return body

    def reset(self) -> None:
        self._call("POST", "/bench/reset")

    def stats(self) -> dict[str, Any]:
        data: dict[str, Any] = orjson.loads(self._call("GET", "/bench/stats"))
        return data

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.process.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# --------------------------------------------------------------------------------------
# The corpus, the pipeline file, one run
# --------------------------------------------------------------------------------------


def text_of(i: int) -> str:
    stars = "great" if i % 3 else "poor"
    return f"Review {i}: a {stars} product, it arrived on time and works as described."


def build(folder: Path, files: int, rows: int) -> Path:
    """``files`` JSONL files of ``rows`` rows each: ``id``, ``text``, ``bucket``."""
    folder.mkdir(parents=True)
    for f in range(files):
        ids = range(f * rows, (f + 1) * rows)
        lines = [orjson.dumps({"id": i, "text": text_of(i), "bucket": i % 10}) for i in ids]
        (folder / f"part-{f:05d}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return folder


def pipeline_file(path: Path, output_dir: Path, corpus: Path, urls: list[str]) -> Path:
    path.write_text(
        PIPELINE.format(
            output_dir=json.dumps(str(output_dir)),
            corpus=json.dumps(str(corpus)),
            servers=json.dumps(urls),
            model=json.dumps(MODEL),
            kept=KEPT,
        )
    )
    return path


def _status_kb(pid: int, key: str) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(key):
            return int(line.split()[1])
    return None


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [
                    int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                ]
    return found


@dataclass
class Run:
    """One run of the pipeline: what it took and what the server saw."""

    case: str
    round: int
    wall: float = 0.0
    rows: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    """Seconds from the command's start to each step's first request."""
    last: dict[str, float] = field(default_factory=dict)
    workers_mb: list[float] = field(default_factory=list)
    supervisor_mb: float | None = None
    max_mb: float = 0.0
    """The largest peak RSS of the command and its workers, from ``wait4`` (a check on
    the readings of ``/proc``, which may miss a worker's last 50 ms)."""
    parts: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    """For each step, each worker's (by pid) units finished and their rows."""
    cpu: float = 0.0
    server_cpu: float = 0.0
    other: float | None = None

    @property
    def total_rows(self) -> int:
        return sum(self.rows.values())

    @property
    def rate(self) -> float:
        return self.total_rows / self.wall


def output_rows(step_dir: Path) -> int:
    """The rows a step wrote: its ``annotations/`` units or ``annotations.parquet``."""
    single = step_dir / "annotations.parquet"
    if single.exists():
        return int(pq.read_metadata(single).num_rows)
    return sum(
        int(pq.read_metadata(p).num_rows) for p in (step_dir / "annotations").glob("*.parquet")
    )


def worker_parts(step_dir: Path) -> dict[int, tuple[int, int]]:
    """Each elastic worker's part of a step, over all its turns: the units it finished
    and their rows, from the units' records (``annotations/_units/*.json``, whose
    ``by`` is the worker's claim owner, ``host:pid:token``; a commit before ``by`` gives
    none). A worker's report in its folder of the step is its last turn's only."""
    parts: dict[int, tuple[int, int]] = {}
    for path in (step_dir / ANNOTATIONS_DIR / RECORDS_DIR).glob("*.json"):
        record = orjson.loads(path.read_bytes())
        by = record.get("by")
        if not isinstance(by, str) or by.count(":") < 2:
            continue
        pid = int(by.split(":")[-2])
        units, rows = parts.get(pid, (0, 0))
        parts[pid] = (units + 1, rows + int(record.get("rows") or 0))
    return parts


def run_once(
    case: str,
    round_: int,
    servers: Servers,
    corpus: Path,
    scratch: Path,
    env: dict[str, str] | None = None,
) -> Run:
    """Run the pipeline once, in a fresh directory, with the case's flags (and
    ``env``: an older commit's library, for a case of ``--against``)."""
    out = scratch / f"run-{case}-{round_}"
    toml = pipeline_file(scratch / f"pipeline-{case}-{round_}.toml", out, corpus, servers.urls)
    command = [COMMAND, "pipeline", "run", str(toml), *CASES[base(case)][1]]
    result = Run(case, round_)
    servers.reset()
    server0 = servers.cpu_seconds()
    busy0 = harness.busy_seconds()
    log = scratch / f"run-{case}-{round_}.log"
    with log.open("wb") as sink:
        started = time.time()
        process = subprocess.Popen(
            command, stdout=sink, stderr=sink, stdin=subprocess.DEVNULL, env=env
        )
        peaks: dict[int, int] = {}
        status, usage = 0, None
        while True:
            for pid in [process.pid, *_children(process.pid)]:
                kb = _status_kb(pid, "VmHWM:")
                if kb is not None:
                    peaks[pid] = max(peaks.get(pid, 0), kb)
            done, status, usage = os.wait4(process.pid, os.WNOHANG)
            if done:
                break
            time.sleep(POLL)
        result.wall = time.time() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = harness.tail(log.read_text(errors="replace"), 25)
        raise SystemExit(f"{label(case)} failed (exit {process.returncode}):\n{tail}")
    busy1 = harness.busy_seconds()
    result.server_cpu = servers.cpu_seconds() - server0
    assert usage is not None
    result.cpu = usage.ru_utime + usage.ru_stime  # the command and the workers it waited for
    result.max_mb = usage.ru_maxrss / 1024
    result.other = harness.machine_other_load(
        busy0, busy1, result.cpu + result.server_cpu, result.wall
    )
    children = [pid for pid in peaks if pid != process.pid]
    if children:  # --processes 2: the command starts the workers
        result.supervisor_mb = peaks[process.pid] / 1024
        result.workers_mb = [peaks[pid] / 1024 for pid in children]
    else:
        result.workers_mb = [peaks[process.pid] / 1024]
    seen = servers.stats()
    for step in STEPS:
        result.rows[step] = output_rows(out / "steps" / step)
        result.parts[step] = worker_parts(out / "steps" / step)
        books = seen["steps"].get(step)
        if books is None:
            raise SystemExit(f"{label(case)}: the server saw no request of step {step}")
        result.requests[step] = books["requests"]
        result.first[step] = books["first"] - started
        result.last[step] = books["last"] - started
    shutil.rmtree(out, ignore_errors=True)
    return result


# --------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------


def _mb(values: list[float]) -> str:
    return " / ".join(f"{v:,.0f}" for v in values)


def print_runs(runs: list[Run]) -> None:
    header = ["case", "round", "wall s", "rows", "rows/s", "worker peak RSS MB",
              "cmd RSS MB", "max RSS MB", "CPU s", "server CPU s", "other %"]  # fmt: skip
    table = [
        [label(r.case), str(r.round), f"{r.wall:.2f}", f"{r.total_rows:,}", f"{r.rate:,.0f}",
         _mb(r.workers_mb), "-" if r.supervisor_mb is None else f"{r.supervisor_mb:,.0f}",
         f"{r.max_mb:,.0f}",
         f"{r.cpu:.1f}", f"{r.server_cpu:.1f}", harness.percent(r.other)]
        for r in runs
    ]  # fmt: skip
    harness.print_table(header, table)


def print_steps(runs: list[Run]) -> None:
    """When each step's requests went out, from the command's start (server's clock)."""
    header = ["case", "round"]
    for step in STEPS:
        header += [f"{step} first s", f"{step} last s"]
    header += ["gap 1-2 s", "gap 2-3 s", "requests / rows"]
    table = []
    for r in runs:
        row = [label(r.case), str(r.round)]
        for step in STEPS:
            row += [f"{r.first[step]:.2f}", f"{r.last[step]:.2f}"]
        gaps = [r.first[b] - r.last[a] for a, b in itertools.pairwise(STEPS)]
        row += [f"{g:.2f}" for g in gaps]
        row.append(" ".join(f"{r.requests[s]:,}/{r.rows[s]:,}" for s in STEPS))
        table.append(row)
    harness.print_table(header, table)


def print_parts(runs: list[Run]) -> None:
    """Each worker's part of each step: the units it finished and their rows."""
    elastic = [r for r in runs if any(r.parts.values())]
    if not elastic:
        return
    print("\neach worker's part of each step, all its turns: units it finished / their rows")
    header = ["case", "round", "worker", *STEPS]
    table = []
    for r in elastic:
        pids = sorted({pid for parts in r.parts.values() for pid in parts})
        for n, pid in enumerate(pids, 1):
            cells = []
            for step in STEPS:
                units, rows = r.parts[step].get(pid, (0, 0))
                cells.append(f"{units:,} / {rows:,}")
            table.append([label(r.case), str(r.round), str(n), *cells])
    harness.print_table(header, table)


def summary(runs: list[Run], target: float) -> None:
    by_case: dict[str, list[Run]] = {}
    for r in runs:
        by_case.setdefault(r.case, []).append(r)
    print("\nsummary (median of the rounds; each round's figures in brackets):")
    for case, rs in by_case.items():
        rates = [r.rate for r in rs]
        walls = [r.wall for r in rs]
        judge = [r.first["judge"] for r in rs]
        peak = max(max(r.workers_mb) for r in rs)
        print(
            f"  {label(case):<27} wall {statistics.median(walls):6.2f} s "
            f"[{', '.join(f'{w:.2f}' for w in walls)}]  rows/s {statistics.median(rates):7,.0f} "
            f"[{', '.join(f'{x:,.0f}' for x in rates)}]  judge's first request "
            f"{statistics.median(judge):5.2f} s [{', '.join(f'{j:.2f}' for j in judge)}]  "
            f"worker peak RSS up to {peak:,.0f} MB"
        )
    for case in by_case:
        if "1" not in by_case or base(case) not in ("2", "2-short"):
            continue
        one, two = by_case["1"], by_case[case]
        ratios = [b.rate / a.rate for a, b in zip(one, two, strict=False)]
        ratio = statistics.median(r.rate for r in two) / statistics.median(r.rate for r in one)
        verdict = "PASS" if ratio >= target else "MISS"
        delay = statistics.median(r.first["judge"] for r in two) - statistics.median(
            r.first["judge"] for r in one
        )
        print(
            f"  {label(case)} against --processes 1: rows/s {ratio:.2f}x of the medians "
            f"(round by round: {', '.join(f'{x:.2f}' for x in ratios)}; target >= "
            f"{target:.1f}x: {verdict}); judge's first request {delay:+.2f} s"
        )
    noisy = [r for r in runs if r.other is not None and r.other > harness.MACHINE_NOISY]
    if noisy:
        print(
            f"  noisy: {len(noisy)} of {len(runs)} runs lost more than "
            f"{harness.MACHINE_NOISY:.0%} of the machine's CPUs to other work (other %); "
            "their figures are low"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=200, help="JSONL files in the corpus")
    parser.add_argument("--rows", type=int, default=100, help="rows in each file")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each case, in turn")
    parser.add_argument("--latency", type=float, default=0.03, help="seconds a request takes")
    parser.add_argument("--ports", type=int, default=4, help="servers (loopback ports)")
    parser.add_argument(
        "--cases",
        default="1,2,2-short,claim",
        help="comma-separated, of: 1 (--processes 1), 2 (--processes 2), 2-short "
        f"(--processes 2 --claim-lease {SHORT_LEASE:g}), claim (--shard claim, one worker)",
    )
    parser.add_argument("--target", type=float, default=1.7, help="--processes 2 over 1")
    parser.add_argument("--quick", action="store_true", help="40 files of 50 rows")
    _against.add_against(parser, "the cases of --against-cases")
    parser.add_argument(
        "--against-cases", default="2", help="comma-separated cases to run --against too"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_main(args.ports, args.latency)
        return
    if args.quick:
        args.files, args.rows = 40, 50
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        parser.error(f"--cases: unknown {unknown}; choose among {', '.join(CASES)}")
    rows = args.files * args.rows
    kept = rows * KEPT // 10
    print(
        f"pipeline_workers: label -> reason (where bucket < {KEPT}) -> judge over {args.files} "
        f"JSONL files of {args.rows} rows: {rows:,} + {kept:,} + {kept:,} = "
        f"{rows + 2 * kept:,} requests a run; {args.ports} servers answering after "
        f"{args.latency * 1000:g} ms; {harness.cpu_count()} CPUs, nothing pinned; "
        f"{harness.versions('llm-annotator', 'python')}"
    )
    raise_nofile_limit()
    scratch = Path(tempfile.mkdtemp(prefix="pipeline-workers-"))
    servers = Servers(args.ports, args.latency)
    runs: list[Run] = []
    envs: dict[str, dict[str, str] | None] = dict.fromkeys(cases)
    try:
        with contextlib.ExitStack() as stack:
            if args.against:
                rev = _against.short(args.against)
                env = _against.environment(stack.enter_context(_against.worktree(rev)))
                for case in args.against_cases.split(","):
                    if case.strip() in CASES:
                        envs[f"{case.strip()}{AT}{rev}"] = env
            cases = list(envs)
            run_rounds(args, cases, envs, servers, scratch, runs)
    finally:
        servers.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    runs.sort(key=lambda r: (cases.index(r.case), r.round))
    print()
    print_runs(runs)
    print()
    print_steps(runs)
    print_parts(runs)
    summary(runs, args.target)


def run_rounds(
    args: argparse.Namespace,
    cases: list[str],
    envs: dict[str, dict[str, str] | None],
    servers: Servers,
    scratch: Path,
    runs: list[Run],
) -> None:
    """Every case once a round, in turn (every other round in the other order)."""
    corpus = build(scratch / "corpus", args.files, args.rows)
    for round_ in range(1, args.rounds + 1):
        order = cases if round_ % 2 else cases[::-1]
        for case in order:
            run = run_once(case, round_, servers, corpus, scratch, envs[case])
            runs.append(run)
            print(
                f"  round {round_}, {label(case)}: {run.wall:.2f} s, "
                f"{run.rate:,.0f} rows/s, other {harness.percent(run.other)}%",
                flush=True,
            )


if __name__ == "__main__":
    main()
