"""How far a job is: a progress bar on a terminal, log lines elsewhere."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

import structlog

log = structlog.get_logger(__name__)

_BAR_WIDTH = 24


class Progress:
    """Counts rows and tokens, and shows them now and then.

    On a terminal it redraws one line (rows done/total, rows/s, output tokens/s,
    healthy servers, ETA) at most every ``bar_interval`` seconds; elsewhere it logs a
    ``progress`` event every ``log_interval`` seconds. Rates count this process's work
    only, so a resumed job does not report the rows it skipped as speed.

    Args:
        total: Rows in the input.
        done_before: Rows already done when the job started (resumed).
        healthy: Returns the number of servers taking work now.
        stream: Where the bar goes; None for standard error.
        bar: True for a bar, False for log lines, None to decide by the stream.
        clock: The clock (tests give their own).

    Examples:
        >>> import io
        >>> progress = Progress(100, 0, healthy=lambda: 2, stream=io.StringIO(), bar=True)
        >>> progress.add(rows=10, output_tokens=80)
        >>> progress.line().split(" | ")[0]
        '10/100 rows (10.0%)'
    """

    def __init__(
        self,
        total: int,
        done_before: int,
        *,
        healthy: Callable[[], int],
        stream: TextIO | None = None,
        bar: bool | None = None,
        bar_interval: float = 0.5,
        log_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.done = done_before
        self.rows = 0
        self.failed = 0
        self.output_tokens = 0
        self.by_server: Counter[str] = Counter()
        """This run's rows by the server that answered them (error rows included)."""
        self.by_error_type: Counter[str] = Counter()
        """This run's error rows by type."""
        self.healthy = healthy
        self.stream = stream if stream is not None else sys.stderr
        self.bar = self.stream.isatty() if bar is None else bar
        self.interval = bar_interval if self.bar else log_interval
        self.clock = clock
        self.started = clock()
        self._shown = self.started
        self._drawn = False

    def add(
        self,
        *,
        rows: int = 1,
        failed: int = 0,
        output_tokens: int = 0,
        server: str | None = None,
        error_type: str | None = None,
    ) -> None:
        """Count finished rows (with the server that answered them, and the type of
        the failed ones) and the output tokens of answers (every answer, a regenerated
        one too); show the progress if it is time."""
        self.done += rows
        self.rows += rows
        self.output_tokens += output_tokens
        if server is not None:
            self.by_server[server] += rows
        if failed:
            self.failed += failed
            self.by_error_type[error_type or "error"] += failed
        now = self.clock()
        if now - self._shown >= self.interval:
            self._shown = now
            self.show()

    def add_tokens(self, output_tokens: int) -> None:
        """Count the output tokens of one answer (a regenerated one too); no display."""
        self.output_tokens += output_tokens

    def rates(self) -> tuple[float, float]:
        """Rows per second and output tokens per second, in this process."""
        elapsed = max(self.clock() - self.started, 1e-9)
        return self.rows / elapsed, self.output_tokens / elapsed

    def figures(self) -> dict[str, Any]:
        """The figures of the progress, JSON-able (``status.json`` holds them)."""
        rows_per_s, tokens_per_s = self.rates()
        left = self.total - self.done
        return {
            "done": self.done,
            "failed_this_run": self.failed,
            "rows_per_second": round(rows_per_s, 2),
            "output_tokens_per_second": round(tokens_per_s, 1),
            "eta_seconds": round(left / rows_per_s, 1) if rows_per_s > 0 and left > 0 else None,
            "healthy_servers": self.healthy(),
        }

    def line(self) -> str:
        """The progress as one line of text."""
        rows_per_s, tokens_per_s = self.rates()
        share = self.done / self.total if self.total else 1.0
        left = self.total - self.done
        eta = duration(left / rows_per_s) if rows_per_s > 0 and left > 0 else "-"
        filled = int(share * _BAR_WIDTH)
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        return " | ".join(
            (
                f"{self.done}/{self.total} rows ({share:.1%})",
                f"[{bar}]",
                f"{rows_per_s:,.1f} rows/s",
                f"{tokens_per_s:,.0f} out tok/s",
                f"{self.healthy()} servers",
                f"{self.failed} failed",
                f"ETA {eta}",
            )
        )

    def show(self) -> None:
        """Draw the bar, or log one progress event."""
        if self.bar:
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.stream.flush()
            self._drawn = True
            return
        rows_per_s, tokens_per_s = self.rates()
        log.info(
            "progress",
            done=self.done,
            total=self.total,
            failed=self.failed,
            rows_per_s=round(rows_per_s, 1),
            output_tokens_per_s=round(tokens_per_s),
            healthy_servers=self.healthy(),
        )

    def close(self) -> None:
        """Show the final state and end the bar's line."""
        self.show()
        if self.bar and self._drawn:
            self.stream.write("\n")
            self.stream.flush()


def duration(seconds: float) -> str:
    """``3725`` -> ``'1h02m'``; ``75`` -> ``'1m15s'``.

    Examples:
        >>> duration(3725), duration(75), duration(9)
        ('1h02m', '1m15s', '9s')
    """
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"
