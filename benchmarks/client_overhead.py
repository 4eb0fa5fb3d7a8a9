"""How many requests per second one CPU core drives through each client.

Starts nginx answering every chat completion with a fixed body on four loopback ports,
pinned to one core, then measures each client in a fresh subprocess pinned to another
core: wall time, requests per second, CPU time per request (user + system, all threads),
peak RSS, and how many requests succeeded. A run in which any request fails, or which
does not finish within the per-case time limit, is reported as FAILED with its error
counts, never as a figure.

Clients measured:

* the OpenAI SDK's default async client (``openai.AsyncOpenAI``, httpx2 transport),
  ``asyncio.gather`` under a semaphore, at 512 and 4,096 requests in flight;
* the same SDK with its aiohttp transport (``openai.DefaultAioHttpClient``), when the
  installed version has one;
* a plain ``aiohttp.ClientSession`` posting the JSON, the floor any aiohttp-based
  client stands on;
* ``VLLMOnlineClient.batch_generate`` (one client, one port), and its async twin
  ``abatch_generate`` over four clients on the four ports, in batches of exactly
  ``c`` conversations.

Run it as::

    python benchmarks/client_overhead.py            # full run, two to four minutes
    python benchmarks/client_overhead.py --quick    # smoke run, about 2,000 requests a case

It prints a table and the two targets of the client: at least 4,000 requests per second
at 4,096 in flight, and at least 15 times the SDK default client at 512 in flight.
The exit code is 0 whether or not the targets are met, and non-zero only when the
harness itself fails: nginx cannot start, or a case's worker dies without a result.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as harness
from _nginx import ANSWER, MODEL, CannedServer

Messages = list[dict[str, str]]
CaseKind = Literal["sdk", "sdk_aiohttp", "floor", "ours_sync", "ours_async"]

RESULT_MARKER = "@@client-overhead-result "
"""Prefix of the one stdout line on which a worker subprocess reports its result."""

GROUPS = ("sdk", "floor", "ours")
"""Groups of cases that ``--only`` selects."""

NOISY = 0.2
"""Above this share of the client's core taken by other work, a row is called noisy."""
AGAIN = (
    "  noisy ({noise:.0%} of the core went to other work); "
    "measuring again ({attempt} of {attempts})"
)
"""What a noisy case prints before it is measured again (see ``harness.Retry``)."""

TARGET_RPS_4096 = 4000.0
TARGET_RATIO_512 = 15.0


# --------------------------------------------------------------------------------------
# What the parent hands a worker, and what a worker hands back
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaseSpec:
    """One measurement: a client, its concurrency and how many requests to time.

    Attributes:
        kind: Which client to drive.
        label: The row's name in the table.
        concurrency: Requests in flight (``c``).
        requests: Requests in the timed part; batch-driven cases round it up to a
            multiple of ``concurrency``.
        base_urls: The OpenAI base URLs to spread requests over.
        cpu: The CPU the worker pins itself to.
        timeout: Seconds the whole case (set-up, warm-up and timed part) may take.
    """

    kind: CaseKind
    label: str
    concurrency: int
    requests: int
    base_urls: tuple[str, ...]
    cpu: int
    timeout: float


@dataclass
class CaseResult(harness.CaseFigures):
    """What one worker measured (the figures of every case: ``harness.CaseFigures``).

    ``ok`` counts the successful responses of the timed part; ``errors`` the failed
    requests by kind, warm-up failures too (marked).

    Attributes:
        label: The row's name.
        concurrency: Requests in flight.
        requests: Requests in the timed part.
        loop: Which event loop ran the requests.
        connections: TCP connections nginx accepted during the case (warm-up
            included), or None when nginx cannot tell.
    """

    label: str
    concurrency: int
    requests: int
    loop: str = ""
    connections: int | None = None

    @property
    def passed(self) -> bool:
        """Whether every request of the case succeeded within its time limit."""
        return (
            self.status == "ok" and not self.errors and self.ok == self.requests and self.wall > 0
        )

    @property
    def rps(self) -> float | None:
        """Requests per second, or None for a failed case."""
        return self.requests / self.wall if self.passed else None

    @property
    def cpu_us_per_request(self) -> float | None:
        """Microseconds of CPU per request, or None for a failed case."""
        return self.cpu / self.requests * 1e6 if self.passed else None


# --------------------------------------------------------------------------------------
# Worker side: runs in a fresh subprocess, pinned to one core
# --------------------------------------------------------------------------------------


def _batch_total(spec: CaseSpec) -> tuple[int, int]:
    """(batches, requests) of a batch-driven case: whole batches of ``c`` each."""
    batches = max(1, -(-spec.requests // spec.concurrency))
    return batches, batches * spec.concurrency


class Recorder:
    """Counts outcomes as they come and reports the case's result exactly once.

    A watchdog thread reports a partial result and ends the worker when the case runs
    past its time limit, so a hung client cannot hang the benchmark.
    """

    def __init__(self, spec: CaseSpec, requests: int) -> None:
        self.spec = spec
        self.result = CaseResult(label=spec.label, concurrency=spec.concurrency, requests=requests)
        self.errors: Counter[str] = Counter()
        self.samples: dict[str, str] = {}
        self.warming = True
        self._clock: harness.Clock | None = None
        self._watchdog = harness.Watchdog(spec.timeout, self._expire)

    def arm(self) -> None:
        """Start the time limit."""
        self._watchdog.start()

    def success(self, count: int = 1) -> None:
        """Count successful responses (only the timed part's are kept)."""
        if not self.warming:
            self.result.ok += count

    def failure(self, kind: str, message: str) -> None:
        """Count one failed request of the given kind."""
        key = f"{kind} (warm-up)" if self.warming else kind
        self.errors[key] += 1
        self.samples.setdefault(key, message[:300])

    def start_timing(self) -> None:
        """End the warm-up and start the clocks."""
        self.warming = False
        self._clock = harness.Clock(self.spec.cpu)
        self._clock.start()

    def stop_timing(self) -> None:
        """Stop the clocks."""
        if self._clock is not None:
            self._clock.stop()
            self.result.wall = self._clock.wall
            self.result.cpu = self._clock.cpu_time
            self.result.other_load = self._clock.other_load

    def report(self, status: str = "ok", note: str = "") -> None:
        """Print the result line for the parent (once; later calls do nothing)."""
        if not self._watchdog.claim():
            return
        result = self.result
        result.status = status
        if note:
            result.note = note
        result.errors = dict(self.errors)
        result.samples = dict(self.samples)
        result.peak_rss_kb = harness.peak_rss_kb()
        harness.report_result(RESULT_MARKER, result)

    def _expire(self) -> None:
        if self._clock is not None and self.result.wall == 0.0:
            self.stop_timing()
        done = self.result.ok + sum(v for k, v in self.errors.items() if "warm-up" not in k)
        note = (
            f"stopped at the {self.spec.timeout:.0f} s limit with "
            f"{done} of {self.result.requests} timed requests finished"
            + (" (still warming up)" if self.warming else "")
        )
        self.report("timeout", note)
        os._exit(0)


def _run_async(rec: Recorder, main: Coroutine[Any, Any, None], use_uvloop: bool) -> None:
    """Run ``main`` on a new loop (uvloop's if asked and installed), noting which."""
    factory = harness.uvloop_factory() if use_uvloop else None
    rec.result.loop = "uvloop" if factory is not None else "asyncio"
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


async def _limited(
    rec: Recorder, call: Callable[[int], Awaitable[str | None]], total: int, concurrency: int
) -> None:
    """Run ``call(i)`` for ``i < total`` with at most ``concurrency`` in flight.

    ``call`` returns None on success, or an error kind; an exception is a failure too.
    """
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with semaphore:
            try:
                kind = await call(i)
            except Exception as exc:
                rec.failure(harness.error_kind(exc), str(exc) or repr(exc))
                return
        if kind is None:
            rec.success()
        else:
            rec.failure(kind, kind)

    await asyncio.gather(*(one(i) for i in range(total)))


def _worker_sdk(rec: Recorder, spec: CaseSpec, use_aiohttp: bool) -> None:
    import openai

    conversations = harness.sample_conversations(spec.concurrency)

    async def main() -> None:
        http_client = None
        if use_aiohttp:
            factory = getattr(openai, "DefaultAioHttpClient", None)
            if factory is None:
                rec.report("unavailable", f"openai {openai.__version__} has no aiohttp transport")
                return
            try:
                http_client = factory()
            except RuntimeError as exc:
                rec.report("unavailable", str(exc))
                return
        client = openai.AsyncOpenAI(
            base_url=spec.base_urls[0], api_key="x", max_retries=0, http_client=http_client
        )

        async def call(i: int) -> str | None:
            completion = await client.chat.completions.create(
                model=MODEL,
                messages=conversations[i % len(conversations)],  # type: ignore[arg-type]
                max_tokens=harness.MAX_TOKENS,
            )
            if completion.choices[0].message.content != ANSWER:
                return "unexpected body"
            return None

        try:
            await _limited(rec, call, spec.concurrency, spec.concurrency)
            rec.start_timing()
            await _limited(rec, call, spec.requests, spec.concurrency)
            rec.stop_timing()
        finally:
            await client.close()

    _run_async(rec, main(), use_uvloop=False)


def _worker_floor(rec: Recorder, spec: CaseSpec) -> None:
    import aiohttp
    import orjson

    conversations = harness.sample_conversations(spec.concurrency)
    urls = [f"{base}/chat/completions" for base in spec.base_urls]
    headers = {"Content-Type": "application/json", "Authorization": "Bearer x"}
    batches, _ = _batch_total(spec)

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=8192)
        timeout = aiohttp.ClientTimeout(total=spec.timeout)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def post(i: int, messages: Messages) -> None:
                payload = {"model": MODEL, "messages": messages, "max_tokens": harness.MAX_TOKENS}
                try:
                    async with session.post(
                        urls[i % len(urls)], data=orjson.dumps(payload), headers=headers
                    ) as answer:
                        body = await answer.read()
                        if answer.status != 200:
                            rec.failure(
                                f"HTTP {answer.status}", body[:200].decode(errors="replace")
                            )
                            return
                    content = orjson.loads(body)["choices"][0]["message"]["content"]
                except Exception as exc:
                    rec.failure(harness.error_kind(exc), str(exc) or repr(exc))
                    return
                if content == ANSWER:
                    rec.success()
                else:
                    rec.failure("unexpected body", repr(content))

            async def batch() -> None:
                await asyncio.gather(*(post(i, m) for i, m in enumerate(conversations)))

            await batch()
            rec.start_timing()
            for _ in range(batches):
                await batch()
            rec.stop_timing()

    _run_async(rec, main(), use_uvloop=True)


def _ours_options() -> Any:
    """Options asking for at most ``harness.MAX_TOKENS`` tokens, like the SDK rows."""
    from llm_annotator.clients.base import ProviderRuntimeOptions

    try:
        from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions
    except ImportError:
        return ProviderRuntimeOptions(max_completion_tokens=harness.MAX_TOKENS)
    return VLLMOnlineRuntimeOptions(max_completion_tokens=harness.MAX_TOKENS)


def _tally_responses(rec: Recorder, responses: Sequence[Any], expected: int) -> None:
    if len(responses) != expected:
        rec.failure("wrong response count", f"{len(responses)} responses for {expected} inputs")
    good = 0
    for response in responses:
        if response.ok and response.text == ANSWER:
            good += 1
        elif response.ok:
            rec.failure("unexpected text", repr(response.text))
        else:
            rec.failure(str(response.error_type or "error"), str(response.error))
    rec.success(good)


@dataclass
class _Ours:
    """What both cases of our client need: its class, one batch, the batch count, options."""

    client_class: Any
    conversations: list[Messages]
    batches: int
    options: Any


def _prepare_ours(rec: Recorder, spec: CaseSpec) -> _Ours | None:
    """Our client's case set up, or None (reported unavailable) when it cannot be imported."""
    try:
        from llm_annotator.clients.vllm_online_client import VLLMOnlineClient
    except ImportError as exc:
        rec.report("unavailable", f"VLLMOnlineClient cannot be imported: {exc}")
        return None
    conversations = harness.sample_conversations(spec.concurrency)
    batches, _ = _batch_total(spec)
    return _Ours(VLLMOnlineClient, conversations, batches, _ours_options())


def _worker_ours_sync(rec: Recorder, spec: CaseSpec) -> None:
    ours = _prepare_ours(rec, spec)
    if ours is None:
        return
    conversations, options = ours.conversations, ours.options
    client = ours.client_class(model=MODEL, base_url=spec.base_urls[0], max_retries=0)

    def batch() -> None:
        try:
            responses = client.batch_generate(messages=conversations, options=options)
        except Exception as exc:
            for _ in conversations:
                rec.failure(harness.error_kind(exc), str(exc) or repr(exc))
            return
        _tally_responses(rec, responses, len(conversations))

    try:
        batch()
        rec.result.loop = _library_loop_name()
        rec.start_timing()
        for _ in range(ours.batches):
            batch()
        rec.stop_timing()
    finally:
        client.close()


def _library_loop_name() -> str:
    """The event loop the synchronous API ran on, as far as can be told from outside."""
    for thread in threading.enumerate():
        if thread.name.startswith("llm-annotator"):
            try:
                from llm_annotator import _sync

                loop = _sync._RUNNER._loop
            except (ImportError, AttributeError):
                break
            module = type(loop).__module__
            return "uvloop" if module.startswith("uvloop") else "asyncio"
    return "library's loop"


def _worker_ours_async(rec: Recorder, spec: CaseSpec) -> None:
    ours = _prepare_ours(rec, spec)
    if ours is None:
        return
    conversations, options = ours.conversations, ours.options
    ways = len(spec.base_urls)
    cut = [len(conversations) * k // ways for k in range(ways + 1)]
    parts = [conversations[cut[k] : cut[k + 1]] for k in range(ways)]

    async def main() -> None:
        clients = [
            ours.client_class(model=MODEL, base_url=url, max_retries=0) for url in spec.base_urls
        ]

        async def batch() -> None:
            outcomes = await asyncio.gather(
                *(
                    cl.abatch_generate(messages=part, options=options)
                    for cl, part in zip(clients, parts, strict=True)
                ),
                return_exceptions=True,
            )
            for part, outcome in zip(parts, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    for _ in part:
                        rec.failure(harness.error_kind(outcome), str(outcome) or repr(outcome))
                else:
                    _tally_responses(rec, outcome, len(part))

        try:
            await batch()
            rec.start_timing()
            for _ in range(ours.batches):
                await batch()
            rec.stop_timing()
        finally:
            await asyncio.gather(*(cl.aclose() for cl in clients), return_exceptions=True)

    _run_async(rec, main(), use_uvloop=True)


def worker(spec: CaseSpec) -> None:
    """Measure one case in this process and print its result line."""
    harness.pin_worker(spec.cpu)
    requests = spec.requests
    if spec.kind in ("floor", "ours_sync", "ours_async"):
        _, requests = _batch_total(spec)
    rec = Recorder(spec, requests)
    rec.arm()
    runners: dict[CaseKind, Callable[[], None]] = {
        "sdk": lambda: _worker_sdk(rec, spec, use_aiohttp=False),
        "sdk_aiohttp": lambda: _worker_sdk(rec, spec, use_aiohttp=True),
        "floor": lambda: _worker_floor(rec, spec),
        "ours_sync": lambda: _worker_ours_sync(rec, spec),
        "ours_async": lambda: _worker_ours_async(rec, spec),
    }
    try:
        runners[spec.kind]()
    except Exception as exc:
        rec.report("crashed", f"{type(exc).__name__}: {exc}")
        raise
    rec.report()


# --------------------------------------------------------------------------------------
# Parent side: starts nginx, runs each case in its own subprocess, prints the table
# --------------------------------------------------------------------------------------


def run_case(spec: CaseSpec, server: CannedServer, server_cpu: int) -> CaseResult:
    """Run ``spec`` in a fresh worker subprocess and read back its result.

    Around it, nginx's counters give the connections the client opened, and
    ``harness.watch_server`` the share of nginx's core other work took and the TCP
    counters that rose.
    """
    before = server.counters()
    result = harness.watch_server(server, server_cpu, partial(_run_worker, spec))
    after = server.counters()
    if before is not None and after is not None:
        result.connections = after[0] - before[0]
    return result


def _run_worker(spec: CaseSpec) -> CaseResult:
    done = harness.run_worker(__file__, spec, RESULT_MARKER, spec.timeout + 30)
    if done.data is None:
        status, note = done.failure(15)
        return CaseResult(spec.label, spec.concurrency, spec.requests, status=status, note=note)
    result = CaseResult(**done.data)
    if result.status == "crashed":
        result.note += "\n" + done.tail(15)
    return result


def _sysctl(name: str) -> str:
    path = Path("/proc/sys") / name.replace(".", "/")
    try:
        return path.read_text().strip()
    except OSError:
        return "?"


def build_cases(args: argparse.Namespace, base_urls: Sequence[str], cpu: int) -> list[CaseSpec]:
    """The cases to run, in order, filtered by ``--only`` (a set of groups, or None)."""
    ours_n = args.requests
    sdk_n = args.sdk_requests
    urls = tuple(base_urls)
    one = urls[:1]
    table: list[tuple[str, CaseKind, str, int, int, tuple[str, ...]]] = [
        ("sdk", "sdk", "openai AsyncOpenAI default (httpx2, asyncio)", 512, sdk_n, one),
        ("sdk", "sdk", "openai AsyncOpenAI default (httpx2, asyncio)", 4096, sdk_n, one),
        ("sdk", "sdk_aiohttp", "openai AsyncOpenAI + DefaultAioHttpClient", 512, sdk_n, one),
        ("floor", "floor", "floor: plain aiohttp + orjson, 4 ports", 512, ours_n, urls),
        ("floor", "floor", "floor: plain aiohttp + orjson, 4 ports", 4096, ours_n, urls),
        ("ours", "ours_sync", "ours: batch_generate, 1 client, 1 port", 512, ours_n, one),
        ("ours", "ours_sync", "ours: batch_generate, 1 client, 1 port", 4096, ours_n, one),
        ("ours", "ours_async", "ours: abatch_generate x4 ports", 512, ours_n, urls),
        ("ours", "ours_async", "ours: abatch_generate x4 ports", 4096, ours_n, urls),
    ]
    return [
        CaseSpec(kind, label, c, n, case_urls, cpu, args.case_timeout)
        for group, kind, label, c, n, case_urls in table
        if args.only is None or group in args.only
    ]


def _title(spec: CaseSpec) -> str:
    return f"{spec.label} at {spec.concurrency:,} in flight"


def _label(result: CaseResult) -> str:
    if result.loop and result.loop not in result.label:
        return f"{result.label} [{result.loop}]"
    return result.label


def print_results(results: Sequence[CaseResult]) -> None:
    """Print one row per case, then the errors and notes of the rows that need them."""
    header = ["client", "in flight", "requests", "ok", "wall s", "req/s", "CPU us/req"]
    header += ["RSS MB", "conns", "other % cl/srv"]
    rows: list[tuple[str, ...]] = []
    for r in results:
        if r.status == "unavailable":
            rows.append((_label(r), str(r.concurrency), "-", "-", "-", "n/a", "-", "-", "-", "-"))
            continue
        rps, cpu = r.rps, r.cpu_us_per_request
        rows.append(
            (
                _label(r),
                f"{r.concurrency:,}",
                f"{r.requests:,}",
                f"{r.ok:,}",
                f"{r.wall:.2f}" if r.wall else "-",
                f"{rps:,.0f}" if rps is not None else "FAILED",
                f"{cpu:,.0f}" if cpu is not None else "-",
                f"{r.peak_rss_kb / 1024:.0f}" if r.peak_rss_kb else "-",
                f"{r.connections:,}" if r.connections is not None else "-",
                harness.percent(r.other_load) + "/" + harness.percent(r.server_other_load),
            )
        )
    harness.print_table(header, rows)
    harness.print_noisy(results, NOISY, " ('other %': client core / nginx core)")
    harness.print_notes([r for r in results if not r.passed or r.tcp], _headline)


def _headline(r: CaseResult) -> str:
    status = r.status
    if r.passed:
        status = "passed"
    elif status == "ok":
        failed = r.requests - r.ok
        status = f"failed: {failed:,} of {r.requests:,} timed requests did not succeed"
    return f"{_label(r)} at {r.concurrency:,} in flight: {status}"


def _find(results: Sequence[CaseResult], label_start: str, c: int) -> CaseResult | None:
    for r in results:
        if r.label.startswith(label_start) and r.concurrency == c:
            return r
    return None


def print_targets(results: Sequence[CaseResult]) -> None:
    """Print the two target lines (and the async twin's figures beside them)."""
    print()
    for name, prefix in (
        ("ours", "ours: batch_generate"),
        ("ours (abatch_generate x4 ports)", "ours: abatch_generate"),
    ):
        row = _find(results, prefix, 4096)
        if row is not None and row.status == "unavailable":
            text = "n/a (client not available)"
        else:
            text = harness.rate_verdict(row, TARGET_RPS_4096, "req/s")
        print(f"{name} at 4096 in flight: {text}")
    sdk = _find(results, "openai AsyncOpenAI default", 512)
    for name, prefix in (
        ("ours", "ours: batch_generate"),
        ("ours (abatch_generate x4 ports)", "ours: abatch_generate"),
    ):
        text = harness.ratio_verdict(_find(results, prefix, 512), sdk, TARGET_RATIO_512)
        print(f"{name} / SDK default at 512: {text}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_number(
        parser,
        "--requests",
        40_000,
        "timed requests per case for our client and the aiohttp floor (default 40,000)",
    )
    harness.add_number(
        parser,
        "--sdk-requests",
        10_000,
        "timed requests per case for the OpenAI SDK (default 10,000)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: about 2,000 requests per case"
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated groups to run: sdk, floor, ours (default: all)",
    )
    harness.add_case_timeout(parser, 60.0)
    harness.add_number(
        parser,
        "--backlog",
        4096,
        "nginx listen backlog per port (nginx's own default is 511; default 4096)",
    )
    harness.add_wait_idle(parser, "case", "for shared machines; default 0: do not wait")
    harness.add_attempts(parser, NOISY)
    harness.add_worker(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = args.sdk_requests = 2_000
    if min(args.requests, args.sdk_requests, args.attempts) < 1 or args.case_timeout <= 0:
        parser.error("--requests, --sdk-requests, --attempts and --case-timeout must be positive")
    args.only = harness.chosen(parser, "--only", args.only, GROUPS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the process exit code."""
    args = parse_args(argv)
    return harness.main_over_nginx(args, CaseSpec, worker, measure, backlog=args.backlog)


def measure(
    args: argparse.Namespace, server: CannedServer, client_cpu: int, server_cpu: int
) -> int:
    """Print the set-up, measure every case against ``server``, print the tables."""
    print(harness.versions("python", "openai", "httpx2", "aiohttp", "uvloop", "llm-annotator"))
    somaxconn = _sysctl("net.core.somaxconn")
    syn_backlog = _sysctl("net.ipv4.tcp_max_syn_backlog")
    print(
        f"clients pinned to CPU {client_cpu}, nginx (1 worker) to CPU {server_cpu}; "
        f"listen backlog {args.backlog} (somaxconn {somaxconn}, "
        f"tcp_max_syn_backlog {syn_backlog}); open-file limit "
        f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    )
    if client_cpu == server_cpu:
        print("warning: only one CPU is available, so nginx shares it with the clients")
    background = harness.print_background([client_cpu, server_cpu], "case")
    if background and max(background.values()) > 0.2:
        print(
            "warning: other processes keep these CPUs busy; the figures below will "
            "be low and noisy (see the 'other %' column)"
        )
    retry = harness.Retry(args.attempts, args.wait_idle, NOISY, AGAIN)
    cases = build_cases(args, server.base_urls, client_cpu)
    reports = (print_results, print_targets)
    cpus = (client_cpu, server_cpu)
    return harness.measure_cases(server, cpus, cases, run_case, _title, retry, reports, 15)


if __name__ == "__main__":
    sys.exit(main())
