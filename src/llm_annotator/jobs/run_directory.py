"""One reader of run directories: which kind of job a directory holds, and its output.

A run directory holds one of three kinds of job, each with its own layout:

- ``file``: a job over one input in one store, consolidated into
  ``annotations.parquet``;
- ``shards``: the same job split by id hash over static shards (``shard-*`` folders,
  ``sharding.json``), merged by the last into ``annotations.parquet``;
- ``corpus``: a job of units (a corpus, or one file cut into units), in any mode
  (one process, static shards, claims), one Parquet file per unit in ``annotations/``.

:meth:`RunDirectory.open` decides which, by the files the job wrote first; everything
that reads a run directory (``status``, ``report``, ``run``'s summary, a pipeline's
steps) asks it rather than looking for the files itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llm_annotator.jobs.files import check_entry
from llm_annotator.jobs.rundir.consolidate import PARQUET_FILE
from llm_annotator.jobs.rundir.partitions import (
    ANNOTATIONS_DIR,
    CORPUS_FILE,
    read_corpus_record,
    read_manifest,
)
from llm_annotator.jobs.rundir.store import JOB_FILE
from llm_annotator.jobs.shards.merge import is_merged
from llm_annotator.jobs.shards.shard import read_sharding

Kind = Literal["none", "file", "shards", "corpus"]


@dataclass(frozen=True, slots=True)
class RunDirectory:
    """A run directory and the kind of job it holds (see the module).

    Attributes:
        path: The directory.
        kind: ``file``, ``shards``, ``corpus``, or ``none`` when it holds no job (yet).
        shards: The shard count of a ``shards`` job, else None.
        part_of: For a shard's or a worker's folder of a corpus job, the job's
            directory (which ``status`` and ``report`` read), else None.
    """

    path: Path
    kind: Kind
    shards: int | None = None
    part_of: Path | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> RunDirectory:
        """The directory ``path`` as it stands now.

        Raises:
            RunDirectoryError: A file the decision reads is a link or not a regular
                file, or ``sharding.json`` is not the job's own.

        Examples:
            >>> import tempfile
            >>> RunDirectory.open(tempfile.mkdtemp()).kind
            'none'
        """
        directory = Path(path)
        if not directory.is_dir():
            return cls(directory, "none")  # not made yet, or not a folder: no job
        if check_entry(directory / CORPUS_FILE):
            return cls(directory, "corpus")
        sharding = read_sharding(directory)
        if sharding is not None:
            return cls(directory, "shards", shards=int(sharding["count"]))
        part_of = None
        if check_entry(directory.parent / CORPUS_FILE):
            part_of = directory.parent  # a shard's or a worker's folder of a corpus job
        if check_entry(directory / JOB_FILE) or check_entry(directory / PARQUET_FILE):
            return cls(directory, "file", part_of=part_of)
        return cls(directory, "none", part_of=part_of)

    @property
    def output(self) -> Path:
        """Where the job's output goes: ``annotations/`` of a corpus job, else
        ``annotations.parquet`` (written at the end, or by the merge)."""
        if self.kind == "corpus":
            return self.path / ANNOTATIONS_DIR
        return self.path / PARQUET_FILE

    def has_output(self) -> bool:
        """Whether the output is there: a corpus job's folder of units, the file of a
        one-file job, the merged file of a sharded one."""
        if self.kind == "corpus":
            return check_entry(self.output, directory=True)
        if self.kind == "shards":
            return is_merged(self.path)
        return check_entry(self.output)

    def output_files(self) -> Iterator[tuple[str | None, Path]]:
        """The Parquet files of the output, each with its unit's name (None for the one
        file of a one-file or merged job), in the units' order.

        Raises:
            InputError: There is no output (yet).
        """
        from llm_annotator.errors import InputError

        if not self.has_output():
            raise InputError(
                f"{self.path} holds no output yet ({PARQUET_FILE} or {ANNOTATIONS_DIR}/): "
                "run its job first"
            )
        if self.kind != "corpus":
            yield None, self.output
            return
        names = sorted(
            entry.name
            for entry in os.scandir(self.output)
            if entry.name.endswith(".parquet") and not entry.name.startswith(("_", "."))
        )
        for name in names:
            yield name.removesuffix(".parquet"), self.output / name

    def corpus_mode(self) -> str | None:
        """How a corpus job runs (``whole``, ``shards``, ``claim``), else None."""
        if self.kind != "corpus":
            return None
        record = read_corpus_record(self.path)
        return None if record is None else str(record.get("mode", "whole"))

    def manifest(self) -> dict[str, Any] | None:
        """A corpus job's manifest (units done, rows, counts), if written."""
        return read_manifest(self.path) if self.kind == "corpus" else None


__all__ = ["Kind", "RunDirectory"]
