"""A benchmark's way of comparing with an older commit of the library.

The older code runs from a git worktree of that commit, put first on the import path of
a worker process; the benchmark itself (its servers, its measuring) stays this one, so
both run side by side in one run on the same servers.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def short(rev: str) -> str:
    """The commit ``rev`` names, abbreviated (a label for tables).

    Raises:
        RuntimeError: If ``rev`` names no commit of this repository.
    """
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", f"{rev}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"--against {rev}: no such commit ({done.stderr.strip()})")
    return done.stdout.strip()


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A detached git worktree of ``rev`` in a temporary folder, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="llm-annotator-at-"))
    tree = folder / "tree"
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(tree), rev],
        check=True,
    )
    try:
        yield tree
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False
        )
        shutil.rmtree(folder, ignore_errors=True)


def environment(tree: Path) -> dict[str, str]:
    """This process's environment with the worktree's library first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        part for part in (str(tree / "src"), env.get("PYTHONPATH", "")) if part
    )
    return env


def add_against(parser: argparse.ArgumentParser, what: str) -> None:
    """``--against REV``: also run ``what`` on the library of an older commit."""
    parser.add_argument(
        "--against",
        metavar="REV",
        help=f"also run {what} of this older commit (a git worktree of it, in a worker "
        "process, on the same servers)",
    )
