"""Input rows, streamed, from a file or from memory, in any of the input formats
(:data:`~llm_annotator.jobs.rows.formats.FORMATS`).

:func:`open_input` picks a reader; the :class:`RowSource` it returns streams
:class:`Row` objects without holding the input in memory, however many rows it has.
A row's id is its position (0-based, counting rows, not blank lines) or the value of
the id column. :meth:`RowSource.scan` makes one cheap pass first: it counts the rows
and, with an id column, checks that every id is there, an int or a str, and unique.

One of several processes that split an input by the hash of its ids (a shard) calls
:meth:`RowSource.select` instead: the same pass also marks the rows whose id hashes to
it, in a :class:`Selection` (a bit a row), and :meth:`RowSource.rows` then skips the
other rows before decoding them: a JSONL line is not parsed, a Parquet batch is turned
into Python objects for the selected rows only.

The readers, one module per format, are in :mod:`llm_annotator.jobs.rows.formats`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from llm_annotator.errors import InputError
from llm_annotator.jobs.files import open_input_file, shown_path
from llm_annotator.jobs.rows.formats import FORMATS, file_format, formats_text
from llm_annotator.jobs.rows.formats.base import (
    NO_ID,
    PARQUET_BATCH_ROWS,
    InputIdentity,
    Row,
    RowSource,
    Selection,
)
from llm_annotator.jobs.rows.formats.compression import COMPRESSIONS, compression_of

__all__ = [
    "ARROW_SUFFIXES",
    "COMPRESSIONS",
    "CSV_SUFFIXES",
    "JSONL_SUFFIXES",
    "PARQUET_BATCH_ROWS",
    "PARQUET_SUFFIXES",
    "InputIdentity",
    "Row",
    "RowSource",
    "Selection",
    "open_input",
]


def _suffixes(name: str) -> tuple[str, ...]:
    return next(kind.suffixes for kind in FORMATS if kind.name == name)


JSONL_SUFFIXES = _suffixes("JSONL")
CSV_SUFFIXES = _suffixes("CSV")
PARQUET_SUFFIXES = _suffixes("Parquet")
ARROW_SUFFIXES = _suffixes("Arrow")
"""Arrow IPC files (stream or file format), as ``datasets.Dataset.save_to_disk`` writes."""


def open_input(
    data: str | os.PathLike[str] | Sequence[Mapping[str, Any]] | Any,
    *,
    id_column: str | None = None,
    peek: bool = True,
) -> RowSource:
    """A streaming reader for ``data``.

    Args:
        data: A path to a file of one of the :data:`~llm_annotator.jobs.rows.formats.FORMATS`,
            known by its suffix (``.jsonl``, ``.csv``, ``.parquet``, ...; a JSONL or CSV
            file may be compressed: ``data.jsonl.gz``, ``data.csv.zst``); or rows in
            memory: a list of dicts, a ``datasets.Dataset`` (anything with
            ``column_names`` and ``__len__`` that iterates as dicts) or a
            ``pyarrow.Table``. CSV values are strings.
        id_column: The column holding each row's id; None numbers rows by position.
        peek: Read a JSONL file's first row now, for its columns (and to refuse a file
            that cannot be read at once); False reads nothing before the rows
            (``columns`` is then None), as a corpus's unit does.

    Returns:
        The rows' source; call :meth:`RowSource.scan` before using the rows.

    Raises:
        InputError: The file is missing, unreadable or of an unknown kind, the input is
            of an unsupported type, or ``id_column`` is not among known columns.

    Examples:
        >>> source = open_input([{"id": "a", "text": "good"}, {"id": "b", "text": "bad"}],
        ...                     id_column="id")
        >>> source.scan()
        2
        >>> [(row.id, row.where) for row in source]
        [('a', 'list item 0'), ('b', 'list item 1')]
    """
    if id_column is not None and not isinstance(id_column, str):
        raise InputError(f"id_column must be a column name (a str), not {id_column!r}")
    if isinstance(data, str | os.PathLike):
        source = _open_file(os.fspath(data), id_column, peek)
    else:
        readers = (kind.source_class() for kind in FORMATS if not kind.suffixes)
        reader = next((reader for reader in readers if reader.holds(data)), None)
        if reader is None:
            raise InputError(
                f"cannot read input of type {type(data).__name__}: pass a path to "
                f"{formats_text(in_memory=True)} (for a pandas DataFrame: "
                "df.to_dict('records'), or df.to_parquet(path) first)"
            )
        source = reader(data, id_column)
    known = type(source).columns_up_front
    if known and id_column is not None and id_column not in (source.columns or ()):
        raise InputError(
            f"{source.description} has no column {id_column!r} (id_column); its columns: "
            f"{', '.join(source.columns or ()) or '(none)'}; name one of them, or {NO_ID}"
        )
    return source


def _open_file(path: str, id_column: str | None, peek: bool = True) -> RowSource:
    found = file_format(path)
    if found is None:
        compressed = compression_of(path)
        inside = file_format(path[: -len(compressed)]) if compressed is not None else None
        hint = " (a .json file: write one JSON object per line and name it .jsonl)" * (
            path.lower().removesuffix(compressed or "").endswith(".json")
        ) or (
            f" ({inside[0].name} compresses inside the file: give it uncompressed)"
            if inside is not None
            else ""
        )
        raise InputError(
            f"{shown_path(path)}: unknown input format{hint}; use {formats_text(every_suffix=True)}"
        )
    kind, compressed = found
    open_input_file(path).close()  # a regular file, readable: refused now otherwise
    return kind.source_class()(path, id_column, compressed=compressed, peek=peek)
