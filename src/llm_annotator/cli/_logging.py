"""Where the command's log records go, and how they look.

The library only emits structlog events; the command decides here where they go.
Standard error speaks one language at a time:

- A command that prints lines for people (``run``, ``pipeline run``, ``demo``) declares
  them with :class:`HumanLines`. Its standard error then carries those lines and, each
  as one line in words, the warnings and errors they do not already say, on a terminal
  or in a pipe alike. The records themselves go to ``--log-file`` (JSON, or console
  with ``--log-format console``), or to standard error, every one in the format asked,
  when ``--log-format`` is given without ``--log-file``; then the command draws no
  progress bar there.
- Any other command (``serve-local``, say) logs its records to standard error: readable
  on a terminal, one JSON object a line otherwise, or as ``--log-format`` says.

:func:`log_plan` is that rule; :func:`configure_logging` carries it out.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import IO, Any, Literal

from llm_annotator.errors import ConfigurationError

Format = Literal["human", "console", "json"]
"""How records look: ``human`` (a line in words, only those a person must see),
``console`` (structlog's readable lines) or ``json`` (one JSON object a line)."""

_ABOVE_INFO = frozenset({"warning", "error", "critical"})


@dataclass(frozen=True, slots=True)
class HumanLines:
    """What a command shows people, so that its log records do not say it again.

    Attributes:
        shown: Events below warning that people see all the same, in words (the
            progress where no bar is drawn, say).
        said: Warnings and errors that the command's own lines already say (a
            server's eviction, a run stopped by a signal): no second line for them.

    Examples:
        >>> lines = HumanLines(shown=frozenset({"progress"}), said=frozenset({"member_down"}))
        >>> [lines.takes({"event": e, "level": level}) for e, level in [
        ...     ("progress", "info"), ("job_started", "info"),
        ...     ("member_evicted", "warning"), ("member_down", "warning")]]
        [True, False, True, False]
    """

    shown: frozenset[str] = frozenset()
    said: frozenset[str] = frozenset()

    def takes(self, event: Mapping[str, Any]) -> bool:
        """Whether the record ``event`` is shown on standard error, in words."""
        name = event.get("event")
        if name in self.said:
            return False
        return name in self.shown or event.get("level") in _ABOVE_INFO


@dataclass(frozen=True, slots=True)
class LogPlan:
    """Where the records go and how they look: what :func:`log_plan` decides.

    Attributes:
        stderr: How records look on standard error: ``"human"`` (the command's own
            lines are there; of the records only those its :class:`HumanLines`
            takes, in words), or ``"console"`` or ``"json"`` (every record).
        file: A file every record is appended to, or None.
        file_format: The file's format: ``"json"`` or ``"console"``.
    """

    stderr: Format
    file: str | None = None
    file_format: Format = "json"

    @property
    def records_on_stderr(self) -> bool:
        """Every record goes to standard error: no progress bar may be drawn there."""
        return self.stderr != "human"


def log_plan(
    *, tty: bool, human: bool, log_format: str | None = None, log_file: str | None = None
) -> LogPlan:
    """Where a command's log records go, and in what format.

    Args:
        tty: Standard error is a terminal.
        human: The command prints lines for people (it declares :class:`HumanLines`).
        log_format: ``"json"`` or ``"console"`` when asked (``--log-format``); None
            when not.
        log_file: The file asked for the records (``--log-file``), or None.

    Returns:
        With a file: every record to it (JSON unless ``log_format`` is console), and
        standard error in words. Else with a format: every record to standard error
        in that format. Else a command with lines for people keeps standard error in
        words, terminal or not; any other logs every record there, readable on a
        terminal and JSON otherwise.

    Examples:
        >>> log_plan(tty=False, human=True)
        LogPlan(stderr='human', file=None, file_format='json')
        >>> log_plan(tty=True, human=True, log_format="json")
        LogPlan(stderr='json', file=None, file_format='json')
        >>> log_plan(tty=False, human=True, log_format="console", log_file="run.log")
        LogPlan(stderr='human', file='run.log', file_format='console')
    """
    if log_file:
        return LogPlan("human", log_file, "console" if log_format == "console" else "json")
    if log_format == "json":
        return LogPlan("json")
    if log_format == "console":
        return LogPlan("console")
    if human:
        return LogPlan("human")
    return LogPlan("console" if tty else "json")


def human_line(prog: str, event: Mapping[str, Any]) -> str:
    """One record as one line in words: the command, the level above info, the
    event, and its fields.

    Examples:
        >>> human_line("llm-annotator run", {
        ...     "server": "http://b/v1", "reason": "no answer",
        ...     "event": "member_evicted", "level": "warning", "timestamp": "..."})
        "llm-annotator run: warning: member_evicted (server=http://b/v1, reason='no answer')"
        >>> human_line("llm-annotator run", {"done": 5, "event": "progress", "level": "info"})
        'llm-annotator run: progress (done=5)'
    """
    level = event.get("level")
    head = [prog, str(level)] if level in _ABOVE_INFO else [prog]
    fields = ", ".join(
        f"{key}={_shown(value)}"
        for key, value in event.items()
        if key not in ("event", "level", "timestamp")
    )
    line = ": ".join([*head, str(event.get("event"))])
    return f"{line} ({fields})" if fields else line


def _shown(value: Any) -> str:
    """A field's value: a word as it is, anything else as Python writes it."""
    if isinstance(value, str) and value and not any(c.isspace() or c in "'\"" for c in value):
        return value
    return repr(value)


class _Outlets:
    """The command's structlog logger: writes each record where the plan says, in the
    plan's formats, one whole line at a time (records come from several threads)."""

    def __init__(self, plan: LogPlan, lines: HumanLines, prog: str, file: IO[str] | None) -> None:
        import structlog

        self.plan = plan
        self.lines = lines
        self.prog = prog
        self.file = file
        self._json = structlog.processors.JSONRenderer()
        self._console = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        self._plain = structlog.dev.ConsoleRenderer(colors=False)
        self._lock = threading.Lock()

    def msg(self, event: MutableMapping[str, Any]) -> None:
        """Write one record (the processors' event dict)."""
        with self._lock:
            stderr = sys.stderr  # looked up each time: a test may have replaced it
            if self.file is not None:
                plain = self.plan.file_format == "console"
                try:
                    self.file.write(self._render(self._plain if plain else self._json, event))
                    self.file.flush()
                except OSError as error:  # a full disk: the job goes on, said once
                    file, self.file = self.file, None
                    with contextlib.suppress(OSError):
                        file.close()  # what it still buffers cannot be written either
                    stderr.write(
                        f"{self.prog}: the log file cannot be written ({error.strerror or error}); "
                        "log records are dropped from here on\n"
                    )
            if self.plan.records_on_stderr:
                console = self.plan.stderr == "console"
                stderr.write(self._render(self._console if console else self._json, event))
            elif self.lines.takes(event):
                # On a terminal, first clear the line a progress bar may be drawn on.
                clear = "\r\x1b[K" if stderr.isatty() else ""
                stderr.write(clear + human_line(self.prog, event) + "\n")
            else:
                return
            stderr.flush()

    debug = info = warning = warn = error = err = critical = fatal = exception = msg
    failure = log = msg

    @staticmethod
    def _render(renderer: Any, event: MutableMapping[str, Any]) -> str:
        """One record as a line by a structlog renderer (given a copy: some pop keys)."""
        return str(renderer(None, "", dict(event))) + "\n"


def _to_outlets(_: Any, __: str, event: MutableMapping[str, Any]) -> Any:
    """The last processor: the event dict itself, for :class:`_Outlets` to render."""
    return ((event,), {})


def configure_logging(
    log_format: str | None = None,
    *,
    log_file: str | None = None,
    lines: HumanLines | None = None,
    prog: str = "llm-annotator",
) -> LogPlan:
    """Send log events where :func:`log_plan` says.

    Args:
        log_format: ``"console"`` (readable) or ``"json"`` (one JSON object a line)
            when asked; None by the rule.
        log_file: A file to append every record to, or None.
        lines: What the command shows people; None for a command that shows none.
        prog: How a line in words begins (``llm-annotator run``).

    Returns:
        The plan. A structlog configuration made earlier (by a test, or a program that
        calls :func:`main`) is left alone.

    Raises:
        ConfigurationError: The log file cannot be opened for appending.
    """
    import structlog  # here, not at the top: --help needs no logging (0.2 s of imports)

    plan = log_plan(
        tty=sys.stderr.isatty(), human=lines is not None, log_format=log_format, log_file=log_file
    )
    if structlog.is_configured():
        return plan
    file: IO[str] | None = None
    if plan.file is not None:
        try:
            file = open(plan.file, "a", encoding="utf-8")  # noqa: SIM115 (open while the process lives)
        except OSError as error:
            raise ConfigurationError(
                f"--log-file {plan.file}: cannot append to it ({error.strerror or error})"
            ) from None
    outlets = _Outlets(plan, lines or HumanLines(), prog, file)
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _to_outlets,
        ],
        logger_factory=lambda *_: outlets,
        # Not cached: a logger made before this call (or in a test) must follow it.
        cache_logger_on_first_use=False,
    )
    return plan
