"""The pool's throughput on real vLLM servers, against driving the same servers plainly.

Starts two real CPU vLLM servers on the tiny model (``start_local_servers(2)``; the
Python with vLLM comes from ``scripts/vllm-env.sh`` or ``$LLM_ANNOTATOR_VLLM_PYTHON``),
then, in one run, alternates three ways of sending the same N conversations:

* pool: ``VLLMQueueAnnotator.batch_generate`` over both servers, ``batch_size`` and
  ``max_concurrent_batches_per_client`` set so that ``--in-flight`` requests are in
  flight per server;
* annotate: ``VLLMQueueAnnotator.annotate`` over the same N rows, as a JSONL file, to
  the consolidated ``annotations.parquet`` (a fresh run directory each time);
* plain: one ``VLLMOnlineClient`` per server, each given half of the conversations,
  ``max_workers`` = ``--in-flight``, run together with ``asyncio.gather`` of their
  ``abatch_generate`` (on uvloop, like the library's own loop).

Every way runs once per round, in an order that rotates from round to round; the
summary takes each way's median. Requests ask for ``max_completion_tokens`` 8 at
temperature 1.0 with no seed (vLLM 0.32's CPU build kills its engine on seeded requests
under load). The servers take both cores, so nothing is pinned; each run shows the CPU
the benchmark process and the servers used, and the share of the machine other
processes took (a high figure means a noisy run).

Run it as::

    python benchmarks/vllm_pool.py            # N=4,000, 3 rounds: about five minutes
    python benchmarks/vllm_pool.py --quick    # N=1,000, 2 rounds: about two minutes

Target: the pool (and the annotation job) at least 95% of plain's rows per second.
The exit code is 0 whether or not it is met, and non-zero only when the harness fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as harness
from _nginx import group_cpu_seconds

TARGET_SHARE = 0.95
MAX_TOKENS = 8
TEMPERATURE = 1.0
BATCHES_PER_MEMBER = 4
TEMPLATE = "Is this review positive or negative? Answer in one word.\n\nReview: {text}"
WAYS = ("pool", "plain", "annotate")


@dataclass
class RunResult:
    """One timed run of one way.

    Attributes:
        way: ``"pool"``, ``"annotate"`` or ``"plain"``.
        round: The round it ran in (from 1).
        samples: Conversations sent.
        wall: Seconds of the call.
        ok: Answers without an error.
        errors: Error answers by type.
        output_tokens: Output tokens of the answers.
        client_cpu: CPU seconds this process used.
        server_cpu: CPU seconds the servers used.
        other_load: Share of the machine's CPU other processes took, or None.
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

    @property
    def rps(self) -> float:
        """Answers per second (errors count: a failed run is flagged, not hidden)."""
        return self.samples / self.wall if self.wall else 0.0


def _tally(result: RunResult, responses: Sequence[Any]) -> None:
    errors: Counter[str] = Counter()
    for response in responses:
        if response.ok:
            result.ok += 1
            result.output_tokens += response.num_output_tokens or 0
        else:
            errors[str(response.error_type or "error")] += 1
    result.errors = dict(errors)


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
        self.pool = VLLMQueueAnnotator(
            servers.base_urls,
            model=self.model,
            batch_size=max(1, args.in_flight // BATCHES_PER_MEMBER),
            max_concurrent_batches_per_client=BATCHES_PER_MEMBER,
        )
        self.jobs = 0

    def close(self) -> None:
        """Close the pool's connections."""
        self.pool.close()

    def run(self, way: str, round_number: int) -> RunResult:
        """Time one run of ``way``, with the CPU figures around it."""
        result = RunResult(way=way, round=round_number, samples=len(self.conversations))
        methods: dict[str, Callable[[RunResult], None]] = {
            "pool": self._pool,
            "annotate": self._annotate,
            "plain": self._plain,
        }
        busy0, own0 = harness.busy_seconds(), harness.cpu_seconds()
        servers0 = group_cpu_seconds(self.groups)
        wall0 = time.perf_counter()
        methods[way](result)
        wall = time.perf_counter() - wall0
        busy1, own1 = harness.busy_seconds(), harness.cpu_seconds()
        servers1 = group_cpu_seconds(self.groups)
        if not result.wall:
            result.wall = wall
        result.client_cpu = own1 - own0
        result.server_cpu = servers1 - servers0
        ours = result.client_cpu + result.server_cpu
        result.other_load = harness.machine_other_load(busy0, busy1, ours, wall)
        return result

    def _pool(self, result: RunResult) -> None:
        responses = self.pool.batch_generate(messages=self.conversations, options=self.options)
        _tally(result, responses)

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


def print_runs(runs: Sequence[RunResult]) -> None:
    """One line per run."""
    header = ["round", "way", "samples", "ok", "wall s", "rows/s", "out tok/s"]
    header += ["client CPU s", "servers CPU s", "other %"]
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


def print_summary(runs: Sequence[RunResult]) -> None:
    """Each way's median, and the pool's share of plain's, PASS or MISS."""
    print()
    medians: dict[str, float] = {}
    rows = []
    for way in WAYS:
        good = [r.rps for r in runs if r.way == way and not r.errors and r.ok == r.samples]
        if not good:
            rows.append((way, "0", "-", "-", "-"))
            continue
        medians[way] = statistics.median(good)
        rows.append(
            (
                way,
                str(len(good)),
                f"{medians[way]:,.0f}",
                f"{min(good):,.0f}",
                f"{max(good):,.0f}",
            )
        )
    harness.print_table(("way", "good runs", "median rows/s", "min", "max"), rows)
    print()
    plain = medians.get("plain")
    for way, name in (("pool", "pool.batch_generate"), ("annotate", "pool.annotate")):
        mine = medians.get(way)
        if plain is None or mine is None:
            print(f"{name} / plain: no figure, a way had no good run (MISS)")
            continue
        share = mine / plain
        verdict = "PASS" if share >= TARGET_SHARE else "MISS"
        print(f"{name} / plain (medians): {share:.1%} (target >= {TARGET_SHARE:.0%}): {verdict}")


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
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 1000, 2
    if min(args.samples, args.rounds, args.in_flight) < 1:
        parser.error("--samples, --rounds and --in-flight must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; return the process exit code."""
    args = parse_args(argv)
    harness.exit_on_sigterm()
    harness.EventLog().install()  # the library's events would interleave with the tables
    from llm_annotator.errors import LLMAnnotatorError
    from llm_annotator.local import start_local_servers

    print(
        f"{harness.versions('python', 'llm-annotator')}, "
        f"{os.cpu_count()} CPUs; starting 2 vLLM servers on the tiny model ...",
        flush=True,
    )
    started = time.monotonic()
    try:
        servers = start_local_servers(2, startup_timeout=args.startup_timeout)
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
            f"N={args.samples:,}, {args.in_flight} in flight per server (pool: batch_size "
            f"{max(1, args.in_flight // BATCHES_PER_MEMBER)} x {BATCHES_PER_MEMBER} batches; "
            f"plain: max_workers {args.in_flight}), max_completion_tokens {MAX_TOKENS}, "
            f"temperature {TEMPERATURE}, no seed, {args.rounds} rounds",
            flush=True,
        )
        bench = Bench(servers, args, folder)
        warm = bench.run("plain", 0)  # the servers' first requests are slow
        print(f"warm-up (plain, not counted): {warm.rps:,.0f} rows/s\n", flush=True)
        runs = []
        for number in range(1, args.rounds + 1):
            shift = (number - 1) % len(WAYS)
            for way in WAYS[shift:] + WAYS[:shift]:
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
