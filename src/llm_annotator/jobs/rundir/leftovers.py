"""What a corpus unit's holder leaves in the run directory when it is killed while it
writes, found and removed.

A unit's files are written whole under another name, then renamed
(:func:`~llm_annotator.jobs.files.atomic_write`); a holder killed in between leaves the
temporary behind, under a name that dataset readers skip (it begins with a dot) but
that nothing renames. Of the unit whose output is ``X.parquet``, those are:

- ``annotations/.X.parquet.new``, the unit's consolidated file before its rename to
  ``annotations/X.parquet``, and the temporaries it is written through
  (``annotations/..X.parquet.new.<random>.tmp``);
- ``annotations/_units/.X.parquet.json.<random>.tmp``, its record's;
- ``units/X/.<file>.<random>.tmp``, its store's (``job.json``'s).

Only the unit's holder writes them, so whoever holds the unit next removes them as it
begins it (:meth:`~llm_annotator.jobs.rundir.partitions.PartitionedStore.begin`), and
``llm-annotator merge``, once every unit is finished, removes any left. Files that any
worker may write at any moment (the manifest, ``corpus.json``) are another kind: only
their temporaries not modified for a while are a dead writer's
(:func:`stale_temporaries`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from llm_annotator.jobs.files import temporary_of

log = structlog.get_logger(__name__)

NEW_SUFFIX = ".new"
_PARQUET = ".parquet"
_RECORD = ".parquet.json"


def consolidating_name(output: str) -> str:
    """The name a unit's file is consolidated under in ``annotations/``, unseen by
    dataset readers until its rename to ``output``.

    Examples:
        >>> consolidating_name("a.jsonl.parquet")
        '.a.jsonl.parquet.new'
    """
    return f".{output}{NEW_SUFFIX}"


def leftover_of(name: str) -> str | None:
    """The unit (its output name) whose holder left the file ``name`` of
    ``annotations/`` or ``annotations/_units/``, or None if it is no unit's leftover.

    Examples:
        >>> leftover_of("..a.jsonl.parquet.new.0ab_cdef.tmp")
        'a.jsonl.parquet'
        >>> leftover_of(".a.jsonl.parquet.new"), leftover_of("a.jsonl.parquet")
        ('a.jsonl.parquet', None)
        >>> leftover_of(".a.jsonl.parquet.json.x1y2z3w4.tmp")
        'a.jsonl.parquet'
        >>> leftover_of("._manifest.json.x1y2z3w4.tmp"), leftover_of("a.jsonl.parquet.json")
        (None, None)
    """
    made_for = temporary_of(name)
    target = made_for or name
    if target.startswith(".") and target.endswith(_PARQUET + NEW_SUFFIX):
        return target[1 : -len(NEW_SUFFIX)]
    if made_for is not None and target.endswith(_RECORD):
        return target.removesuffix(".json")
    return None


def unit_leftovers(*folders: Path) -> dict[str, list[Path]]:
    """The units' leftovers in ``folders`` (``annotations/`` and its ``_units/``), by
    unit output name: one listing of each folder, however many units."""
    found: dict[str, list[Path]] = {}
    for folder in folders:
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    output = leftover_of(entry.name)
                    if output is not None and not entry.is_dir(follow_symlinks=False):
                        found.setdefault(output, []).append(Path(entry.path))
        except (FileNotFoundError, NotADirectoryError):
            continue
    return found


def store_leftovers(directory: Path) -> list[Path]:
    """The temporaries in a unit's store folder (of its ``job.json``, say)."""
    try:
        with os.scandir(directory) as entries:
            return [
                Path(entry.path)
                for entry in entries
                if temporary_of(entry.name) is not None and not entry.is_dir(follow_symlinks=False)
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_stale(modified: float, now: float, idle: float) -> bool:
    """Whether a temporary last modified at ``modified`` is surely its dead writer's by
    ``now``: untouched for ``idle`` seconds (a writer writes on until it renames it).

    Examples:
        >>> is_stale(100.0, 161.0, 60.0), is_stale(100.0, 130.0, 60.0)
        (True, False)
    """
    return now - modified >= idle


def stale_temporaries(folder: Path, names: Iterable[str], *, idle: float, now: float) -> list[Path]:
    """The temporaries of the files ``names`` in ``folder`` not modified for ``idle``
    seconds before ``now``: for files any worker may write at any moment (the
    manifest), whose fresh temporaries may be a live writer's."""
    wanted = set(names)
    found: list[Path] = []
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if temporary_of(entry.name) not in wanted:
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # renamed by its writer meanwhile
                    continue
                if is_stale(info.st_mtime, now, idle):
                    found.append(Path(entry.path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return found


def remove_leftovers(paths: Iterable[Path], **context: Any) -> int:
    """Remove these leftovers (logged once, with ``context``: the unit, say); how many
    were removed. One that cannot be removed is logged and left."""
    removed: list[str] = []
    for path in paths:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as error:
            log.warning("leftover_not_removed", path=str(path), error=str(error), **context)
            continue
        removed.append(str(path))
    if removed:
        log.info("leftovers_removed", files=removed, **context)
    return len(removed)
