"""A corpus: many input files read as one job, unit by unit.

:func:`list_corpus` turns what a user names (a directory, a glob, several paths, or a
folder written by ``datasets.Dataset.save_to_disk``) into a :class:`Corpus`: its files
in a stable order, each with its identity (size and modification time), cut into
:class:`Unit` s, the pieces a job hands out. A unit is a file, or, for a Parquet file
larger than ``unit_bytes``, a run of its row groups, so that a few huge files still
split over many processes. Listing reads no rows: a directory is walked, each file is
looked at (``stat``), and only a Parquet file large enough to be cut has its footer
read.

Row identity in a corpus is ``(file, id)``: the file's name in the corpus (its path
relative to the corpus's root, with ``/``) and the row's id within it, the id column's
value or the row's position in the file (0-based, counting rows, not blank lines; a
Parquet file cut into units keeps its positions). Ids need not be unique across files,
only within one (checked as each unit is read); the output carries the file's name in
the column :data:`FILE_COLUMN`.
"""

from __future__ import annotations

import glob
import hashlib
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import structlog

from llm_annotator.errors import InputError
from llm_annotator.jobs.files import shown_path
from llm_annotator.jobs.ids import hash_id
from llm_annotator.jobs.rows.formats import file_format, formats_text
from llm_annotator.jobs.rows.formats.dataset import saved_files
from llm_annotator.jobs.rows.inputs import Row, RowSource, open_input

log = structlog.get_logger(__name__)

FILE_COLUMN = "input_file"
"""The output column of a corpus job that names each row's input file."""
UNIT_BYTES = 256 << 20
"""A Parquet file larger than this is cut into units of whole row groups of about this
size (at least one row group each); an uncompressed JSONL file, with an id column, into
byte ranges of this size (see :class:`Unit`)."""
_GLOB_MAGIC = frozenset("*?[")


@dataclass(frozen=True, slots=True)
class CorpusFile:
    """One file of a corpus.

    Attributes:
        name: Its path relative to the corpus's root, with ``/``: its name in the run.
        path: The path it is read from.
        size: Its size in bytes, when listed.
        mtime_ns: Its modification time, when listed.
    """

    name: str
    path: str
    size: int
    mtime_ns: int

    def identity(self) -> list[Any]:
        """What a run records of the file, to refuse it on resume if it changed."""
        return [self.name, self.size, self.mtime_ns]


@dataclass(frozen=True, slots=True)
class Unit:
    """The piece of a corpus one process takes at a time: a file, a run of a Parquet
    file's row groups, or a byte range of an uncompressed JSONL file.

    A byte range holds the lines that *begin* in it, as Hadoop and Spark split text
    files: its reader starts at the first line boundary at or after its start and reads
    on past its end to finish its last line, so the ranges of a file hold each line once,
    whatever their bounds, and each is read alone (about its own bytes).

    Attributes:
        index: Its place in the corpus's units.
        file: The file it is (part of).
        groups: For part of a Parquet file: its row groups (from, to: half-open).
        span: For part of a JSONL file: its bytes (from, to: half-open).
        first_row: The position in the file of its first row.
        rows: Its number of rows, where the file says so without being read.
        size: Its size in bytes (compressed, as stored).
    """

    index: int
    file: CorpusFile
    groups: tuple[int, int] | None = None
    first_row: int = 0
    rows: int | None = None
    size: int = 0
    span: tuple[int, int] | None = None

    @property
    def name(self) -> str:
        """The unit's name: the file's, and its row groups or bytes for part of a file.

        Examples:
            >>> f = CorpusFile("crawl/a.parquet", "/d/crawl/a.parquet", 10, 0)
            >>> Unit(0, f).name, Unit(1, f, (2, 4)).name
            ('crawl/a.parquet', 'crawl/a.parquet#rg2-3')
            >>> Unit(2, CorpusFile("b.jsonl", "b.jsonl", 9, 0), span=(4, 9)).name
            'b.jsonl#b4-8'
        """
        if self.span is not None:
            return f"{self.file.name}#b{self.span[0]}-{self.span[1] - 1}"
        if self.groups is None:
            return self.file.name
        return f"{self.file.name}#rg{self.groups[0]}-{self.groups[1] - 1}"

    @property
    def output_name(self) -> str:
        """The unit's file in the partitioned output: its name with ``%``, ``/`` and
        ``#`` escaped (one name per unit, never a folder), and ``.parquet`` added.

        Examples:
            >>> f = CorpusFile("crawl/a%b.jsonl.gz", "x", 10, 0)
            >>> Unit(0, f).output_name
            'crawl%2Fa%25b.jsonl.gz.parquet'
            >>> Unit(0, CorpusFile("_x.csv", "x", 1, 0)).output_name
            '%5Fx.csv.parquet'
        """
        text = self.name
        escaped = text.replace("%", "%25").replace("/", "%2F")
        if self.groups is not None or self.span is not None:  # the part's '#' is kept
            head, _, tail = escaped.rpartition("#")
            escaped = head.replace("#", "%23") + "#" + tail
        else:
            escaped = escaped.replace("#", "%23")
        if escaped[0] in "._":  # dataset readers skip names that begin so
            escaped = f"%{ord(escaped[0]):02X}{escaped[1:]}"
        return escaped + ".parquet"

    def source(self, id_column: str | None, *, peek: bool = True) -> RowSource:
        """A reader of the unit's file (``peek``: see :func:`open_input`)."""
        return open_input(self.file.path, id_column=id_column, peek=peek)

    @property
    def has_metadata(self) -> bool:
        """Whether the unit's file says its rows without being read (its reader's
        ``rows_up_front``: a Parquet footer, an Arrow file's batch headers)."""
        found = file_format(self.file.name)
        return found is not None and found[0].source_class().rows_up_front

    def known_rows(self, source: RowSource) -> int | None:
        """The unit's rows where its file (read by ``source``) says so without being
        read (a Parquet footer, an Arrow file's batch headers), else None (JSONL, CSV)."""
        if self.rows is not None:
            return self.rows
        return source._count() if self.has_metadata else None

    def read(self, id_column: str | None) -> Iterator[Row]:
        """The unit's rows, each marked with the unit's index.

        Raises:
            InputError: The file cannot be read (the message names it), or with an id
                column: a row has no valid id, or an id repeats within the unit.
        """
        source = self.source(id_column, peek=False)
        if self.span is not None:
            rows = source.span_rows(self.span, self.index)
        elif self.groups is not None:
            rows = source.group_rows(self.groups, self.first_row, self.index)
        else:
            rows = source.rows(unit=self.index)
        if id_column is None:
            yield from rows
            return
        seen: dict[int, str] = {}
        for row in rows:
            key = hash_id(row.id)
            earlier = seen.get(key)
            if earlier is None:
                seen[key] = row.where
            else:
                raise InputError(
                    f"{self.file.name}: the id {row.id!r} (field {id_column!r}) appears more "
                    f"than once in the file: at {earlier} and at {row.where}; ids must be "
                    "unique within a file: fix the input, or pass id_column=None to number "
                    "the rows by position"
                )
            yield row


@dataclass(frozen=True, slots=True)
class Corpus:
    """The files of a corpus and their units.

    Attributes:
        description: What the user named, for messages.
        root: The folder the files' names are relative to.
        files: The files, sorted by name.
        units: The units, in the files' order.
        skipped: Files left out (``skip_bad_files``), each with why: ``(name, reason)``.
        unit_bytes: The size above which a Parquet file was cut into parts.
        split_lines: Whether an uncompressed JSONL file above ``unit_bytes`` was cut
            into byte ranges.
    """

    description: str
    root: str
    files: tuple[CorpusFile, ...]
    units: tuple[Unit, ...]
    skipped: tuple[tuple[str, str], ...] = ()
    unit_bytes: int = UNIT_BYTES
    split_lines: bool = False
    size: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", sum(unit.size for unit in self.units))

    def listing(self) -> dict[str, Any]:
        """What a run records of the corpus (``corpus.json``)."""
        return {
            "root": self.root,
            "unit_bytes": self.unit_bytes,
            "split_lines": self.split_lines,
            "files": [f.identity() for f in self.files],
            "skipped": [list(s) for s in self.skipped],
            "units": [unit.output_name for unit in self.units],
        }

    def digest(self) -> str:
        """A digest of the files (names, sizes, times) and how they are cut."""
        head: list[Any] = [self.unit_bytes, "lines"] if self.split_lines else [self.unit_bytes]
        data = orjson.dumps([*head, [f.identity() for f in self.files]])
        return hashlib.blake2b(data, digest_size=16).hexdigest()

    def changes_since(self, recorded: Mapping[str, Any]) -> list[str]:
        """The files that differ from a listing a run recorded, each in words.

        Examples:
            >>> a = CorpusFile("a.jsonl", "a.jsonl", 10, 1)
            >>> corpus = Corpus("d", "d", (a,), (Unit(0, a),))
            >>> recorded = corpus.listing()
            >>> corpus.changes_since(recorded)
            []
            >>> b = CorpusFile("a.jsonl", "a.jsonl", 12, 2)
            >>> Corpus("d", "d", (b,), (Unit(0, b),)).changes_since(recorded)
            ['a.jsonl changed (10 -> 12 bytes)']
        """
        before = {str(f[0]): f for f in recorded.get("files", ()) if isinstance(f, list) and f}
        now = {f.name: f.identity() for f in self.files}
        changes = []
        for name, identity in now.items():
            old = before.get(name)
            if old is None:
                changes.append(f"{name} is new")
            elif old[1:] != identity[1:]:
                sizes = f"{old[1]} -> {identity[1]} bytes" if old[1] != identity[1] else "modified"
                changes.append(f"{name} changed ({sizes})")
        changes += [f"{name} is gone" for name in before if name not in now]
        return changes


@dataclass(frozen=True, slots=True)
class UnitFeed:
    """A corpus for workers that take its units by claims and have other work to go to
    (the steps of a pipeline): a worker's job over it ends as soon as it can take no
    unit now, rather than waiting for the units that others hold, and its files may be
    written as the work they come from is done (a step that reads an earlier step's
    units as they finish: step 2 runs while step 1 is still answering).

    Attributes:
        data: The corpus to list (a path, a glob, several paths; see
            :func:`list_corpus`), or None for the files named by ``folder`` and ``names``.
        folder: The folder of files written as they become ready.
        names: Their names in ``folder``, in order, known before any is written. A
            file's identity is its name alone: it is written once, whole.
        ready: Whether the file ``name`` can be written now.
        write: Write the file ``name`` into ``folder`` (whole, renamed into place): the
            worker that claims its unit does, before reading it, if it is not there.
        wait: Wait for units that other workers hold, as a corpus job does, rather than
            leave (the last step: there is nothing else to go to). A worker still leaves
            when a unit left is not ready.
        turn: Seconds after which the worker claims no new unit (it goes on to other
            work and comes back), or None: as long as there are units to take.
        owner: The worker's name in its claims, the same each time its jobs come back to
            this corpus (None: a new one each job).
        fleet: The folder where the workers that send to the same servers count each
            other (:mod:`~llm_annotator.jobs.rundir.fleet`), when they are those of
            several jobs (a pipeline's steps); None: the run directory's.
        description: What the corpus is, for messages.
    """

    data: Any = None
    folder: Path | None = None
    names: tuple[str, ...] = ()
    ready: Callable[[str], bool] | None = None
    write: Callable[[str], None] | None = None
    wait: bool = False
    turn: float | None = None
    owner: str | None = None
    fleet: Path | None = None
    description: str = ""

    @property
    def growing(self) -> bool:
        """Whether its files are written as they become ready (no ``data``)."""
        return self.data is None

    def listed(self) -> Corpus:
        """The corpus of a growing feed, each file a unit, listed before any exists.

        Examples:
            >>> feed = UnitFeed(folder=Path("in/b"), names=("u1.jsonl", "u2.jsonl"))
            >>> [(unit.name, unit.file.identity()) for unit in feed.listed().units]
            [('u1.jsonl', ['u1.jsonl', 0, 0]), ('u2.jsonl', ['u2.jsonl', 0, 0])]
        """
        assert self.folder is not None
        files = tuple(CorpusFile(name, str(self.folder / name), 0, 0) for name in self.names)
        units = tuple(Unit(index, file) for index, file in enumerate(files))
        shown = self.description or shown_path(str(self.folder))
        return Corpus(shown, str(self.folder), files, units)

    def is_ready(self, unit: Unit) -> bool:
        """Whether ``unit`` can be read now (always, for a listed corpus)."""
        return self.ready is None or self.ready(unit.file.name)

    def make(self, unit: Unit) -> None:
        """Write ``unit``'s file if it is not there yet (a growing feed's)."""
        if self.write is not None and not os.path.exists(unit.file.path):
            self.write(unit.file.name)


def is_corpus(data: Any) -> bool:
    """Whether ``data`` names a corpus rather than one input: a directory, a glob, or
    a list of paths.

    Examples:
        >>> is_corpus(["a.jsonl", "b.jsonl"]), is_corpus([{"text": "x"}]), is_corpus("*.csv")
        (True, False, True)
    """
    if isinstance(data, UnitFeed):
        return True
    if isinstance(data, str | os.PathLike):
        path = os.fspath(data)
        if os.path.isdir(path):
            return True
        return not os.path.exists(path) and bool(_GLOB_MAGIC & set(path))
    if isinstance(data, list | tuple) and data:
        return all(isinstance(item, str | os.PathLike) for item in data)
    return False


def list_corpus(
    data: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    skip_bad_files: bool = False,
    unit_bytes: int = UNIT_BYTES,
    split_lines: bool = False,
) -> Corpus:
    """The corpus that ``data`` names, listed and cut into units; no row is read.

    Args:
        data: A directory (every supported file under it, at any depth, in sorted order;
            names beginning with ``.`` or ``_`` are skipped, as data lakes mark their own
            files), a glob (``"crawl/*.parquet"``, ``**`` for any depth), a folder
            written by ``datasets.Dataset.save_to_disk`` (its Arrow files, in their
            order), or a list of any of these and of files.
        skip_bad_files: Leave out, with the reason, a file that cannot be read or is
            of no known format, instead of refusing the corpus.
        unit_bytes: Cut a Parquet file larger than this into parts of whole row groups.
        split_lines: Also cut an uncompressed JSONL file larger than ``unit_bytes`` into
            byte ranges of that size, each read alone. Only for rows with an id column:
            a range does not know the positions of its rows without reading the ranges
            before it.

    Raises:
        InputError: A path is missing or matches nothing, a named file is unreadable or
            of no known format (without ``skip_bad_files``), a file is named twice, or
            the corpus holds no file at all.

    Examples:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> for name in ("b.jsonl", "a.jsonl", "notes.md"):
        ...     _ = (folder / name).write_text('{"text": "x"}\\n')
        >>> [unit.name for unit in list_corpus(folder).units]
        ['a.jsonl', 'b.jsonl']
    """
    items = [data] if isinstance(data, str | os.PathLike) else list(data)
    if not items:
        raise InputError("the corpus names no path: give a directory, a glob or files")
    found: list[tuple[str, os.stat_result]] = []
    skipped: list[tuple[str, str]] = []
    for item in items:
        if not isinstance(item, str | os.PathLike):
            raise InputError(f"a corpus is a list of paths; {item!r} is not one")
        path = os.fspath(item)
        try:
            info = os.stat(path)
        except FileNotFoundError:
            if not _GLOB_MAGIC & set(path):
                raise InputError(f"{shown_path(path)}: no such file or directory") from None
            matches = sorted(glob.glob(path, recursive=True))
            matched = [m for m in matches if not os.path.isdir(m)]
            if not matched:
                raise InputError(f"{shown_path(path)} matches no file") from None
            for match in matched:
                _add(match, found, skipped, skip_bad_files)
            continue
        except OSError as error:
            raise InputError(f"cannot read {shown_path(path)}: {error.strerror}") from None
        if stat.S_ISDIR(info.st_mode):
            _walk(path, found, skipped, skip_bad_files)
        else:
            _add(path, found, skipped, skip_bad_files)
    if not found:
        what = ", ".join(shown_path(os.fspath(i)) for i in items[:3])
        raise InputError(
            f"{what}: no input file in the corpus; supported: {formats_text(every_suffix=True)}"
        )
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p, _ in found])
    files: list[CorpusFile] = []
    places: dict[tuple[int, int], str] = {}
    for path, info in found:
        name = Path(os.path.relpath(os.path.abspath(path), root)).as_posix()
        place = (info.st_dev, info.st_ino)
        if place in places:
            raise InputError(
                f"{shown_path(name)} and {shown_path(places[place])} are one file named "
                "twice: name it once (its rows would be annotated twice)"
            )
        places[place] = name
        files.append(CorpusFile(name, path, info.st_size, info.st_mtime_ns))
    files.sort(key=lambda f: f.name)
    units = _units(files, unit_bytes, skipped, skip_bad_files, split_lines=split_lines)
    description = shown_path(os.fspath(items[0])) if len(items) == 1 else f"{len(items)} paths"
    return Corpus(
        description, root, tuple(files), tuple(units), tuple(skipped), unit_bytes, split_lines
    )


def _walk(
    folder: str,
    found: list[tuple[str, os.stat_result]],
    skipped: list[tuple[str, str]],
    skip_bad: bool,
) -> None:
    """Add a folder's supported files (the others are not data: notes, markers)."""
    saved = saved_files(folder)
    if saved is not None:
        for path in saved:
            _add(path, found, skipped, skip_bad)
        return
    for top, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        for name in sorted(names):
            if name.startswith((".", "_")):
                continue
            if file_format(name) is not None:
                _add(os.path.join(top, name), found, skipped, skip_bad)


def _add(
    path: str,
    found: list[tuple[str, os.stat_result]],
    skipped: list[tuple[str, str]],
    skip_bad: bool,
) -> None:
    """Add one file, or say why it cannot be (refused, or skipped with ``skip_bad``)."""
    problem = None
    try:
        info = os.stat(path)
    except OSError as error:
        problem = f"cannot read it: {error.strerror}"
    else:
        if not stat.S_ISREG(info.st_mode):
            problem = "not a regular file (a pipe or a device cannot be read twice)"
        elif file_format(path) is None:
            problem = f"of no known format; supported: {formats_text(every_suffix=True)}"
        elif not os.access(path, os.R_OK):
            problem = "cannot read it: permission denied"
    if problem is None:
        found.append((path, info))
        return
    if not skip_bad:
        raise InputError(
            f"{shown_path(path)}: {problem}; fix or remove it, or pass --skip-bad-files "
            "(skip_bad_files=True) to leave it out and list it in the run's manifest"
        )
    log.warning("input_file_skipped", file=shown_path(path), reason=problem)
    skipped.append((shown_path(path), problem))


def _units(
    files: list[CorpusFile],
    unit_bytes: int,
    skipped: list[tuple[str, str]],
    skip_bad: bool,
    *,
    split_lines: bool = False,
) -> list[Unit]:
    """The files cut into units, by their format's ``split``: a file larger than
    ``unit_bytes`` with more than one row group (Parquet) into runs of row groups, with
    ``split_lines`` an uncompressed file of lines (JSONL) larger than ``unit_bytes`` into
    byte ranges, every other file whole."""
    units: list[Unit] = []
    kept = []
    for file in files:
        found = file_format(file.name)
        # a compressed file is read whole: its bytes cannot be read from any place
        split = found[0].split if found is not None and found[1] is None else None
        if split_lines and file.size > unit_bytes and split == "bytes":
            kept.append(file)
            for span in byte_spans(file.size, unit_bytes):
                units.append(Unit(len(units), file, size=span[1] - span[0], span=span))
            continue
        if file.size <= unit_bytes or split != "row groups" or found is None:
            units.append(Unit(len(units), file, size=file.size))
            kept.append(file)
            continue
        try:
            parts = found[0].source_class().group_runs(file.path, file.size, unit_bytes)
        except InputError as error:
            if not skip_bad:
                raise
            skipped.append((file.name, str(error)))
            continue
        kept.append(file)
        for groups, first, rows, size in parts:
            units.append(Unit(len(units), file, groups, first, rows, size))
    files[:] = kept
    return units


def byte_spans(size: int, unit_bytes: int) -> list[tuple[int, int]]:
    """A file of ``size`` bytes cut into ranges of ``unit_bytes`` (the last shorter).

    Examples:
        >>> byte_spans(10, 4), byte_spans(8, 4), byte_spans(3, 4)
        ([(0, 4), (4, 8), (8, 10)], [(0, 4), (4, 8)], [(0, 3)])
    """
    return [(start, min(start + unit_bytes, size)) for start in range(0, max(size, 1), unit_bytes)]
