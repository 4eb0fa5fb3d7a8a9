"""One job over many annotator processes: which rows a shard takes, and where it keeps
them.

Every shard reads the same input and takes the rows whose id hashes to it (a stable
64-bit hash of the id, :func:`~llm_annotator.jobs.ids.hash_id`, not the row's
position), so the shards of a job split its rows into disjoint parts that do not
depend on the order of the input or on how many rows each shard has done. The input's
first pass (:meth:`Shard.select`) hashes each id once and marks the shard's rows; the
stream then decodes only those (other shards' JSONL lines are not parsed, their Parquet
rows not turned into Python objects). Shard ``i`` of ``n`` keeps its own store, lock,
status and timeline in ``RUN_DIR/shard-000i-of-000n`` (a run directory of its own);
``RUN_DIR/sharding.json`` records the shard count and the job's fingerprint, so a shard
started with another count or other settings is refused (another count would hand rows
to other shards than before). A job has at most :data:`MAX_SHARDS` shards; readers list
the ``shard-*`` folders there are (:func:`shard_folders`) rather than try every index.

A scheduler's array sets which shard a process is: ``--shard auto`` reads SLURM's
``SLURM_ARRAY_TASK_ID`` (the index: submit ``--array=0-(N-1)``) and
``SLURM_ARRAY_TASK_COUNT``, or a Kubernetes Indexed Job's ``JOB_COMPLETION_INDEX`` with
the count given as ``auto/N`` (or in ``LLM_ANNOTATOR_SHARD_COUNT``); ``auto/N`` also
fixes the count of a SLURM task re-run alone (``sbatch --array=3``).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import structlog

from llm_annotator.errors import ConfigurationError, FingerprintMismatchError, RunDirectoryError
from llm_annotator.jobs.files import check_entry, read_run_file, refused
from llm_annotator.jobs.ids import RowId, hash_id
from llm_annotator.jobs.rows.inputs import RowSource, Selection

log = structlog.get_logger(__name__)

SHARDING_FILE = "sharding.json"
"""In a sharded run directory: the shard count and the job's fingerprint."""
COUNT_VARIABLE = "LLM_ANNOTATOR_SHARD_COUNT"
MAX_SHARDS = 100_000
"""The most shards a job may be split into (far more than any cluster's array runs at
once); a larger count, given or read from ``sharding.json``, is refused."""
_FOLDER = re.compile(r"shard-([0-9]+)-of-([0-9]+)", re.ASCII)


@dataclass(frozen=True, slots=True)
class Shard:
    """Shard ``index`` of ``count`` (0-based).

    Examples:
        >>> Shard.parse("1/3")
        Shard(index=1, count=3)
        >>> Shard(1, 3).name
        'shard-0001-of-0003'
        >>> sum(Shard(i, 3).owns("row-7") for i in range(3))
        1
        >>> Shard.parse("auto", {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"})
        Shard(index=2, count=4)
        >>> Shard.parse("auto/8", {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "1"})
        Shard(index=3, count=8)
        >>> Shard.parse("auto/8", {"JOB_COMPLETION_INDEX": "5"})
        Shard(index=5, count=8)
        >>> Shard.parse("3/3")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: shard: the index must be from 0 to 2 ...
    """

    index: int
    count: int

    def __post_init__(self) -> None:
        for name in ("index", "count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigurationError(f"shard: the {name} must be an int, got {value!r}")
        if self.count < 1:
            raise ConfigurationError(f"shard: the count must be at least 1, got {self.count}")
        if self.count > MAX_SHARDS:
            raise ConfigurationError(
                f"shard: the count must be at most {MAX_SHARDS:,}, got {self.count:,}"
            )
        if not 0 <= self.index < self.count:
            raise ConfigurationError(
                f"shard: the index must be from 0 to {self.count - 1} (of {self.count} "
                f"shards), got {self.index}"
            )

    @classmethod
    def of(cls, value: Any) -> Shard | None:
        """A ``shard=`` argument: None, a :class:`Shard`, an ``(index, count)`` pair or
        text (:meth:`parse`)."""
        if value is None or isinstance(value, Shard):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, tuple | list) and len(value) == 2:
            return cls(value[0], value[1])
        raise ConfigurationError(
            f"shard must be (index, count), 'INDEX/COUNT' or 'auto', got {value!r}"
        )

    @classmethod
    def parse(cls, text: str, environ: Mapping[str, str] | None = None) -> Shard:
        """``"INDEX/COUNT"``, ``"auto"`` or ``"auto/COUNT"`` (see the module's docstring).

        Raises:
            ConfigurationError: The text or the environment does not say a shard.
        """
        env = os.environ if environ is None else environ
        head, _, tail = text.strip().partition("/")
        if head == "auto":
            return cls._auto(env, _integer(tail, "the count of auto/COUNT") if tail else None)
        if not tail:
            raise ConfigurationError(
                f"shard: expected INDEX/COUNT (like 0/4), auto or auto/COUNT, got {text!r}"
            )
        return cls(_integer(head, "the index"), _integer(tail, "the count"))

    @classmethod
    def _auto(cls, env: Mapping[str, str], count: int | None) -> Shard:
        if "SLURM_ARRAY_TASK_ID" in env:
            # The task id is the index (an array of 0-(N-1)), so that one task re-run
            # alone (sbatch --array=3 with auto/N) is still its own shard.
            task = _integer(env["SLURM_ARRAY_TASK_ID"], "SLURM_ARRAY_TASK_ID")
            if count is None:
                if "SLURM_ARRAY_TASK_COUNT" not in env:
                    raise ConfigurationError(
                        "shard auto: SLURM_ARRAY_TASK_COUNT is not set; give auto/COUNT"
                    )
                count = _integer(env["SLURM_ARRAY_TASK_COUNT"], "SLURM_ARRAY_TASK_COUNT")
            if not 0 <= task < count:
                raise ConfigurationError(
                    f"shard auto: SLURM_ARRAY_TASK_ID is {task}, not a shard of {count}: "
                    f"submit the array as --array=0-{count - 1} (a task re-run alone: "
                    "--shard auto/COUNT)"
                )
            return cls(task, count)
        if "JOB_COMPLETION_INDEX" in env:
            index = _integer(env["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX")
            if count is None and COUNT_VARIABLE in env:
                count = _integer(env[COUNT_VARIABLE], COUNT_VARIABLE)
            if count is None:
                raise ConfigurationError(
                    "shard auto: in a Kubernetes Indexed Job give the count, as auto/COUNT "
                    f"(the Job's completions) or in {COUNT_VARIABLE}"
                )
            return cls(index, count)
        raise ConfigurationError(
            "shard auto: neither SLURM_ARRAY_TASK_ID (a SLURM job array) nor "
            "JOB_COMPLETION_INDEX (a Kubernetes Indexed Job) is set; give INDEX/COUNT"
        )

    @property
    def name(self) -> str:
        """The shard's folder in the run directory."""
        return f"shard-{self.index:04d}-of-{self.count:04d}"

    def directory(self, run_dir: Path) -> Path:
        return run_dir / self.name

    def owns(self, row_id: RowId) -> bool:
        """Whether the row with this id is this shard's."""
        return hash_id(row_id) % self.count == self.index

    def select(self, source: RowSource) -> Selection:
        """The input's one pass before any row is used (:meth:`RowSource.scan`), which
        also finds this shard's rows and counts them; stream them with
        ``source.rows(selection)``, which skips the others before decoding them.

        Examples:
            >>> from llm_annotator.jobs.rows.inputs import open_input
            >>> rows = [{"id": f"row-{i}"} for i in range(6)]
            >>> selection = Shard(1, 3).select(open_input(rows, id_column="id"))
            >>> ids = [row.id for row in open_input(rows, id_column="id").rows(selection)]
            >>> ids == [r["id"] for r in rows if Shard(1, 3).owns(r["id"])]
            True
            >>> selection.taken == len(ids)
            True
        """
        return source.select(self.index, self.count)


def _integer(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigurationError(f"shard: {what} must be an integer, got {text!r}") from None


def read_sharding(run_dir: Path) -> dict[str, Any] | None:
    """``sharding.json`` of a run directory, or None if it is not sharded.

    Returns:
        The record: ``count`` (an int from 1 to :data:`MAX_SHARDS`) and ``fingerprint``
        (a dict).

    Raises:
        RunDirectoryError: The file is a link or not a regular file, is not JSON, or is
            not a sharding record (the message says what is wrong).
    """
    path = run_dir / SHARDING_FILE
    data = read_run_file(path)
    if data is None:
        return None
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        problem: str | None = f"not JSON ({error})"
    else:
        problem = _sharding_problem(value)
    if problem is not None:
        raise RunDirectoryError(
            f"{path} is not a sharding record: {problem}; restore it (it holds the shard "
            "count and the job's fingerprint), or give the job another --output-dir",
            path=str(path),
        )
    return dict(value)


def _sharding_problem(value: Any) -> str | None:
    """What is wrong with a ``sharding.json`` value, or None.

    Examples:
        >>> _sharding_problem({"count": 4, "fingerprint": {}}) is None
        True
        >>> _sharding_problem({"count": "4", "fingerprint": {}})
        "its count is '4', not an integer"
        >>> _sharding_problem({"count": 10**9, "fingerprint": {}})
        'its count is 1000000000, not from 1 to 100,000'
    """
    if not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object"
    count = value.get("count")
    if isinstance(count, bool) or not isinstance(count, int):
        return f"its count is {_short(count)}, not an integer"
    if not 1 <= count <= MAX_SHARDS:
        return f"its count is {count}, not from 1 to {MAX_SHARDS:,}"
    if not isinstance(value.get("fingerprint"), dict):
        return f"its fingerprint is {_short(value.get('fingerprint'))}, not an object"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def not_sharded(run_dir: Path) -> None:
    """Refuse a job without a shard in a directory split into shards.

    Raises:
        ConfigurationError: Saying how to run each shard, or to merge them.
    """
    said = read_sharding(run_dir)
    if said is not None:
        raise ConfigurationError(
            f"{run_dir} is split into {said['count']} shards: run each with --shard "
            f"INDEX/{said['count']} (shard=(index, {said['count']})), or merge what they "
            f"did with llm-annotator merge {run_dir}"
        )


def shard_folders(run_dir: Path, count: int) -> dict[int, Path]:
    """The shard folders of a run directory split into ``count`` shards, by index: the
    ``shard-*`` entries there are, listed (never every index tried in turn).

    Entries named ``shard-*`` that are not a folder of this count (another count's, or
    another name) are skipped with a warning.

    Raises:
        RunDirectoryError: An entry under a shard's own name is a link, a file or
            anything but a folder.
    """
    found: dict[int, Path] = {}
    with os.scandir(run_dir) as entries:
        for entry in entries:
            if not entry.name.startswith("shard-"):
                continue
            match = _FOLDER.fullmatch(entry.name)
            index = int(match.group(1)) if match is not None else -1
            if not 0 <= index < count or Shard(index, count).name != entry.name:
                log.warning(
                    "shard_entry_ignored",
                    run_dir=str(run_dir),
                    entry=entry.name,
                    reason=f"not the folder of a shard of {count}",
                )
                continue
            path = run_dir / entry.name
            if entry.is_file(follow_symlinks=False):
                raise refused(path, "a file, not the shard's folder")
            if entry.is_dir(follow_symlinks=False) or check_entry(path, directory=True):
                found[index] = path  # (check_entry raises for a link or a FIFO)
    return found


def claim(run_dir: Path, shard: Shard, fingerprint: Mapping[str, Any], *, force: bool) -> None:
    """Record the sharding in ``run_dir`` (the first shard), or check it (the others).

    Raises:
        ConfigurationError: The directory holds an unsharded job, or was split into
            another count of shards.
        RunDirectoryError: Its ``sharding.json`` or ``job.json`` is a link, not a
            regular file, or (``sharding.json``) not a sharding record.
        FingerprintMismatchError: Its shards were started with other settings (and
            ``force`` is False).
    """
    from llm_annotator.jobs.rundir.store import JOB_FILE, atomic_write

    if check_entry(run_dir / JOB_FILE):
        raise ConfigurationError(
            f"{run_dir} holds a job that is not sharded; run without --shard to resume "
            "it, or give the sharded job another --output-dir"
        )
    record = {"count": shard.count, "fingerprint": dict(fingerprint)}
    said = read_sharding(run_dir)
    if said is None:
        # Written whole under a fresh name of its own (an exclusive create: no name to
        # plant), then linked in place, which never replaces an entry: a shard that
        # starts at the same moment sees no file or a whole one, never half of one.
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{SHARDING_FILE}.", suffix=".tmp", dir=run_dir)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
            os.link(temporary, run_dir / SHARDING_FILE)
        except FileExistsError:
            said = read_sharding(run_dir)  # another shard was first, just now (or a
            # planted entry, which this refuses)
        else:
            return
        finally:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    assert said is not None
    if said["count"] != shard.count:
        raise ConfigurationError(
            f"{run_dir} is split into {said['count']} shards, not {shard.count}: another "
            f"count would hand rows to other shards than before. Run the shards as "
            f"--shard INDEX/{said['count']}, or merge them (llm-annotator merge {run_dir}) "
            "and start the new split in another --output-dir"
        )
    if said.get("fingerprint") != record["fingerprint"]:
        if not force:
            raise FingerprintMismatchError(
                f"{run_dir}: its shards were started with other settings (prompt, model, "
                "options or input columns); give the same settings, or --force to go on "
                "with these"
            )
        with atomic_write(run_dir / SHARDING_FILE) as file:
            file.write(orjson.dumps(record, option=orjson.OPT_INDENT_2) + b"\n")
