"""``llm-annotator run --processes N``: a corpus job on one machine, in N worker
processes that take its units by claims (``--shard claim``), as workers on several
hosts would.

One process drives about one core's worth of requests; with many servers, several
processes keep them busy. Each worker runs the same command with ``--processes 1
--shard claim``; as the workers of any elastic job, they count each other in the run
directory and each holds its share of every server's in-flight budget
(:mod:`~llm_annotator.jobs.rundir.fleet`), so the servers see the load of one process.
Each is given a slot of its own when this command runs in one (a SLURM array task:
:func:`~llm_annotator.jobs.rundir.fleet.worker_slot`). SIGINT and SIGTERM are passed on
to every worker; the command ends when they all have, with the first failing status.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from llm_annotator.jobs.rundir.fleet import SLOT_VARIABLE, worker_slot

SERVERS_PER_PROCESS = 8
"""Servers one process keeps busy by default (``--processes auto``)."""


def default_processes(servers: int) -> int:
    """The processes ``--processes auto`` starts for a corpus job over ``servers``
    servers: one per :data:`SERVERS_PER_PROCESS` servers, at most one per core.

    Examples:
        >>> default_processes(2), default_processes(9) <= 2, default_processes(0)
        (1, True, 1)
    """
    cores = len(os.sched_getaffinity(0))  # the cores this process may use (cgroups too)
    return max(1, min(cores, math.ceil(servers / SERVERS_PER_PROCESS)))


def worker_argv(argv: Sequence[str], *, metrics: bool = False) -> list[str]:
    """One worker's command line: the user's, then the flags that make it a worker
    (a later flag wins); with ``metrics``, each serves its metrics on a free port of its
    own (logged as ``metrics_serving``).

    Examples:
        >>> worker_argv(["run", "--input", "c/"], metrics=True)[-6:]
        ['--processes', '1', '--shard', 'claim', '--metrics-port', '0']
    """
    metrics_port = ["--metrics-port", "0"] if metrics else []
    return worker_command(argv, *metrics_port)


def worker_command(argv: Sequence[str], *flags: str) -> list[str]:
    """A worker's command line: the user's command run again by this Python, as one
    process that claims (later flags win), then ``flags``.

    Examples:
        >>> worker_command(["pipeline", "run", "p.toml"], "--claim-lease", "30")[3:]
        ['pipeline', 'run', 'p.toml', '--processes', '1', '--shard', 'claim', '--claim-lease', '30']
    """
    claiming = ["--processes", "1", "--shard", "claim"]
    return [sys.executable, "-m", "llm_annotator.cli", *argv, *claiming, *flags]


def run_workers(argv: Sequence[str], processes: int, settings: dict[str, Any]) -> int:
    """Start the workers of a corpus job, pass signals on to them, wait for them all.

    Returns:
        0 when every worker finished, else the first failing worker's status.
    """
    command = worker_argv(argv, metrics=settings["metrics_port"] is not None)
    return supervise(command, processes, "run", "the corpus")


def worker_env(index: int, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Worker ``index``'s environment: this one, with a slot of its own when this
    process runs in one (the workers would otherwise all read the same SLURM task).

    Examples:
        >>> worker_env(1, {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2"})[SLOT_VARIABLE]
        'slurm-7_2.p1'
        >>> SLOT_VARIABLE in worker_env(1, {"HOME": "/h"})
        False
    """
    env = dict(environ)
    slot = worker_slot(environ)
    if slot is not None:
        env[SLOT_VARIABLE] = f"{slot}.p{index}"
    return env


def supervise(command: Sequence[str], processes: int, name: str, what: str) -> int:
    """Start ``processes`` copies of ``command`` (workers of the command ``name`` over
    ``what``), pass SIGINT and SIGTERM on to every one, wait for them all.

    Returns:
        0 when every worker finished, else the first failing worker's status.
    """
    print(
        f"starting {processes} worker processes over {what} (--shard claim each)",
        file=sys.stderr,
        flush=True,
    )
    # Each in a session of its own: a terminal's Ctrl-C reaches them once, from here,
    # not also from the terminal (two signals would be a hard stop).
    workers = [
        subprocess.Popen(
            command, stdin=subprocess.DEVNULL, start_new_session=True, env=worker_env(index)
        )
        for index in range(processes)
    ]

    def forward(signum: int, frame: FrameType | None) -> None:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [worker.wait() for worker in workers]
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    failed = [code for code in codes if code != 0]
    if failed:
        print(
            f"llm-annotator {name}: {len(failed)} of {processes} workers did not finish "
            f"(status {', '.join(map(str, failed))}); run the same command again to resume",
            file=sys.stderr,
            flush=True,
        )
        return failed[0] if failed[0] > 0 else 128 - failed[0]
    return 0
