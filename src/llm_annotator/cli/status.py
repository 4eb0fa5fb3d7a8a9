"""``llm-annotator status RUN_DIR``: how a run stands, from another terminal.

A file of the run directory that is not the job's own (a link, a FIFO, a record of the
wrong shape) is one line naming it, exit status 1 (``cli.main``), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from llm_annotator.jobs.watch.status import RunStatus

# The job layer is imported by the functions that read a run, not here: declaring the
# command (its --help) loads none of it.


def show_status(status: RunStatus, out: TextIO) -> None:
    """Print a run's status for people.

    Examples:
        >>> import io
        >>> from llm_annotator.jobs.watch.status import RunStatus
        >>> out = io.StringIO()
        >>> show_status(RunStatus("runs/a", "running", 41, "node-7", 200, 120, 118, 2,
        ...     {"read_timeout": 2}, {"http://a/v1": 70, "http://b/v1": 50},
        ...     rows_per_second=8.0, eta_seconds=10.0, updated="2026-12-01T10:00:00+00:00",
        ...     model="small", servers={"http://a/v1": {"state": "healthy", "evictions": 0},
        ...     "http://b/v1": {"state": "evicted", "evictions": 1}}), out)
        >>> print(out.getvalue())
        runs/a: running (pid 41 on node-7), status written 2026-12-01T10:00:00+00:00
          rows: 120 of 200 done (60.0%): 118 answered, 2 failed; 8.0 rows/s, ETA 10s
          failed by type: read_timeout 2
          rows by server: http://a/v1 70, http://b/v1 50
          servers at the last snapshot: http://a/v1 healthy, http://b/v1 evicted (evicted 1x)
          model: small
        <BLANKLINE>
    """
    from llm_annotator.jobs.watch.progress import duration

    on = f" on {status.host}" if status.host else ""
    who = f" (pid {status.pid}{on})" if status.pid is not None else ""
    when = f", status written {status.updated}" if status.updated else ""
    print(f"{status.output_dir}: {status.state}{who}{when}", file=out)
    total, done = status.total, status.done
    of = f" of {total} done ({done / total:.1%})" if total and done is not None else " done"
    rate = ""
    if status.rows_per_second is not None:
        rate = f"; {status.rows_per_second:,.1f} rows/s"
        if status.eta_seconds is not None:
            rate += f", ETA {duration(status.eta_seconds)}"
    answered = f"{status.succeeded} answered, {status.failed} failed"
    every = ""
    if status.mixed_inputs:
        known = f"{done}{of}" if done is not None else "not known yet (its job has not said)"
        print(f"  rows of this input: {known}{rate}", file=out)
        print(
            f"  the directory also holds rows of other inputs (left out of the output): "
            f"{status.stored} ids in all, {answered}",
            file=out,
        )
        every = " (every input)"
    else:
        print(f"  rows: {done}{of}: {answered}{rate}", file=out)
    if status.by_error_type:
        kinds = ", ".join(f"{kind} {n}" for kind, n in status.by_error_type.items())
        print(f"  failed by type{every}: {kinds}", file=out)
    if status.per_server:
        servers = ", ".join(f"{server} {n}" for server, n in status.per_server.items())
        print(f"  rows by server{every}: {servers}", file=out)
    if status.servers:
        servers = ", ".join(
            f"{url} {now['state']}"
            + (f" (evicted {now['evictions']}x)" if now.get("evictions") else "")
            for url, now in status.servers.items()
        )
        print(f"  servers at the last snapshot: {servers}", file=out)
    if status.model:
        print(f"  model: {status.model}", file=out)
    if status.sample:
        seed = status.sample.get("shuffle_seed")
        drawn = f" drawn with shuffle_seed {seed}" if seed is not None else ""
        print(f"  a trial run: limit {status.sample.get('limit')} rows{drawn}", file=out)
    if status.error:
        print(f"  error: {status.error}", file=out)


def show_corpus_status(status: dict[str, Any], out: TextIO) -> None:
    """Print a corpus job's status for people.

    Examples:
        >>> import io
        >>> out = io.StringIO()
        >>> show_corpus_status({"output_dir": "runs/c", "files": 30, "skipped_files": 1,
        ...     "units": 32, "units_done": 12, "rows": 1200, "succeeded": 1190, "failed": 10,
        ...     "by_error_type": {"read_timeout": 10}, "complete": False, "model": "small",
        ...     "processes": [{"where": "shard-0000-of-0002", "state": "running", "pid": 7,
        ...     "host": "n1", "total": 2000, "done": 700, "rows_per_second": 5.0,
        ...     "eta_seconds": 260.0}], "fleet": {"workers": 2, "servers_out": [{"url":
        ...     "http://n4:8000/v1", "by": "n1:7:ab", "reason": "connect timeout",
        ...     "seconds_ago": 12.0}]}}, out)
        >>> print(out.getvalue())
        runs/c: a corpus job of 30 files (1 skipped) in 32 units: 12 finished
          rows in finished units: 1200: 1190 answered, 10 failed
          failed by type: read_timeout 10
          shard-0000-of-0002: running (pid 7 on n1), 700 of 2000 rows, 5.0 rows/s, ETA 4m20s
          workers sharing the servers now: 2
          server out: http://n4:8000/v1, evicted by worker n1:7:ab 12s ago (connect timeout)
          model: small
        <BLANKLINE>
    """
    from llm_annotator.jobs.watch.progress import duration

    skipped = f" ({status['skipped_files']} skipped)" if status["skipped_files"] else ""
    done = "all finished" if status["complete"] else f"{status['units_done']} finished"
    print(
        f"{status['output_dir']}: a corpus job of {status['files']} files{skipped} in "
        f"{status['units']} units: {done}",
        file=out,
    )
    print(
        f"  rows in finished units: {status['rows']}: {status['succeeded']} answered, "
        f"{status['failed']} failed",
        file=out,
    )
    if status["by_error_type"]:
        kinds = ", ".join(f"{kind} {n}" for kind, n in status["by_error_type"].items())
        print(f"  failed by type: {kinds}", file=out)
    for process in status["processes"]:
        who = f" (pid {process['pid']} on {process['host']})" if process["pid"] else ""
        line = f"  {process['where']}: {process['state']}{who}"
        if process["total"] is not None and process["done"] is not None:
            line += f", {process['done']} of {process['total']} rows"
        if process["rows_per_second"] is not None:
            line += f", {process['rows_per_second']:,.1f} rows/s"
        if process["eta_seconds"] is not None:
            line += f", ETA {duration(process['eta_seconds'])}"
        print(line, file=out)
    fleet = status.get("fleet") or {}
    if fleet.get("workers"):
        print(f"  workers sharing the servers now: {fleet['workers']}", file=out)
    for server in fleet.get("servers_out") or ():
        print(
            f"  server out: {server['url']}, evicted by worker {server['by']} "
            f"{duration(server['seconds_ago'])} ago ({server['reason']})",
            file=out,
        )
    if status["model"]:
        print(f"  model: {status['model']}", file=out)


def _sharded_status(run_dir: Path, as_json: bool) -> None:
    """Each shard's status, and whether the shards were merged (for people, the first
    :data:`~llm_annotator.jobs.shards.merge.LISTED_SHARDS` shards not started, and how many
    more)."""
    import orjson

    from llm_annotator.jobs.rundir.consolidate import PARQUET_FILE
    from llm_annotator.jobs.shards.merge import LISTED_SHARDS, is_merged, shard_states
    from llm_annotator.jobs.watch.status import run_status

    count, states = shard_states(run_dir)
    merged = is_merged(run_dir)
    shards = [run_status(s.directory) if s.state != "missing" else None for s in states]
    if as_json:
        body = {
            "output_dir": str(run_dir),
            "shards": count,
            "merged": merged,
            "shard": [
                status.to_json() if status is not None else {"state": "missing"}
                for status in shards
            ],
        }
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    done = sum(1 for s in states if s.complete)
    print(
        f"{run_dir}: a job in {count} shards, {done} complete; "
        + ("merged into " + str(run_dir / PARQUET_FILE) if merged else "not merged yet"),
    )
    missing = 0
    for state, status in zip(states, shards, strict=True):
        if status is not None:
            show_status(status, sys.stdout)
            continue
        missing += 1
        if missing <= LISTED_SHARDS:
            print(f"shard {state.index}: not started (--shard {state.index}/{count})")
    if missing > LISTED_SHARDS:
        print(f"  and {missing - LISTED_SHARDS} more shards not started")


def _status(args: argparse.Namespace) -> int:
    import logging

    import orjson
    import structlog

    from llm_annotator.jobs.run_directory import RunDirectory
    from llm_annotator.jobs.watch.status import corpus_status, run_status

    # Reading a shard that a job is writing may meet a half-written last line: no warning.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    directory = RunDirectory.open(args.run_dir)
    corpus = corpus_status(args.run_dir) if directory.kind == "corpus" else None
    if corpus is not None:
        if args.json:
            sys.stdout.write(orjson.dumps(corpus, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            show_corpus_status(corpus, sys.stdout)
        return 0
    if directory.kind == "shards":
        _sharded_status(directory.path, args.json)
        return 0
    status = run_status(args.run_dir)
    if args.json:
        sys.stdout.write(orjson.dumps(status.to_json(), option=orjson.OPT_INDENT_2).decode())
        sys.stdout.write("\n")
    else:
        show_status(status, sys.stdout)
    return 0


def add_status(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator status`` on its parser."""
    parser.description = (
        "Read a run directory (while its job runs, or after) and print the rows done "
        "of the total, the error rows by type, the rows by server, the job's last rate "
        "and ETA, and whether it is running, finished, interrupted, failed or stopped."
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the job's --output-dir")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_status)
