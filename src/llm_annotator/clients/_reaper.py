"""End the in-process engine's own processes when this process dies without closing it.

vLLM runs its engine core (and, below it, its workers) as child processes. When the
process that built the engine is killed with SIGKILL, or by the kernel's OOM killer,
they are left behind, idle and holding their memory (a GPU's, on a GPU machine), and a
resumed job on the same machine may then find no memory for its own engine. A reaper
process, started once the engine is up, holds the read end of a pipe whose write end
only this process holds: when the pipe closes without a word, this process is gone, and
the reaper kills the processes the engine started. A normal close tells it to go.

Linux only (it reads ``/proc``); elsewhere :func:`start_reaper` does nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

_REAPER = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
fd = int(sys.argv[1])
data = b""
while True:
    chunk = os.read(fd, 4096)
    if not chunk:
        break
    data += chunk
if b"done" in data.split():
    sys.exit(0)

def started(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None

for word in data.split():
    pid, _, start = word.decode().partition(":")
    # The same process, not another that took its number since.
    if pid.isdigit() and start and started(pid) == start:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
"""


def descendants(root: int | None = None) -> set[int]:
    """The process ids below ``root`` (this process by default), from ``/proc``; empty
    where there is no ``/proc``.

    Examples:
        >>> import os
        >>> os.getpid() in descendants()
        False
    """
    root = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces and parentheses: split after it.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat`` field
    22): with its number, it names the process even after the number is reused.

    Examples:
        >>> import os
        >>> start_time(os.getpid()).isdigit()
        True
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


class Reaper:
    """The reaper of a set of processes (see the module's text)."""

    def __init__(self, pids: set[int]) -> None:
        self._write: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        if not pids:
            return
        read, write = os.pipe()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _REAPER, str(read)],
                pass_fds=[read],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        except OSError as error:
            os.close(write)
            log.warning("offline_reaper_not_started", error=repr(error))
            return
        finally:
            os.close(read)
        watched = " ".join(f"{pid}:{start_time(pid)}" for pid in sorted(pids))
        os.write(write, watched.encode() + b" ")
        self._write = write
        log.debug("offline_reaper_started", watched=sorted(pids))

    def release(self) -> None:
        """The engine was closed: the reaper leaves the processes alone and exits."""
        if self._write is None:
            return
        write, self._write = self._write, None
        try:
            os.write(write, b" done ")
        finally:
            os.close(write)
        if self._process is not None:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()


def start_reaper(before: set[int]) -> Reaper:
    """A reaper of the processes started since ``before`` was taken (with
    :func:`descendants`)."""
    return Reaper(descendants() - before)


__all__ = ["Reaper", "descendants", "start_reaper", "start_time"]
