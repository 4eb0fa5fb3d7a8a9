"""The pool's throughput on real vLLM servers, against driving the same servers plainly.

Starts two real CPU vLLM servers on the tiny model, of different speeds: each with its
own ``--max-num-seqs`` (``--max-num-seqs``, default 64 and 4: the second runs a sixteenth
of the first's batch). The Python with vLLM comes from ``scripts/vllm-env.sh`` or
``$LLM_ANNOTATOR_VLLM_PYTHON``. Then, in one run, it alternates these ways of sending
the same N conversations:

* pool: ``VLLMQueueAnnotator.batch_generate`` over both servers, ``batch_size`` and
  ``max_concurrent_batches_per_client`` set so that at most ``--in-flight`` requests are
  in flight per server (this version's dispatch with its defaults: slots that refill as
  answers arrive, ``adaptive=False``);
* pool-adaptive: the same with ``adaptive=True`` (each server's window sized from its
  ``/metrics``);
* pool@REV (with ``--against REV``): the same call on the library of an older commit
  (a git worktree of it, in a worker process that keeps its pool from round to round),
  for instance one from before a change of the dispatch;
* vllm-bench: vLLM's own benchmark client (``vllm bench serve``, from the vLLM
  environment) driving each server on its own, both at once, each with half of the
  conversations at ``--in-flight`` concurrency; its figure is the sum of the two
  clients' rows per second, each over its own duration (what the servers do when each
  is kept busy by a dedicated client, whatever the split);
* annotate: ``VLLMQueueAnnotator.annotate`` over the same N rows, as a JSONL file, to
  the consolidated ``annotations.parquet`` (a fresh run directory each time);
* plain: one ``VLLMOnlineClient`` per server, each given half of the conversations,
  ``max_workers`` = ``--in-flight``, run together with ``asyncio.gather`` of their
  ``abatch_generate`` (on uvloop, like the library's own loop).

Every way runs once per round, in an order that rotates from round to round; the
summary takes each way's median, and the preemptions the servers counted during it
(``vllm:num_preemptions_total``). Requests ask for ``max_completion_tokens`` 8 at
temperature 1.0 with no seed (vLLM 0.32's CPU build kills its engine on seeded requests
under load). Each server's processes are pinned to a CPU of their own (``--no-pin``
leaves them free), as servers on separate GPUs would be: unpinned on a small machine
they compete for every core, and a server that burns CPU on small batches slows the
other, so the rows per second then follow which server the OS favours more than the
pool's scheduling. Each run shows the CPU the benchmark process and the servers used,
and the share of the machine other processes took (a high figure means a noisy run).

Run it as::

    python benchmarks/vllm_pool.py            # N=4,000, 3 rounds: about five minutes
    python benchmarks/vllm_pool.py --quick    # N=1,000, 2 rounds: about two minutes
    python benchmarks/vllm_pool.py --against 85f15d7   # also the pool of that commit

Targets: the pool (and the annotation job) at least 95% of plain's rows per second;
the pool at least as fast as vllm-bench and as the older commit's pool, with no more
preemptions.
The exit code is 0 whether or not it is met, and non-zero only when the harness fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _against
import _harness as harness
from _nginx import group_cpu_seconds, pin_group

TARGET_SHARE = 0.95
MAX_TOKENS = 8
TEMPERATURE = 1.0
BATCHES_PER_MEMBER = 4
TEMPLATE = "Is this review positive or negative? Answer in one word.\n\nReview: {text}"
WAYS = ("pool", "pool-adaptive", "vllm-bench", "plain", "annotate")
"""The ways of sending; ``--against REV`` adds ``pool@REV``."""
ANSWER = {"from": "gpt", "value": "positive"}
"""The second turn vLLM's ShareGPT reader wants (unused: the output length is fixed)."""
BENCH_SCRIPT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
"""``vllm bench serve`` without the ``vllm`` command (which needs vLLM's package metadata)."""


@dataclass
class RunResult:
    """One timed run of one way.

    Attributes:
        way: One of :data:`WAYS`, or ``pool@REV``.
        round: The round it ran in (from 1).
        samples: Conversations sent.
        wall: Seconds of the call.
        ok: Answers without an error.
        errors: Error answers by type.
        output_tokens: Output tokens of the answers.
        client_cpu: CPU seconds this process used (with vllm-bench, its clients').
        server_cpu: CPU seconds the servers used.
        other_load: Share of the machine's CPU other processes took, or None.
        preemptions: Requests the servers preempted during the run, or None.
        bench_rps: For vllm-bench, the sum of each client's rows per second.
    """

    way: str
    round: int
    samples: int
    wall: float = 0.0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    client_cpu: float = 0.0
    server_cpu: float = 0.0
    other_load: float | None = None
    preemptions: float | None = None
    bench_rps: float | None = None

    @property
    def rps(self) -> float:
        """Answers per second (errors count: a failed run is flagged, not hidden)."""
        if self.bench_rps is not None:
            return self.bench_rps
        return self.samples / self.wall if self.wall else 0.0


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (vLLM's benchmark clients)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tally(result: RunResult, responses: Sequence[Any]) -> None:
    errors: Counter[str] = Counter()
    for response in responses:
        if response.ok:
            result.ok += 1
            result.output_tokens += response.num_output_tokens or 0
        else:
            errors[str(response.error_type or "error")] += 1
    result.errors = dict(errors)


class OlderPool:
    """``pool@REV``: a worker process that runs the library of an older commit (from
    ``tree``) and keeps its pool from call to call; each :meth:`run` is one
    ``batch_generate`` of the conversations there, timed by the caller around it.
    """

    def __init__(
        self,
        tree: Path,
        base_urls: Sequence[str],
        settings: dict[str, Any],
        conversations: list[list[dict[str, str]]],
    ) -> None:
        spec = {
            "base_urls": list(base_urls),
            "settings": settings,
            "conversations": conversations,
            "options": {"max_completion_tokens": MAX_TOKENS, "temperature": TEMPERATURE},
        }
        self._process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--older-pool", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_against.environment(tree),
        )
        self._say(json.dumps(spec))
        self._hear()  # its pool's first call is made

    def _say(self, line: str) -> None:
        assert self._process.stdin is not None
        self._process.stdin.write(line + "\n")
        self._process.stdin.flush()

    def _hear(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the older pool's worker ended (exit {self._process.wait()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def cpu_seconds(self) -> float:
        """CPU seconds the worker has used so far (0 once it is gone)."""
        try:
            with open(f"/proc/{self._process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def run(self) -> dict[str, Any]:
        """One call: ``ok``, ``output_tokens`` and ``errors`` by type."""
        self._say("run")
        return self._hear()

    def close(self) -> None:
        """End the worker."""
        with contextlib.suppress(OSError):
            assert self._process.stdin is not None
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def older_pool_worker(_: str) -> int:
    """The worker's side of :class:`OlderPool`: a spec line, then one call per
    ``run`` line, each answered with one JSON line."""
    from llm_annotator import VLLMOnlineRuntimeOptions, VLLMQueueAnnotator

    harness.EventLog().install()  # its events stay out of the parent's tables
    spec = json.loads(sys.stdin.readline())
    options = VLLMOnlineRuntimeOptions(**spec["options"])
    conversations = spec["conversations"]
    with VLLMQueueAnnotator(spec["base_urls"], **spec["settings"]) as pool:
        pool.batch_generate(messages=conversations[:200], options=options)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() != "run":
                continue
            result = RunResult(way="older", round=0, samples=len(conversations))
            _tally(result, pool.batch_generate(messages=conversations, options=options))
            answer = {"ok": result.ok, "output_tokens": result.output_tokens}
            print(json.dumps({**answer, "errors": result.errors}), flush=True)
    return 0


class Bench:
    """The servers, the pool, the inputs, and one method per way of sending."""

    def __init__(self, servers: Any, args: argparse.Namespace, folder: Path) -> None:
        from llm_annotator import VLLMOnlineRuntimeOptions, VLLMQueueAnnotator

        self.servers = servers
        self.args = args
        self.folder = folder
        self.model = servers.model
        self.groups = [server.pid for server in servers]
        texts = [
            f"Review {i}: the {('blender', 'lamp', 'kettle', 'chair')[i % 4]} is "
            f"{('great', 'poor', 'fine')[i % 3]} and arrived on day {i % 28 + 1}."
            for i in range(args.samples)
        ]
        self.conversations = [
            [{"role": "user", "content": TEMPLATE.format(text=text)}] for text in texts
        ]
        self.input_path = folder / "input.jsonl"
        with self.input_path.open("w") as file:
            for i, text in enumerate(texts):
                file.write(f'{{"id": {i}, "text": "{text}"}}\n')
        self.options = VLLMOnlineRuntimeOptions(
            max_completion_tokens=MAX_TOKENS, temperature=TEMPERATURE
        )
        settings: dict[str, Any] = {
            "model": self.model,
            "batch_size": max(1, args.in_flight // BATCHES_PER_MEMBER),
            "max_concurrent_batches_per_client": BATCHES_PER_MEMBER,
        }
        self.settings = settings
        self.pool = VLLMQueueAnnotator(servers.base_urls, **settings)
        self.adaptive_pool = VLLMQueueAnnotator(servers.base_urls, adaptive=True, **settings)
        self.older: OlderPool | None = None
        self.jobs = 0
        # In ShareGPT's layout: vLLM's benchmark reads it with json alone (its custom
        # JSONL dataset needs pandas, which the vLLM environment lacks).
        self.prompts = folder / "prompts.json"
        turns = [
            {"conversations": [{"from": "human", "value": c[0]["content"]}, ANSWER]}
            for c in self.conversations
        ]
        self.prompts.write_text(json.dumps(turns))

    def warm_pools(self) -> None:
        """One small call on each pool, so that no way's first round also pays for its
        pool's first call (its connections and probes)."""
        part = self.conversations[: min(200, len(self.conversations))]
        for pool in (self.pool, self.adaptive_pool):
            pool.batch_generate(messages=part, options=self.options)

    def start_older(self, tree: Path) -> None:
        """Start the worker of ``pool@REV`` on the library in ``tree`` (its pool's
        first call is made there, not counted)."""
        self.older = OlderPool(tree, self.servers.base_urls, self.settings, self.conversations)

    def close(self) -> None:
        """Close the pools' connections (and the older commit's worker)."""
        self.pool.close()
        self.adaptive_pool.close()
        if self.older is not None:
            self.older.close()

    def run(self, way: str, round_number: int) -> RunResult:
        """Time one run of ``way``, with the CPU figures around it."""
        result = RunResult(way=way, round=round_number, samples=len(self.conversations))
        methods: dict[str, Callable[[RunResult], None]] = {
            "pool": self._pool,
            "pool-adaptive": self._adaptive_pool,
            "vllm-bench": self._vllm_bench,
            "annotate": self._annotate,
            "plain": self._plain,
        }
        preempted0 = self._preemptions()
        busy0, own0 = harness.busy_seconds(), self._client_cpu()
        servers0 = group_cpu_seconds(self.groups)
        wall0 = time.perf_counter()
        methods.get(way, self._older_pool)(result)
        wall = time.perf_counter() - wall0
        busy1, own1 = harness.busy_seconds(), self._client_cpu()
        servers1 = group_cpu_seconds(self.groups)
        if not result.wall:
            result.wall = wall
        result.client_cpu = own1 - own0
        result.server_cpu = servers1 - servers0
        ours = result.client_cpu + result.server_cpu
        result.other_load = harness.machine_other_load(busy0, busy1, ours, wall)
        preempted1 = self._preemptions()
        if preempted0 is not None and preempted1 is not None:
            result.preemptions = preempted1 - preempted0
        return result

    def _preemptions(self) -> float | None:
        """The servers' preemption counters summed, or None if one cannot be read."""
        from llm_annotator.clients.metrics import engine_load

        total = 0.0
        for url in self.servers.base_urls:
            root = url.removesuffix("/v1")
            try:
                with urllib.request.urlopen(root + "/metrics", timeout=10) as answer:
                    load = engine_load(answer.read())
            except OSError:
                return None
            if load is None or load.preemptions is None:
                return None
            total += load.preemptions
        return total

    def _pool(self, result: RunResult) -> None:
        responses = self.pool.batch_generate(messages=self.conversations, options=self.options)
        _tally(result, responses)

    def _adaptive_pool(self, result: RunResult) -> None:
        responses = self.adaptive_pool.batch_generate(
            messages=self.conversations, options=self.options
        )
        _tally(result, responses)

    def _client_cpu(self) -> float:
        """CPU seconds of this process, its reaped children and the older pool's worker."""
        older = self.older.cpu_seconds() if self.older is not None else 0.0
        return harness.cpu_seconds() + _children_cpu() + older

    def _older_pool(self, result: RunResult) -> None:
        """``pool@REV``: the call made by the older commit's worker."""
        assert self.older is not None, "pool@REV needs --against REV"
        answered = self.older.run()
        result.ok, result.output_tokens = answered["ok"], answered["output_tokens"]
        result.errors = answered["errors"]

    def _vllm_bench(self, result: RunResult) -> None:
        """vLLM's benchmark client on each server, at once, each with half the prompts."""
        urls = self.servers.base_urls
        halves = [len(self.conversations) * k // len(urls) for k in range(len(urls) + 1)]
        procs = []
        outputs = []
        for k, url in enumerate(urls):
            output = self.folder / f"bench-{k}.json"
            output.unlink(missing_ok=True)
            outputs.append(output)
            command = [
                self.args.vllm_python,
                "-c",
                BENCH_SCRIPT,
                "--backend",
                "openai-chat",
                "--base-url",
                url.removesuffix("/v1"),
                "--endpoint",
                "/v1/chat/completions",
                "--model",
                self.model,
                "--tokenizer",
                str(self.args.model_dir),
                "--dataset-name",
                "sharegpt",
                "--dataset-path",
                str(self.prompts),
                "--sharegpt-output-len",
                str(MAX_TOKENS),
                "--num-prompts",
                str(halves[k + 1] - halves[k]),
                "--max-concurrency",
                str(self.args.in_flight),
                "--temperature",
                str(TEMPERATURE),
                "--disable-tqdm",
                "--save-result",
                "--save-detailed",
                "--result-dir",
                str(self.folder),
                "--result-filename",
                output.name,
            ]
            log = (self.folder / f"bench-{k}.log").open("w")
            procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        for k, proc in enumerate(procs):
            if proc.wait(timeout=1800) != 0 or not outputs[k].exists():
                tail = (self.folder / f"bench-{k}.log").read_text()[-2000:]
                raise RuntimeError(f"vllm bench serve failed on {urls[k]}:\n{tail}")
        reports = [json.loads(output.read_text()) for output in outputs]
        result.wall = max(float(report["duration"]) for report in reports)
        result.bench_rps = sum(float(report["request_throughput"]) for report in reports)
        result.ok = sum(int(report["completed"]) for report in reports)
        errors: Counter[str] = Counter()
        for report in reports:
            for error in report.get("errors") or ():
                if error:
                    errors[str(error).strip().splitlines()[-1][:80]] += 1
        failed = sum(int(report.get("failed", 0)) for report in reports)
        if failed and not errors:
            errors["failed"] = failed
        result.errors = dict(errors)
        result.output_tokens = sum(int(report["total_output_tokens"]) for report in reports)

    def _annotate(self, result: RunResult) -> None:
        import pyarrow.parquet as pq

        self.jobs += 1
        out = self.folder / f"job-{self.jobs}"
        wall0 = time.perf_counter()
        done = self.pool.annotate(
            str(self.input_path),
            TEMPLATE,
            out,
            id_column="id",
            options=self.options,
            progress=False,
        )
        result.wall = time.perf_counter() - wall0
        table = pq.read_table(done.output_path, columns=["error_type", "num_output_tokens"])
        types = table.column("error_type").to_pylist()
        result.ok = done.num_succeeded
        result.errors = dict(Counter(str(t) for t in types if t))
        if done.num_failed and not result.errors:
            result.errors = {"error": done.num_failed}
        result.output_tokens = sum(t or 0 for t in table.column("num_output_tokens").to_pylist())
        shutil.rmtree(out, ignore_errors=True)

    def _plain(self, result: RunResult) -> None:
        from llm_annotator import VLLMOnlineClient

        urls = self.servers.base_urls
        ways = len(urls)
        cut = [len(self.conversations) * k // ways for k in range(ways + 1)]
        parts = [self.conversations[cut[k] : cut[k + 1]] for k in range(ways)]

        async def main() -> list[Any]:
            clients = [
                VLLMOnlineClient(
                    model=self.model,
                    base_url=url,
                    max_workers=self.args.in_flight,
                    max_retries=0,
                    on_error="ignore",
                )
                for url in urls
            ]
            try:
                wall0 = time.perf_counter()
                answers = await asyncio.gather(
                    *(
                        client.abatch_generate(messages=part, options=self.options)
                        for client, part in zip(clients, parts, strict=True)
                    )
                )
                result.wall = time.perf_counter() - wall0
            finally:
                await asyncio.gather(*(client.aclose() for client in clients))
            return [response for part in answers for response in part]

        with asyncio.Runner(loop_factory=harness.uvloop_factory()) as runner:
            _tally(result, runner.run(main()))


class Fleet:
    """Local vLLM servers on the tiny model, one per ``--max-num-seqs`` value, started
    together; seen as one group (``base_urls``, ``model``, iteration, ``stop``)."""

    def __init__(self, max_num_seqs: Sequence[int], startup_timeout: float) -> None:
        from llm_annotator.local import start_local_servers
        from llm_annotator.local.process import wait_all_healthy

        self.groups: list[Any] = []
        try:
            for seqs in max_num_seqs:
                self.groups.append(
                    start_local_servers(1, extra_args=["--max-num-seqs", str(seqs)], wait=False)
                )
            wait_all_healthy(list(self), startup_timeout)
        except BaseException:
            self.stop()
            raise

    def __iter__(self) -> Any:
        return (server for group in self.groups for server in group)

    @property
    def base_urls(self) -> list[str]:
        return [url for group in self.groups for url in group.base_urls]

    @property
    def model(self) -> str:
        return str(self.groups[0].model)

    def stop(self) -> None:
        for group in self.groups:
            group.stop()


def print_runs(runs: Sequence[RunResult]) -> None:
    """One line per run."""
    header = ["round", "way", "samples", "ok", "wall s", "rows/s", "out tok/s"]
    header += ["client CPU s", "servers CPU s", "other %", "preempted"]
    rows = [
        (
            str(r.round),
            r.way,
            f"{r.samples:,}",
            f"{r.ok:,}",
            f"{r.wall:.2f}",
            f"{r.rps:,.0f}",
            f"{r.output_tokens / r.wall:,.0f}" if r.wall else "-",
            f"{r.client_cpu:.1f}",
            f"{r.server_cpu:.1f}",
            harness.percent(r.other_load),
            "-" if r.preemptions is None else f"{r.preemptions:,.0f}",
        )
        for r in runs
    ]
    harness.print_table(header, rows)
    failed = [r for r in runs if r.errors or r.ok != r.samples]
    for r in failed:
        shown = ", ".join(f"{count:,} x {kind}" for kind, count in r.errors.items())
        print(f"* round {r.round} {r.way}: {r.samples - r.ok:,} without an answer ({shown})")
    noisy = [r for r in runs if (r.other_load or 0.0) > harness.MACHINE_NOISY]
    if noisy:
        print(
            f"noisy: {len(noisy)} run(s) shared the machine with other processes taking more "
            f"than {harness.MACHINE_NOISY:.0%} of its CPU; the medians below are less certain."
        )


def _good(r: RunResult) -> bool:
    """A run whose figure counts: every answer, except vLLM's benchmark client, whose
    requests on a reused connection the server had just closed fail (it does not send
    them again) and whose figure is its successes per second: up to a tenth may fail."""
    if r.way == "vllm-bench":
        return r.ok >= 0.9 * r.samples
    return not r.errors and r.ok == r.samples


def print_summary(runs: Sequence[RunResult]) -> None:
    """Each way's median, and the pool against the other ways, PASS or MISS."""
    print()
    medians: dict[str, float] = {}
    rows = []
    ways = [*WAYS, *dict.fromkeys(r.way for r in runs if r.way not in WAYS)]  # pool@REV
    for way in ways:
        good = [r.rps for r in runs if r.way == way and _good(r)]
        counted = [r.preemptions for r in runs if r.way == way and r.preemptions is not None]
        preempted = f"{statistics.median(counted):,.0f}" if counted else "-"
        if not good:
            rows.append((way, "0", "-", "-", "-", preempted))
            continue
        medians[way] = statistics.median(good)
        rows.append(
            (
                way,
                str(len(good)),
                f"{medians[way]:,.0f}",
                f"{min(good):,.0f}",
                f"{max(good):,.0f}",
                preempted,
            )
        )
    header = ("way", "good runs", "median rows/s", "min", "max", "median preempted")
    harness.print_table(header, rows)
    print()
    comparisons = (
        ("pool", "plain", TARGET_SHARE),
        ("annotate", "plain", TARGET_SHARE),
        ("pool", "vllm-bench", 1.0),
        *(("pool", way, 1.0) for way in medians if way.startswith("pool@")),
    )
    for way, other, target in comparisons:
        mine, theirs = medians.get(way), medians.get(other)
        if mine is None or theirs is None:
            print(f"{way} / {other}: no figure, a way had no good run (MISS)")
            continue
        share = mine / theirs
        verdict = "PASS" if share >= target else "MISS"
        print(f"{way} / {other} (medians): {share:.1%} (target >= {target:.0%}): {verdict}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    harness.add_number(parser, "--samples", 4000, "conversations per run (default 4,000)")
    harness.add_number(parser, "--rounds", 3, "runs of each way, alternated (default 3)")
    harness.add_number(parser, "--in-flight", 256, "requests in flight per server (default 256)")
    parser.add_argument("--quick", action="store_true", help="N=1,000, 2 rounds")
    harness.add_number(
        parser, "--startup-timeout", 600.0, "seconds the servers may take to start (default 600)"
    )
    parser.add_argument(
        "--max-num-seqs",
        default="64,4",
        help="vLLM's --max-num-seqs of each server, comma-separated (default 64,4)",
    )
    parser.add_argument(
        "--ways", default=",".join(WAYS), help=f"ways to run (default {','.join(WAYS)})"
    )
    _against.add_against(parser, "the pool (as the way pool@REV)")
    parser.add_argument("--older-pool", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="leave the servers unpinned (they then compete for every CPU)",
    )
    args = parser.parse_args(argv)
    try:
        args.max_num_seqs = [int(n) for n in args.max_num_seqs.split(",")]
    except ValueError:
        parser.error("--max-num-seqs takes integers, comma-separated")
    if len(args.max_num_seqs) < 1 or min(args.max_num_seqs) < 1:
        parser.error("--max-num-seqs needs one positive integer per server")
    args.ways = tuple(w for w in args.ways.split(",") if w)
    if not args.ways or set(args.ways) - set(WAYS):
        parser.error(f"--ways takes a comma-separated list of {', '.join(WAYS)}")
    if args.quick:
        args.samples, args.rounds = 1000, 2
    if min(args.samples, args.rounds, args.in_flight) < 1:
        parser.error("--samples, --rounds and --in-flight must be positive")
    return args


def pin_servers(servers: Fleet) -> str:
    """Pin each server's processes to a CPU of its own (in turn, if there are more
    servers than CPUs); what was done, for the log."""
    cpus = sorted(os.sched_getaffinity(0))
    done = []
    for k, server in enumerate(servers):
        cpu = cpus[k % len(cpus)]
        threads = pin_group(server.pid, {cpu})
        done.append(f"{server.base_url} on CPU {cpu} ({threads} threads)")
    return "pinned: " + "; ".join(done)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the process exit code."""
    args = parse_args(argv)
    if args.older_pool is not None:
        return older_pool_worker(args.older_pool)
    against = _against.short(args.against) if args.against else None
    if against is not None:
        args.ways = (*args.ways, f"pool@{against}")
        with _against.worktree(against) as tree:
            return _run(args, tree)
    return _run(args, None)


def _run(args: argparse.Namespace, tree: Path | None) -> int:
    """The benchmark: servers up, the rounds, the tables (see the module's docstring)."""
    harness.exit_on_sigterm()
    harness.EventLog().install()  # the library's events would interleave with the tables
    from llm_annotator.errors import LLMAnnotatorError
    from llm_annotator.local import ensure_tiny_model, find_vllm_python

    print(
        f"{harness.versions('python', 'llm-annotator')}, {os.cpu_count()} CPUs; starting "
        f"{len(args.max_num_seqs)} vLLM servers on the tiny model (--max-num-seqs "
        f"{', '.join(map(str, args.max_num_seqs))}) ...",
        flush=True,
    )
    started = time.monotonic()
    try:
        args.vllm_python = find_vllm_python()
        args.model_dir = ensure_tiny_model(python=args.vllm_python)
        servers = Fleet(args.max_num_seqs, args.startup_timeout)
    except LLMAnnotatorError as exc:
        print(f"error: the vLLM servers did not start: {exc}", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="vllm-pool-bench-"))
    bench: Bench | None = None
    try:
        print(
            f"servers healthy after {time.monotonic() - started:.0f} s: "
            f"{', '.join(servers.base_urls)}"
        )
        print(
            f"N={args.samples:,}, at most {args.in_flight} in flight per server (pool: "
            f"batch_size {max(1, args.in_flight // BATCHES_PER_MEMBER)} x "
            f"{BATCHES_PER_MEMBER} batches; plain: max_workers {args.in_flight}; vllm-bench: "
            f"--max-concurrency {args.in_flight}), max_completion_tokens {MAX_TOKENS}, "
            f"temperature {TEMPERATURE}, no seed, {args.rounds} rounds",
            flush=True,
        )
        if args.pin:
            print(pin_servers(servers), flush=True)
        bench = Bench(servers, args, folder)
        warm = bench.run("plain", 0)  # the servers' first requests are slow
        print(f"warm-up (plain, not counted): {warm.rps:,.0f} rows/s", flush=True)
        bench.warm_pools()
        if tree is not None:
            bench.start_older(tree)
        print("each pool's first call made (not counted)\n", flush=True)
        runs = []
        ways = args.ways
        for number in range(1, args.rounds + 1):
            shift = (number - 1) % len(ways)
            for way in ways[shift:] + ways[:shift]:
                print(f"round {number}: {way} ...", flush=True)
                runs.append(bench.run(way, number))
        print()
        print_runs(runs)
        print_summary(runs)
        dead = [s.base_url for s in servers if not s.is_running()]
        if dead:
            print(f"\nwarning: servers died during the run: {', '.join(dead)}")
            for server in servers:
                if not server.is_running():
                    print(server.tail_log())
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if bench is not None:
            bench.close()
        servers.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
