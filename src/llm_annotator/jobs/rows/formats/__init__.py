"""The input formats: one module each, and the one table of them, :data:`FORMATS`.

Each format's module holds its reader, a :class:`~.base.RowSource`; the table says, for
each, its name, its suffixes, whether a file may be compressed, how a corpus cuts a
large file, and which reader reads it. :func:`~llm_annotator.jobs.rows.inputs.open_input`
picks a reader from it, a corpus lists its files by it, and every message that lists
the formats is made from it (:func:`formats_text`). Adding a format takes a module here
and a line in :data:`FORMATS`.

The table names each reader by its module and class, imported on first use: reading
the table (for a command's help, say) loads no Arrow or NumPy.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

from llm_annotator.jobs.rows.formats.compression import COMPRESSIONS, compression_of

if TYPE_CHECKING:
    from llm_annotator.jobs.rows.formats.base import RowSource

Split = Literal["bytes", "row groups"]
"""How a corpus cuts a file larger than its unit size: into byte ranges (an uncompressed
file of lines, each range read alone) or into runs of row groups."""


@dataclass(frozen=True, slots=True)
class Format:
    """One input format, a line of :data:`FORMATS`.

    Attributes:
        name: What messages call it: the format's name (``"JSONL"``), or for objects
            in memory what they are (``"a list of dicts"``).
        suffixes: A file's suffixes, in lower case, the usual one first; none for
            objects in memory (their reader's ``holds`` recognises them).
        reader: Its reader, a :class:`~.base.RowSource`: ``module.Class`` in this package.
        compressible: Whether a file may be compressed (one of :data:`COMPRESSIONS`
            after its suffix, ``data.jsonl.gz``), then read as a stream.
        split: How a corpus cuts a large file (see :data:`Split`), or None: whole.

    Examples:
        >>> parquet = Format("Parquet", (".parquet", ".pq"), "parquet.ParquetSource")
        >>> parquet.source_class().__name__, parquet.source_class().rows_up_front
        ('ParquetSource', True)
        >>> Format("Text", ("txt",), "text.TextSource")
        Traceback (most recent call last):
        ...
        ValueError: Text: a suffix is lower case and begins with '.', not 'txt'
    """

    name: str
    suffixes: tuple[str, ...]
    reader: str
    compressible: bool = False
    split: Split | None = None

    def __post_init__(self) -> None:
        for suffix in self.suffixes:
            if not suffix.startswith(".") or suffix != suffix.lower():
                raise ValueError(
                    f"{self.name}: a suffix is lower case and begins with '.', not {suffix!r}"
                )
        if not self.suffixes and (self.compressible or self.split is not None):
            raise ValueError(f"{self.name}: only a file format is compressed or split")

    def source_class(self) -> type[RowSource]:
        """The reader's class (its module imported now if it was not yet)."""
        module, _, name = self.reader.rpartition(".")
        found = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        return cast("type[RowSource]", found)


FORMATS: tuple[Format, ...] = (
    Format("JSONL", (".jsonl", ".ndjson", ".jsonlines"), "jsonl.JsonlSource", True, "bytes"),
    Format("CSV", (".csv",), "csv.CsvSource", True),
    Format("Parquet", (".parquet", ".pq"), "parquet.ParquetSource", split="row groups"),
    Format("Arrow", (".arrow",), "arrow.ArrowSource"),
    Format("a datasets.Dataset (or a pyarrow.Table)", (), "dataset.DatasetSource"),
    Format("a list of dicts", (), "memory.ListSource"),
)
"""Every input format, files first; objects in memory are tried in this order."""


def file_format(name: str) -> tuple[Format, str | None] | None:
    """A file's format by its name, and its compression (None for none), or None when
    it is of no known format (a compressed file of a format that is not compressed
    included).

    Examples:
        >>> found = file_format("crawl/Part-1.JSONL.zst")
        >>> found[0].name, found[1]
        ('JSONL', '.zst')
        >>> file_format("a.parquet.gz"), file_format("notes.md")
        (None, None)
    """
    compressed = compression_of(name)
    lower = name.lower()
    base = lower[: -len(compressed)] if compressed is not None else lower
    for kind in FORMATS:
        if kind.suffixes and base.endswith(kind.suffixes):
            return (kind, compressed) if compressed is None or kind.compressible else None
    return None


def formats_text(*, every_suffix: bool = False, in_memory: bool = False) -> str:
    """The formats in words, for messages and help, made from :data:`FORMATS`.

    Args:
        every_suffix: Name each file format's other suffixes too.
        in_memory: Name the objects in memory that are read too.

    Examples:
        >>> print(formats_text())
        a .jsonl, .csv, .parquet or .arrow file (JSONL and CSV may be compressed: .gz,
        .zst, .bz2, .xz)
        >>> print(formats_text(every_suffix=True, in_memory=True))
        a .jsonl/.ndjson/.jsonlines, .csv, .parquet/.pq or .arrow file (JSONL and CSV may
        be compressed: .gz, .zst, .bz2, .xz), a datasets.Dataset (or a pyarrow.Table) or a
        list of dicts
    """
    files = [kind for kind in FORMATS if kind.suffixes]
    suffixes = ["/".join(kind.suffixes) if every_suffix else kind.suffixes[0] for kind in files]
    text = f"a {_listed(suffixes, 'or')} file"
    compressible = [kind.name for kind in files if kind.compressible]
    if compressible:
        text += f" ({_listed(compressible, 'and')} may be compressed: {', '.join(COMPRESSIONS)})"
    if not in_memory:
        return text
    return _listed([text, *(kind.name for kind in FORMATS if not kind.suffixes)], "or")


def _listed(items: list[str], last: str) -> str:
    """``a, b or c`` (``last`` the word before the last item)."""
    return items[0] if len(items) < 2 else f"{', '.join(items[:-1])} {last} {items[-1]}"
