"""One vLLM server process on this machine: its handle, signals and health.

The process leads its own process group, because vLLM runs its engine in child
processes: killing, pausing or stopping the server signals the whole group. A server
may announce itself in a ``*.url`` file while it is healthy (see :meth:`LocalServer.announce`).
:mod:`llm_annotator.local` starts servers and re-exports everything public here.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog
import tenacity

from llm_annotator.errors import LocalServerError

log = structlog.get_logger(__name__)

HEALTH_POLL_INTERVAL = 0.25
"""Seconds between two /health probes while waiting for a server."""
HEALTH_PROBE_TIMEOUT = 2.0
"""Seconds one /health probe may take (connect and answer)."""
LOG_TAIL_LINES = 40
"""Log lines quoted in a start-up error."""


def pick_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ask the OS for ``count`` distinct free TCP ports on ``host``.

    The ports are released before this returns, so another process could take one in
    between; vLLM then fails to bind and
    :func:`llm_annotator.local.start_local_servers` reports it.

    Args:
        count: How many ports.
        host: The address to bind.

    Returns:
        The port numbers, all different.

    Examples:
        >>> first, second = pick_free_ports(2)
        >>> first != second and first > 0
        True
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to a process group; return False if the group is gone."""
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _group_members(pgid: int) -> list[tuple[int, str]] | None:
    """The live (not zombie) processes of a group with their command lines.

    Returns ``None`` where /proc is not available.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    members = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if len(fields) < 3 or fields[2] != str(pgid) or fields[0] in ("Z", "X"):
                continue
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        members.append((int(stat.parent.name), cmdline.decode(errors="replace")))
    return members


def _group_alive(pgid: int) -> bool:
    """Whether a process group has a member that is not a zombie.

    Orphaned members are reaped by init, which may take a moment; /proc tells the dead
    from the living where it exists.
    """
    if not signal_group(pgid, 0):
        return False
    members = _group_members(pgid)
    return members is None or bool(members)


def _kill_sparing_tracker(pgid: int) -> None:
    """SIGKILL a group, except Python's multiprocessing resource tracker.

    vLLM registers its shared-memory queues with that tracker, which removes them from
    /dev/shm once every other process is gone and then exits by itself. Killing it too
    would leave the segments behind, as a real crash of the server would not.
    """
    for _ in range(3):  # a member may have been forked while we looked
        members = _group_members(pgid)
        if members is None:
            signal_group(pgid, signal.SIGKILL)
            return
        targets = [pid for pid, cmd in members if "multiprocessing.resource_tracker" not in cmd]
        if not targets:
            break
        for pid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    signal_group(pgid, signal.SIGCONT)  # a paused tracker could not clean up


def _wait_group_gone(pgid: int, timeout: float) -> bool:
    """Wait until no live process of the group is left; return whether that happened."""
    deadline = time.monotonic() + timeout
    while _group_alive(pgid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole: a hidden temporary file renamed into place."""
    fd, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise


def _remove(path: Path | None) -> bool:
    """Remove ``path`` if it exists; return whether it did."""
    if path is None:
        return False
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def _withdraw_and_terminate(
    process: subprocess.Popen[bytes], grace: float, url_file: Path | None
) -> None:
    """What a handle does when garbage collected or at exit: withdraw, then stop."""
    with contextlib.suppress(OSError):
        _remove(url_file)
    _terminate(process, grace)


def _terminate(process: subprocess.Popen[bytes], grace: float) -> int:
    """Stop a server's whole process group: SIGTERM, then SIGKILL after ``grace``."""
    pgid = process.pid
    if process.poll() is None:
        signal_group(pgid, signal.SIGTERM)
        signal_group(pgid, signal.SIGCONT)  # a paused server cannot handle SIGTERM
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            signal_group(pgid, signal.SIGKILL)
    returncode = process.wait()
    # The engine processes are children of the server, not of us: give them a moment
    # to finish their own shutdown, then make sure.
    if not _wait_group_gone(pgid, min(grace, 5.0)):
        signal_group(pgid, signal.SIGKILL)
    return returncode


class LocalServer:
    """A handle to one vLLM server process started on this machine.

    The process leads its own process group (vLLM runs its engine in child processes),
    and :meth:`kill`, :meth:`pause` and :meth:`stop` signal the whole group.

    Args:
        process: The started server process, leader of its own process group.
        host: The address it listens on.
        port: The port it listens on.
        model: The served model name, as requests must give it.
        log_path: The file its output goes to.
        url_file: Where :meth:`announce` writes the base URL once the server is
            healthy; it is removed when the server is stopped or killed through this
            handle. ``None``: the server is not announced.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        *,
        host: str,
        port: int,
        model: str,
        log_path: Path,
        url_file: Path | None = None,
    ) -> None:
        self._process = process
        self.host = host
        self.port = port
        self.model = model
        self.log_path = log_path
        self.url_file = url_file
        self._paused = False
        self._finalizer = weakref.finalize(self, _withdraw_and_terminate, process, 5.0, url_file)

    @classmethod
    def launch(
        cls,
        command: Sequence[str],
        *,
        host: str,
        port: int,
        model: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        url_file: Path | None = None,
    ) -> LocalServer:
        """Start ``command`` in a new process group, its output going to ``log_path``.

        Does not wait for the server to be ready: see :meth:`wait_healthy`.

        Args:
            command: The server command line.
            host: The address the command makes the server listen on.
            port: The port the command makes the server listen on.
            model: The served model name.
            log_path: File for the server's stdout and stderr (overwritten).
            env: The server's whole environment; defaults to this process's.
            url_file: Where to announce the server once healthy (see the class).

        Returns:
            The handle of the started server.
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("wb") as log_file:
            process = subprocess.Popen(
                list(command),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                start_new_session=True,
            )
        server = cls(
            process, host=host, port=port, model=model, log_path=log_path, url_file=url_file
        )
        log.info("local_server_launched", server=server.base_url, pid=process.pid)
        return server

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible base URL, e.g. ``http://127.0.0.1:8000/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def pid(self) -> int:
        """The server process's id, which is also its process group id."""
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status, or ``None`` while the process runs."""
        return self._process.poll()

    def is_running(self) -> bool:
        """Whether the server process has not exited (a paused server is running)."""
        return self._process.poll() is None

    def is_healthy(self, timeout: float = HEALTH_PROBE_TIMEOUT) -> bool:
        """Probe ``/health`` once.

        Args:
            timeout: Seconds to wait for the connection and for the answer.

        Returns:
            Whether the server answered 200.
        """
        connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            connection.close()

    def wait_healthy(self, timeout: float = 300.0) -> float:
        """Wait until ``/health`` answers 200, then :meth:`announce` the server.

        Args:
            timeout: Seconds to wait at most.

        Returns:
            Seconds waited.

        Raises:
            LocalServerError: The process exited, or the timeout passed; the message
                holds the last lines of the log.
        """
        return wait_all_healthy([self], timeout)

    def announce(self) -> None:
        """Write the base URL into :attr:`url_file`, whole (a temporary file renamed).

        Does nothing without a ``url_file``. ``llm-annotator run --servers-dir`` on the
        file's folder then sends work to this server.
        """
        if self.url_file is None:
            return
        _write_atomically(self.url_file, self.base_url + "\n")
        log.info("local_server_announced", server=self.base_url, url_file=str(self.url_file))

    def withdraw(self) -> None:
        """Remove :attr:`url_file`, if it is there, so that annotators stop using the server."""
        if _remove(self.url_file):
            log.info("local_server_withdrawn", server=self.base_url, url_file=str(self.url_file))

    def pause(self) -> None:
        """Freeze the server and its engine (SIGSTOP): connections hang, none is refused."""
        signal_group(self.pid, signal.SIGSTOP)
        self._paused = True
        log.info("local_server_paused", server=self.base_url, pid=self.pid)

    def resume(self) -> None:
        """Let a paused server run again (SIGCONT)."""
        signal_group(self.pid, signal.SIGCONT)
        self._paused = False
        log.info("local_server_resumed", server=self.base_url, pid=self.pid)

    def kill(self) -> None:
        """Kill the server and its engine at once (SIGKILL), as a crash would.

        Python's resource tracker is spared so that it removes the server's shared
        memory and exits. The URL file is removed first. Returns once the server process
        has exited; its port then refuses connections.
        """
        self.withdraw()
        _kill_sparing_tracker(self.pid)
        returncode = self._process.wait()
        self._paused = False
        log.info("local_server_killed", server=self.base_url, returncode=returncode)

    def stop(self, grace: float = 10.0) -> int:
        """Shut the server down: SIGTERM, then SIGKILL if it is still there after ``grace``.

        The URL file is removed first. Safe to call on a server that already exited.

        Args:
            grace: Seconds to let it shut down cleanly.

        Returns:
            The process's exit status.
        """
        first_stop = self._finalizer.detach() is not None
        self.withdraw()
        returncode = _terminate(self._process, grace)
        self._paused = False
        if first_stop:
            log.info("local_server_stopped", server=self.base_url, returncode=returncode)
        return returncode

    def tail_log(self, n: int = LOG_TAIL_LINES) -> str:
        """Return the last ``n`` lines of the server's log.

        Args:
            n: How many lines.

        Returns:
            The lines, joined by newlines; empty if there is no log.
        """
        if n <= 0:
            return ""
        try:
            with self.log_path.open("rb") as log_file:
                position = log_file.seek(0, os.SEEK_END)
                data = b""
                # Read backwards until the chunk holds n whole lines (vLLM writes some
                # lines of several kB) or the file is exhausted.
                while position > 0 and data.count(b"\n") <= n:
                    step = min(position, 65536)
                    position -= step
                    log_file.seek(position)
                    data = log_file.read(step) + data
        except OSError:
            return ""
        return "\n".join(data.decode("utf-8", errors="replace").splitlines()[-n:])

    def failure(self, reason: str) -> LocalServerError:
        """Build the error for this server failing, quoting the end of its log.

        Args:
            reason: What went wrong, e.g. ``"exited with status 1 during start-up"``.

        Returns:
            The error, to raise.
        """
        tail = self.tail_log(LOG_TAIL_LINES)
        return LocalServerError(
            f"vLLM server {self.base_url} (pid {self.pid}) {reason}; "
            f"last lines of {self.log_path}:\n{tail}",
            base_url=self.base_url,
            log_path=self.log_path,
            returncode=self.returncode,
        )

    def __repr__(self) -> str:
        if not self.is_running():
            state = f"exited({self.returncode})"
        else:
            state = "paused" if self._paused else "running"
        return f"<LocalServer {self.model!r} {self.base_url} pid={self.pid} {state}>"


def wait_all_healthy(servers: Sequence[LocalServer], timeout: float) -> float:
    """Wait until every server answers ``/health`` with 200, announcing each as it
    does; return the seconds waited.

    Raises:
        LocalServerError: A server exited, or ``timeout`` passed with some not healthy
            (the message holds the last lines of the first one's log).
    """
    start = time.monotonic()
    deadline = start + timeout
    pending = list(servers)

    def probe_round() -> bool:
        for server in list(pending):
            if not server.is_running():
                raise server.failure(f"exited with status {server.returncode} during start-up")
            remaining = deadline - time.monotonic()
            if server.is_healthy(max(min(HEALTH_PROBE_TIMEOUT, remaining), 0.01)):
                pending.remove(server)
                log.info(
                    "local_server_healthy",
                    server=server.base_url,
                    waited_s=round(time.monotonic() - start, 2),
                )
                server.announce()
        return not pending

    def too_late(state: tenacity.RetryCallState) -> bool:
        others = f" (with {len(pending) - 1} other servers)" if len(pending) > 1 else ""
        raise pending[0].failure(f"did not become healthy within {timeout:g} s{others}")

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout),
        wait=tenacity.wait_fixed(HEALTH_POLL_INTERVAL),
        retry=tenacity.retry_if_result(lambda done: not done),
        retry_error_callback=too_late,
    )
    retrying(probe_round)
    return time.monotonic() - start
