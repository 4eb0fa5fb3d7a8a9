"""A step's rows, written out before its job: generated prompts, an earlier step's
answered rows, or a dataset filtered and reshaped.

The rows are read and written batch by batch, so memory stays flat in their number.
They go to ``OUTPUT_DIR/inputs/NAME.jsonl`` (one input), or to one file per unit in
``OUTPUT_DIR/inputs/NAME/`` when what they come from is a corpus (the step is then a
corpus job too, whose units other processes could claim). Each is written to a
temporary of a fresh random name (``.NAME.jsonl.<random>.tmp``, ``.NAME.<random>.tmp/``)
made by an exclusive create, never through a link, and renamed into place whole, so a
file there is complete: a step resumed reads the very rows it began with. A temporary
left by a run that was killed is removed when the step's rows are written again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import pyarrow.parquet as pq
import structlog

from llm_annotator.errors import ConfigurationError, InputError
from llm_annotator.jobs.answers.records import ANSWER_COLUMNS, VALID_COLUMN, VALIDATED_COLUMN
from llm_annotator.jobs.files import (
    atomic_write,
    check_entry,
    fsync_directory,
    make_directory,
    open_file,
)
from llm_annotator.jobs.rows.corpus import is_corpus, list_corpus
from llm_annotator.jobs.rows.inputs import Row, open_input
from llm_annotator.jobs.run_directory import RunDirectory
from llm_annotator.jobs.rundir.partitions import (
    ANNOTATIONS_DIR,
    read_corpus_record,
    read_unit_records,
    unit_finished,
)
from llm_annotator.pipeline.steps import Step
from llm_annotator.pipeline.where import Where

log = structlog.get_logger(__name__)

ID = "id"
"""The id column of a written step input (the step's job reads it as ``id_column``)."""
PROMPT_ID = "prompt_id"
"""With ``n`` answers or generation: the id of the row (prompt) an answer is to."""
ANSWER_INDEX = "answer_index"
"""With ``n`` answers or generation: which of the row's answers (0 to n - 1)."""
RENAMED = ("response", VALIDATED_COLUMN, "input_file")
"""An earlier step's columns that the step reading it gets as ``<step>_<column>``."""
DROPPED = frozenset({*ANSWER_COLUMNS, VALID_COLUMN} - set(RENAMED))
"""An earlier step's bookkeeping columns, left out of what a later step reads."""
_BATCH = 2048
_SORTED = orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY


@dataclass(slots=True)
class Written:
    """What writing a step's rows made.

    Attributes:
        data: What the step's job reads: the file, or the folder of unit files.
        rows: Rows written.
        read: Rows read before the filter, the hook and the ``n`` copies.
        columns: The rows' columns besides the id, in first-seen order.
    """

    data: Path
    rows: int = 0
    read: int = 0
    columns: dict[str, None] = field(default_factory=dict)


def data_identity(step: Step) -> Any:
    """What says that a step's dataset changed: a file's size and modification time,
    or a digest of a corpus's listing (names, sizes, times); None for what is not read
    from files (a list of dicts, a ``Dataset``) and for steps without a dataset.

    Raises:
        InputError: The dataset cannot be listed (a path that does not exist, ...).
    """
    data = step.data
    if data is None:
        return None
    if isinstance(data, str) or hasattr(data, "__fspath__"):
        paths = [data]
    elif (
        isinstance(data, list | tuple)
        and data
        and all(isinstance(p, str) or hasattr(p, "__fspath__") for p in data)
    ):
        paths = list(data)
    elif isinstance(data, list | tuple):  # rows in memory: a digest of their content
        digest = hashlib.blake2b(digest_size=16)
        for row in data:
            try:
                digest.update(orjson.dumps(row, option=_SORTED))
            except TypeError:
                digest.update(repr(row).encode("utf-8", "backslashreplace"))
        return f"rows:{len(data)}:{digest.hexdigest()}"
    else:  # a datasets.Dataset says its own content's fingerprint
        fingerprint = getattr(data, "_fingerprint", None)
        return f"dataset:{fingerprint}" if isinstance(fingerprint, str) else None
    if is_corpus(data):
        return list_corpus(data, skip_bad_files=step.skip_bad_files).digest()
    try:
        info = os.stat(paths[0])
    except OSError as error:
        raise InputError(
            f"step {step.name}: cannot read its input {paths[0]}: {error.strerror or error}"
        ) from None
    return [info.st_size, info.st_mtime_ns]


def input_entries(inputs_dir: Path, name: str) -> tuple[tuple[Path, bool], ...]:
    """Where the rows of step ``name`` go, each with whether it is a folder: the file of
    one input, the folder of a corpus's units.

    Examples:
        >>> [(str(path), folder) for path, folder in input_entries(Path("in"), "label")]
        [('in/label.jsonl', False), ('in/label', True)]
    """
    return (inputs_dir / f"{name}.jsonl", False), (inputs_dir / name, True)


def is_leftover(entry: str, name: str) -> bool:
    """Whether ``entry`` in the inputs folder is a temporary of step ``name`` that a
    killed run left: ``.NAME.jsonl.<random>.tmp``, ``.NAME.<random>.tmp``, or the
    fixed ``.NAME.jsonl.partial`` and ``.NAME.partial`` of earlier versions (a step's
    name has no dot, so no step's temporaries are another's).

    Examples:
        >>> entries = [".label.jsonl.k2x9a_1q.tmp", ".label.x81bqz0e.tmp", ".label.jsonl.partial"]
        >>> [is_leftover(entry, "label") for entry in entries]
        [True, True, True]
        >>> others = ["label.jsonl", ".label.jsonl", ".labels.tmp", ".reason.jsonl.partial"]
        >>> [is_leftover(entry, "label") for entry in others]
        [False, False, False, False]
    """
    parts = entry.split(".")
    return len(parts) >= 3 and parts[:2] == ["", name] and parts[-1] in ("tmp", "partial")


def written_input(inputs_dir: Path, step: Step) -> Path | None:
    """The rows written for ``step`` before, if complete (a file or a folder).

    Raises:
        RunDirectoryError: A link or a special file is where they go.
    """
    for path, folder in input_entries(inputs_dir, step.name):
        if check_entry(path, directory=folder):
            return path
    return None


def remove_input(inputs_dir: Path, step: Step) -> None:
    """Remove the rows written for ``step`` (its settings changed), and any temporary of
    its that a killed run left; a link is removed, never what it leads to."""
    leftovers: list[Path] = []
    with contextlib.suppress(FileNotFoundError):
        leftovers = [
            inputs_dir / entry for entry in os.listdir(inputs_dir) if is_leftover(entry, step.name)
        ]
    if leftovers:
        log.info("step_input_leftovers_removed", step=step.name, paths=list(map(str, leftovers)))
    for path in [path for path, _ in input_entries(inputs_dir, step.name)] + leftovers:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()


def write_input(step: Step, inputs_dir: Path, upstream: Path | None) -> Written:
    """Write the rows ``step`` sends, from its prompts, its dataset or the run
    directory ``upstream`` of the step it reads.

    Raises:
        InputError: A row of the dataset cannot be read, or the earlier step has no
            output.
        ConfigurationError: ``where`` names a column the rows lack, or ``preprocess``
            returned something other than a dict or None.
    """
    parts = _parts(step, upstream)
    first = next(parts)
    where = Where(step.where) if step.where is not None else None
    make_directory(inputs_dir)
    shape = _Shape(step, where)
    if first[0] is None:
        target = inputs_dir / f"{step.name}.jsonl"
        written = Written(target)
        with atomic_write(target) as file:
            shape.write(first[1], file, written)
            shape.check()
    else:
        target = inputs_dir / step.name
        written = Written(target)
        check_entry(target, directory=True)
        hidden = Path(tempfile.mkdtemp(prefix=f".{step.name}.", suffix=".tmp", dir=inputs_dir))
        try:
            for name, rows in _chain(first, parts):
                assert name is not None
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
                with os.fdopen(open_file(hidden / name, flags), "wb") as file:
                    shape.write(rows, file, written)
                    _durable(file)
            shape.check()
            fsync_directory(hidden)
            os.replace(hidden, target)
        except BaseException:
            shutil.rmtree(hidden, ignore_errors=True)
            raise
        fsync_directory(inputs_dir)
    log.info(
        "step_input_written",
        step=step.name,
        rows=written.rows,
        read=written.read,
        path=str(target),
    )
    return written


def stream_names(upstream: Path) -> tuple[str, ...] | None:
    """The files of a step that reads the corpus run ``upstream`` unit by unit: one a
    unit of it, named after the unit; None if ``upstream`` holds no corpus job yet."""
    record = read_corpus_record(upstream)
    if record is None:
        return None
    units = record["corpus"].get("units") or ()
    return tuple(str(unit).removesuffix(".parquet") + ".jsonl" for unit in units)


def unit_ready(upstream: Path, name: str) -> bool:
    """Whether the unit of ``upstream`` that the file ``name`` is written from is
    finished (see :func:`stream_names`)."""
    return unit_finished(upstream, name.removesuffix(".jsonl") + ".parquet")


def write_unit_input(step: Step, folder: Path, upstream: Path, name: str) -> Written:
    """Write the file ``name`` of a step that reads an earlier step unit by unit: the
    answered rows of that unit of the run ``upstream`` (none if the unit wrote no file),
    filtered and reshaped as a whole input is (:func:`write_input`), to a temporary
    renamed into ``folder`` whole. The workers that may race to write it write the same
    rows; the last rename wins.

    Raises:
        ConfigurationError: As for :func:`write_input` (a filter's column that the
            unit's rows lack, a hook that fails).
    """
    assert step.from_step is not None
    make_directory(folder)
    source = upstream / ANNOTATIONS_DIR / (name.removesuffix(".jsonl") + ".parquet")
    rows = _answered(source, step.from_step) if check_entry(source) else iter(())
    where = Where(step.where) if step.where is not None else None
    shape = _Shape(step, where)
    written = Written(folder / name)
    with atomic_write(folder / name) as file:
        shape.write(rows, file, written)
        if shape.unseen and shape.seen:
            _check_unit_filter(shape, upstream, step.from_step, name)
    log.info("step_unit_input_written", step=step.name, unit=name, rows=written.rows)
    return written


def _check_unit_filter(shape: _Shape, upstream: Path, source: str, name: str) -> None:
    """A unit's rows lack a column of the filter: refuse it as :func:`write_input`
    would (a typo, most likely) if no finished unit of the step it reads has it and
    that step is done; while it is not, or where another unit has it, the unit's rows
    read it as None (the units of a corpus may differ in their columns).

    Raises:
        ConfigurationError: No unit of the step it reads has the column.
    """
    records = read_unit_records(upstream)
    renamed = {column: f"{source}_{column}" for column in RENAMED}
    seen = {
        renamed.get(str(column[0]), str(column[0]))
        for record in records.values()
        for column in record.get("schema") or ()
        if isinstance(column, list) and column
    }
    if not shape.unseen - seen:
        return
    names = stream_names(upstream) or ()
    if len(records) >= len(names):
        shape.check()  # every unit of it is finished, and none has the column
    log.warning(
        "filter_column_not_seen_yet",
        step=shape.step.name,
        unit=name,
        columns=sorted(shape.unseen - seen),
        detail="no unit of the step it reads has it so far; its rows read it as None",
    )


class _Shape:
    """Turns the rows read into the rows sent: filter, hook, ``n`` copies."""

    def __init__(self, step: Step, where: Where | None) -> None:
        self.step = step
        self.where = where
        self.unseen = set(where.columns) if where is not None else set()
        """The filter's columns no row read so far has (some rows may lack one)."""
        self.seen: dict[str, None] = {}

    def write(self, rows: Iterable[dict[str, Any]], file: IO[bytes], written: Written) -> None:
        step, lines = self.step, []
        for row in rows:
            written.read += 1
            if self.unseen:
                self.unseen.difference_update(row)
                self.seen.update(dict.fromkeys(row))
            if self.where is not None and not self.where(row):
                continue
            if step.preprocess is not None:
                kept = self._preprocessed(row)
                if kept is None:
                    continue
                row = kept
            for out in _answers(row, step.n, step):
                written.rows += 1
                for key in out:
                    if key != ID and key not in written.columns:
                        written.columns[key] = None
                try:
                    lines.append(orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY))
                except TypeError as error:
                    raise ConfigurationError(
                        f"step {step.name}: row {out.get(ID)!r} cannot be written as JSON ({error})"
                    ) from None
            if len(lines) >= _BATCH:
                file.write(b"\n".join(lines) + b"\n")
                lines.clear()
        if lines:
            file.write(b"\n".join(lines) + b"\n")

    def check(self) -> None:
        """Refuse a filter on a column no row had (a typo, most likely), once every row
        is read: a column some rows lack is fine (it reads as None there)."""
        if self.where is None or not self.unseen or not self.seen:
            return
        have = ", ".join(name for name in self.seen if name != ID)
        raise ConfigurationError(
            f"step {self.step.name}: where {self.where.expression!r} names "
            f"{', '.join(map(repr, sorted(self.unseen)))}, which none of the rows it reads "
            f"has; they have {have}"
        )

    def _preprocessed(self, row: dict[str, Any]) -> dict[str, Any] | None:
        assert self.step.preprocess is not None
        row_id = row[ID]
        given = {key: value for key, value in row.items() if key != ID}
        try:
            out = self.step.preprocess(given)
        except Exception as error:  # the user's hook: say which row, keep nothing half-done
            raise ConfigurationError(
                f"step {self.step.name}: preprocess failed on row {row_id!r}: "
                f"{type(error).__name__}: {error}"
            ) from error
        if out is None:
            return None
        if not isinstance(out, dict):
            raise ConfigurationError(
                f"step {self.step.name}: preprocess must return a dict of columns or None "
                f"(leave the row out), got {type(out).__name__} for row {row_id!r}"
            )
        return {ID: row_id, **{key: value for key, value in out.items() if key != ID}}


def _answers(row: dict[str, Any], n: int, step: Step) -> Iterator[dict[str, Any]]:
    """The rows one row becomes: itself, or ``n`` rows ``"<id>:<index>"``."""
    if n == 1 and step.reads != "prompts":
        yield row
        return
    row_id = row[ID]
    rest = {key: value for key, value in row.items() if key != ID}
    for key in (PROMPT_ID, ANSWER_INDEX):  # earlier levels' ids stay, one input_ deeper
        chain = [key]
        while chain[-1] in rest:
            chain.append(f"input_{chain[-1]}")
        for older, newer in zip(reversed(chain[1:]), reversed(chain[:-1]), strict=True):
            rest[older] = rest.pop(newer)
    for index in range(n):
        yield {ID: f"{row_id}:{index}", **rest, PROMPT_ID: row_id, ANSWER_INDEX: index}


Part = tuple[str | None, Iterator[dict[str, Any]]]
"""A unit's file name (None for one input) and its rows, each with its ``id``."""


def _parts(step: Step, upstream: Path | None) -> Iterator[Part]:
    """The rows the step reads, in parts; at least one (maybe empty)."""
    if step.reads == "prompts":
        assert step.prompts is not None
        yield None, _generated(step.prompts, step.copies)
    elif step.reads == "step":
        assert upstream is not None and step.from_step is not None
        yield from _from_step(upstream, step.from_step)
    else:
        yield from _from_data(step)


def _generated(prompts: Iterable[str], copies: int) -> Iterator[dict[str, Any]]:
    """Each prompt ``copies`` times, numbered from 0."""
    number = 0
    for prompt in prompts:
        for _ in range(copies):
            yield {ID: number, "prompt": prompt}
            number += 1


def _from_step(run_dir: Path, name: str) -> Iterator[Part]:
    """The answered rows of an earlier step's output, its answer columns renamed."""
    try:
        files = list(RunDirectory.open(run_dir).output_files())
    except InputError:
        raise InputError(f"step {name} has no output in {run_dir}: run it first") from None
    if not files:
        yield None, iter(())
    for unit, path in files:
        yield (None if unit is None else unit + ".jsonl"), _answered(path, name)


def _answered(path: Path, name: str) -> Iterator[dict[str, Any]]:
    """The rows of one output file that have no error, reshaped for the next step."""
    renamed = {column: f"{name}_{column}" for column in RENAMED}
    parquet = pq.ParquetFile(path)
    for batch in parquet.iter_batches(batch_size=_BATCH):
        for record in batch.to_pylist():
            if record.get("error") is not None:
                continue
            yield {
                renamed.get(key, key): value for key, value in record.items() if key not in DROPPED
            }


def _from_data(step: Step) -> Iterator[Part]:
    """The dataset's rows, with their ids, as the job would read them."""
    if is_corpus(step.data):
        corpus = list_corpus(step.data, skip_bad_files=step.skip_bad_files)
        for unit in corpus.units:
            name = unit.output_name.removesuffix(".parquet") + ".jsonl"
            yield name, _with_ids(unit.read(step.id_column), step)
        if not corpus.units:
            yield None, iter(())
    else:
        yield None, _with_ids(open_input(step.data, id_column=step.id_column).rows(), step)


def _with_ids(rows: Iterator[Row], step: Step) -> Iterator[dict[str, Any]]:
    for row in rows:
        if row.error is not None:
            raise InputError(
                f"step {step.name}: {row.error}; a step with where, preprocess or n reads "
                "its rows before sending any: fix or remove the row"
            )
        values = dict(row.values)
        if ID in values and step.id_column != ID:
            values["input_id"] = values.pop(ID)
        elif step.id_column == ID:
            values.pop(ID)
        yield {ID: row.id, **values}


def _chain(first: Part, rest: Iterator[Part]) -> Iterator[Part]:
    yield first
    yield from rest


def _durable(file: IO[bytes]) -> None:
    file.flush()
    os.fsync(file.fileno())
