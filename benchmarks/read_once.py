"""Each byte read once: how much a ``--shard i/4`` process of a corpus job reads, against
its quarter of the corpus.

A corpus of ``--files`` JSONL files of ``--rows`` rows of about ``--row-bytes`` bytes
(6 KB by default), built once into ``--cache``. nginx answers every chat completion with
a fixed body on four loopback ports. Four processes, ``llm-annotator run --shard i/4``,
one after another, finish the corpus into a fresh run directory; each reports, as it
exits, its ``rchar`` (``/proc/self/io``: every byte it read, files, pipes and sockets,
whatever the page cache held) and its peak RSS. A process also reads what it reads
whatever its rows (its imports, the CA certificates): that fixed cost is the ``rchar``
of the same command over a corpus of one row, and the table gives each figure with and
without it.

With ``--against REV`` the same runs are made, in the same run of this script on the
same corpus and server, by the library of that commit (a git worktree of it, first on
the import path of the processes), and the table puts both side by side.

Run it as::

    python benchmarks/read_once.py --against HEAD     # this checkout beside its HEAD
    python benchmarks/read_once.py --quick            # 8 files of 400 rows

Prints the figures; exits 0 unless the harness fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orjson

import _against
import _harness as harness
from _nginx import MODEL, CannedServer

WORDS = [
    "review", "product", "arrived", "time", "works", "described", "great", "poor",
    "quality", "price", "delivery", "battery", "screen", "sound", "colour", "size",
    "weight", "button", "cable", "charger", "manual", "warranty", "box",
]  # fmt: skip

REPORT_IO = """\
import atexit, sys
out = sys.argv.pop(1)
def report():
    with open("/proc/self/io", "rb") as io, open("/proc/self/status", "rb") as status:
        lines = io.read().splitlines() + status.read().splitlines()
    with open(out, "wb") as to:
        to.write(b"\\n".join(line for line in lines if line.startswith((b"rchar", b"VmHWM"))))
atexit.register(report)
from llm_annotator.cli import main
sys.argv[0] = "llm-annotator"
sys.exit(main())
"""
"""Runs the command, then writes the process's ``rchar`` and peak RSS (``VmHWM``) to a
file as it exits (its threads joined)."""


def build(folder: Path, files: int, rows: int, row_bytes: int) -> Path:
    """A corpus of ``files`` JSONL files of ``rows`` rows (``id``, ``text`` of about
    ``row_bytes`` bytes), built once."""
    done = folder / ".complete"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    pick = random.Random(7)
    for f in range(files):
        with (folder / f"part-{f:03d}.jsonl").open("wb") as out:
            for r in range(rows):
                words: list[str] = []
                while sum(len(w) + 1 for w in words) < row_bytes:
                    words.append(pick.choice(WORDS))
                out.write(orjson.dumps({"id": f * rows + r, "text": " ".join(words)}) + b"\n")
    done.touch()
    return folder


def corpus_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if not p.name.startswith("."))


def rchar(
    urls: list[str], corpus: Path, out: Path, env: dict[str, str], *extra: str
) -> tuple[int, int]:
    """The bytes one ``llm-annotator run`` over ``corpus`` read (``rchar``), and its
    peak RSS in kB."""
    report = out.with_name(out.name + f".io{len(list(out.parent.glob(out.name + '.io*')))}")
    args = [
        sys.executable, "-c", REPORT_IO, str(report), "run", "--servers", *urls,
        "--model", MODEL, "--input", str(corpus), "--id-column", "id",
        "--prompt-template", harness.TEMPLATE, "--output-dir", str(out),
        "--max-completion-tokens", str(harness.MAX_TOKENS), "--log-format", "json",
        "--processes", "1", *extra,
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, stdin=subprocess.DEVNULL, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the job failed ({' '.join(extra)}): {done.stderr.decode()[-2000:]}")
    fields = dict(line.split(b":", 1) for line in report.read_bytes().splitlines())
    return int(fields[b"rchar"]), int(fields[b"VmHWM"].split()[0])


def measure(
    urls: list[str], corpus: Path, one_row: Path, scratch: Path, env: dict[str, str]
) -> tuple[int, list[tuple[int, int]]]:
    """The fixed cost of a process, and each of the four shards' ``rchar`` and peak
    RSS."""
    fixed, _ = rchar(urls, one_row, scratch / "one-row", env)
    run = scratch / "sharded"
    return fixed, [rchar(urls, corpus, run, env, "--shard", f"{i}/4") for i in range(4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--rows", type=int, default=6000, help="rows per file")
    parser.add_argument("--row-bytes", type=int, default=6000)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--cache", type=Path, default=Path(tempfile.gettempdir()) / "llm-annotator-read-once"
    )
    _against.add_against(parser, "the same four shards")
    args = parser.parse_args()
    if args.quick:
        args.rows = 400
    if not Path("/proc/self/io").exists():
        raise SystemExit("read_once: needs /proc/<pid>/io (Linux with task I/O accounting)")
    corpus = build(
        args.cache / f"corpus-{args.files}x{args.rows}x{args.row_bytes}",
        args.files,
        args.rows,
        args.row_bytes,
    )
    one_row = build(args.cache / f"one-row-{args.row_bytes}", 1, 1, args.row_bytes)
    total = corpus_bytes(corpus)
    quarter = total / 4
    against = _against.short(args.against) if args.against else None
    print(
        f"read_once: {args.files} files of {args.rows:,} rows of ~{args.row_bytes:,} bytes, "
        f"{total / 1e6:,.1f} MB; a quarter {quarter / 1e6:,.2f} MB; "
        f"{harness.versions('llm-annotator', 'pyarrow')}"
    )
    scratch = Path(tempfile.mkdtemp(prefix="read-once-"))
    figures: dict[str, tuple[int, list[tuple[int, int]]]] = {}
    try:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(CannedServer(ports=4))
            urls = list(server.base_urls)
            if against:
                tree = stack.enter_context(_against.worktree(against))
                figures[against] = measure(
                    urls, corpus, one_row, scratch / "before", _against.environment(tree)
                )
            figures["this checkout"] = measure(
                urls, corpus, one_row, scratch / "after", dict(os.environ)
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    labels = list(figures)
    print("\nEach --shard i/4 process: rchar in MB and times its quarter of the corpus;")
    print("the same less the fixed cost (the command over a one-row corpus); peak RSS MB")
    print(f"{'shard':<8}" + "".join(f"{label:>44}" for label in labels))
    for index in range(4):
        cells = []
        for label in labels:
            fixed, shards = figures[label]
            read, peak = shards[index]
            cells.append(
                f"{read / 1e6:>8,.1f} {read / quarter:>5.2f}x"
                f" | {(read - fixed) / 1e6:>7,.1f} {(read - fixed) / quarter:>5.2f}x"
                f" | {peak / 1024:>6,.0f}"
            )
        print(f"{index}/4{'':<5}" + "".join(f"{cell:>44}" for cell in cells))
    print(
        f"{'fixed':<8}"
        + "".join(f"{figures[label][0] / 1e6:>12,.1f} MB{'':<29}" for label in labels)
    )


if __name__ == "__main__":
    main()
