"""Fixtures for the tests of deploy/: a single-node SLURM cluster and its helpers.

``slurm_cluster`` starts a cluster once per run with ``scripts/slurm-cluster.sh`` in a
temporary folder (installing Debian's slurm and munge packages if needed, as root) and
stops it at the end. Where this platform cannot run one (not Linux; packages missing and
not root) the tests that use it are skipped, unless ``LLM_ANNOTATOR_REQUIRE_SLURM`` is
set: then they fail, as they do whenever the cluster does not start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SCRIPT = REPO / "scripts" / "slurm-cluster.sh"
REQUIRE_SLURM_ENV = "LLM_ANNOTATOR_REQUIRE_SLURM"
"""Set to fail, not skip, the SLURM tests when this platform cannot run a cluster."""

_SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol")
_FINISHED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
_POLL_INTERVAL = 0.5


_SCONTROL_TRIES = 5
"""Tries of one ``scontrol show job`` before its failure fails the test."""


def poll(condition: Callable[[], bool], timeout: float, interval: float = _POLL_INTERVAL) -> bool:
    """Check ``condition`` until it holds or ``timeout`` seconds have passed.

    Args:
        condition: Checked first at once, then after each pause.
        timeout: Seconds to wait at most.
        interval: Seconds between checks.

    Returns:
        Whether it held in time.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    details: Callable[[], str] = lambda: "",
    interval: float = _POLL_INTERVAL,
) -> None:
    """Like :func:`poll`, but fail the test when ``condition`` does not hold in time.

    Args:
        condition: Checked first at once, then after each pause.
        timeout: Seconds to wait at most.
        what: What is awaited, for the failure message.
        details: Called on failure for more of the message (logs).
        interval: Seconds between checks.
    """
    if not poll(condition, timeout, interval):
        pytest.fail(f"timed out after {timeout:g} s waiting for {what}\n{details()}")


def is_healthy(base_url: str) -> bool:
    """Whether the vLLM server at ``base_url`` (``http://host:port/v1``) answers /health."""
    root = base_url.removesuffix("/").removesuffix("/v1")
    try:
        return httpx.get(f"{root}/health", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


def read_urls(servers_dir: Path) -> dict[str, str]:
    """The announced servers: URL file name without ``.url`` -> base URL."""
    urls = {}
    for path in sorted(servers_dir.glob("*.url")):
        try:
            url = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:  # withdrawn while we looked
            continue
        urls[path.stem] = url
    return urls


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, or a note that it is missing."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"({path} missing)"
    return f"--- {path.name}:\n" + "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True, slots=True)
class SlurmCluster:
    """A running single-node cluster; every SLURM command must use :attr:`env`.

    Attributes:
        directory: The folder holding the cluster's configuration, state and logs.
        env: This process's environment plus ``SLURM_CONF`` naming the cluster.
    """

    directory: Path
    env: Mapping[str, str]

    def run(self, *args: str, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
        """Run a command against this cluster; fail the test if it fails.

        Args:
            args: The command line.
            env: Variables added to its environment.
            cwd: Its working folder (where jobs it submits write their output).

        Returns:
            Its standard output.
        """
        result = subprocess.run(
            list(args),
            env={**self.env, **(env or {})},
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode != 0:
            pytest.fail(f"{' '.join(args)} exited with {result.returncode}: {result.stderr}")
        return result.stdout

    def task_states(self, job_id: str) -> dict[str, str]:
        """The state of each task of a job (``RUNNING``, ``COMPLETED``, ...).

        Finished jobs are known for ten minutes (MinJobAge), then no more.

        Args:
            job_id: A job, array, or array task (``12_1``).

        Returns:
            Task (``12_1``, or ``12`` for a plain job) -> state; empty if unknown.
        """
        for attempt in range(_SCONTROL_TRIES):
            result = subprocess.run(
                ["scontrol", "--oneliner", "show", "job", job_id],
                env=dict(self.env),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            # A busy controller may time out ("Socket timed out"): that says nothing
            # about the job, so ask again rather than take it for a finished one.
            if result.returncode == 0 or "Invalid job id" in result.stderr:
                break
            if attempt == _SCONTROL_TRIES - 1:
                raise RuntimeError(f"scontrol show job {job_id} failed: {result.stderr.strip()}")
            time.sleep(1.0)
        states = {}
        for line in result.stdout.splitlines():
            fields = dict(field.split("=", 1) for field in line.split() if "=" in field)
            if "JobState" in fields:
                task = fields.get("ArrayTaskId")
                name = f"{fields.get('ArrayJobId')}_{task}" if task else fields.get("JobId", "")
                states[name] = fields["JobState"]
        return states

    def is_finished(self, job_id: str) -> bool:
        """Whether every task of a job has ended, however it ended."""
        return all(state in _FINISHED_STATES for state in self.task_states(job_id).values())

    def has_finished_task(self, job_id: str) -> bool:
        """Whether some task of a job has ended, however it ended."""
        return any(state in _FINISHED_STATES for state in self.task_states(job_id).values())

    def cancel(self, *job_ids: str) -> None:
        """Cancel jobs or array tasks (an unknown or finished job is no error)."""
        subprocess.run(
            ["scancel", *job_ids],
            env=dict(self.env),
            capture_output=True,
            timeout=30,
            check=False,
        )


def _cannot_run_slurm() -> str | None:
    """Why this platform cannot run the cluster, or ``None`` if it can."""
    if not sys.platform.startswith("linux"):
        return f"a SLURM cluster needs Linux, not {sys.platform}"
    missing = [name for name in _SLURM_PROGRAMS if shutil.which(name) is None]
    if missing and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        return f"{', '.join(missing)} missing, and only root with apt-get installs them"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A single-node SLURM cluster (2 CPUs shared by up to 4 jobs), for the whole run."""
    reason = _cannot_run_slurm()
    if reason is not None:
        if os.environ.get(REQUIRE_SLURM_ENV):
            pytest.fail(f"{REQUIRE_SLURM_ENV} is set but {reason}")
        pytest.skip(reason)
    directory = tmp_path_factory.mktemp("slurm")
    command = ["bash", str(CLUSTER_SCRIPT)]
    started = subprocess.run(
        [*command, "start", str(directory)],
        capture_output=True,
        text=True,
        timeout=600,  # the first start installs the packages
        check=False,
    )
    try:
        if started.returncode != 0:
            logs = "\n".join(tail(log) for log in sorted((directory / "log").glob("*.log")))
            pytest.fail(f"slurm-cluster.sh start failed:\n{started.stderr}\n{logs}")
        # A run inside a SLURM job must not hand that job's variables to ours.
        env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
        env["SLURM_CONF"] = str(directory / "slurm.conf")
        yield SlurmCluster(directory=directory, env=env)
    finally:
        subprocess.run(
            [*command, "stop", str(directory)], capture_output=True, timeout=120, check=False
        )
