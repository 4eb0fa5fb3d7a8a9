"""Running ``llm-annotator run`` as a real subprocess, the way a user's shell does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

COMMAND = str(Path(sys.executable).with_name("llm-annotator"))
"""The console script installed beside the test interpreter."""


def run_job(
    servers: str,
    data: Path,
    output_dir: Path,
    *extra: str,
    template: str = "Label: {text}",
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``llm-annotator run`` on one server URL with JSON logs, its output captured.

    No stdin (as under CI); ``env`` adds to this process's environment.
    """
    return subprocess.run(
        [
            COMMAND,
            "run",
            "--servers",
            servers,
            "--input",
            str(data),
            "--prompt-template",
            template,
            "--output-dir",
            str(output_dir),
            "--log-format",
            "json",
            *extra,
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )
