"""The table of input formats: every format it names is read, listed and said."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from llm_annotator.cli.main import main
from llm_annotator.errors import InputError
from llm_annotator.jobs.rows.corpus import list_corpus
from llm_annotator.jobs.rows.formats import FORMATS, Format, file_format, formats_text
from llm_annotator.jobs.rows.formats.base import RowSource
from llm_annotator.jobs.rows.formats.compression import COMPRESSIONS
from llm_annotator.jobs.rows.inputs import open_input

ROWS = [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}]


def _table() -> pa.Table:
    return pa.table({"id": [row["id"] for row in ROWS], "text": [row["text"] for row in ROWS]})


def _arrow() -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, _table().schema) as writer:
        writer.write_table(_table())
    return sink.getvalue()


def _parquet() -> bytes:
    sink = io.BytesIO()
    pq.write_table(_table(), sink)
    return sink.getvalue()


FILES: dict[str, Callable[[], bytes]] = {
    "JSONL": lambda: b'{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n',
    "CSV": lambda: b"id,text\na,x\nb,y\n",
    "Parquet": _parquet,
    "Arrow": _arrow,
}
"""A file of ROWS in each file format, by its name in the table."""
IN_MEMORY: dict[str, Callable[[], Any]] = {
    "a datasets.Dataset (or a pyarrow.Table)": _table,
    "a list of dicts": lambda: [dict(row) for row in ROWS],
}
"""ROWS as each format in memory holds them."""
COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    ".gz": gzip.compress,
    ".zst": zstandard.ZstdCompressor().compress,
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
}


def _file_names() -> list[tuple[Format, str]]:
    """Every name a file of the table may have: each suffix, compressed or not."""
    names = []
    for kind in FORMATS:
        for suffix in kind.suffixes:
            names.append((kind, f"data{suffix}"))
            if kind.compressible:
                names += [(kind, f"data{suffix}{c}") for c in COMPRESSIONS]
    return names


def _written(folder: Path, kind: Format, name: str) -> Path:
    assert kind.name in FILES, f"a new format, {kind.name}: add a sample file of it to FILES"
    data = FILES[kind.name]()
    for compression in COMPRESSIONS:
        if name.endswith(compression):
            data = COMPRESS[compression](data)
    path = folder / name
    path.write_bytes(data)
    return path


def _plain(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(("kind", "name"), _file_names(), ids=[n for _, n in _file_names()])
def test_every_suffix_of_the_table_is_read_by_open_input(
    tmp_path: Path, kind: Format, name: str
) -> None:
    """A file of each suffix (and compression, where the format allows one) is read by
    the format's reader, with its rows and ids."""
    path = _written(tmp_path, kind, name)
    assert file_format(name) is not None
    source = open_input(path, id_column="id")
    assert isinstance(source, kind.source_class())
    assert source.scan() == 2
    assert [(row.id, row.values["text"]) for row in source] == [("a", "x"), ("b", "y")]


def test_every_suffix_of_the_table_is_listed_in_a_corpus(tmp_path: Path) -> None:
    """A folder holding a file of every suffix lists them all, and each unit reads."""
    names = sorted(name for _, name in _file_names())
    for kind, name in _file_names():
        _written(tmp_path, kind, name)
    corpus = list_corpus(tmp_path)
    assert [file.name for file in corpus.files] == names
    assert all(len(list(unit.read("id"))) == 2 for unit in corpus.units)


def test_every_format_in_memory_is_read_by_open_input() -> None:
    """Each format in memory recognises its objects, and open_input reads them."""
    for kind in FORMATS:
        if kind.suffixes:
            continue
        assert kind.name in IN_MEMORY, f"a new format, {kind.name}: add a sample to IN_MEMORY"
        data = IN_MEMORY[kind.name]()
        assert kind.source_class().holds(data)
        source = open_input(data, id_column="id")
        assert isinstance(source, kind.source_class())
        assert [row.id for row in source] == ["a", "b"]


def test_every_reader_is_a_row_source() -> None:
    """Each line of the table names a reader class, and the names are unique."""
    assert all(issubclass(kind.source_class(), RowSource) for kind in FORMATS)
    assert len({kind.name for kind in FORMATS}) == len(FORMATS)
    suffixes = [suffix for kind in FORMATS for suffix in kind.suffixes]
    assert len(set(suffixes)) == len(suffixes)


def _messages(tmp_path: Path) -> dict[str, str]:
    """Every message that lists the formats, as a user sees it."""
    said: dict[str, str] = {}
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError) as unknown:
        open_input(tmp_path / "notes.txt")
    said["unknown file"] = str(unknown.value)
    with pytest.raises(InputError) as wrong_type:
        open_input(5)
    said["wrong type"] = str(wrong_type.value)
    with pytest.raises(InputError) as no_format:
        list_corpus([tmp_path / "notes.txt"])
    said["corpus file"] = str(no_format.value)
    (empty := tmp_path / "empty").mkdir()
    with pytest.raises(InputError) as nothing:
        list_corpus(empty)
    said["empty corpus"] = str(nothing.value)
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
        main(["run", "--help"])
    said["run --help"] = help_text.getvalue()
    return said


def test_every_message_that_lists_the_formats_names_every_one(tmp_path: Path) -> None:
    """The messages are made from the table (the help says what formats_text says): a
    format added to the table is named in each, with the formats that may be
    compressed and the compressions."""
    said = {name: _plain(text) for name, text in _messages(tmp_path).items()}
    assert formats_text() in said["run --help"]
    for name, text in said.items():
        for kind in FORMATS:
            if kind.suffixes:
                assert re.search(rf"{re.escape(kind.suffixes[0])}\b", text), (name, kind.name)
            elif name == "wrong type":
                assert kind.name in text, (name, kind.name)
        compressible = [kind.name for kind in FORMATS if kind.compressible]
        assert all(kind in text for kind in compressible), name
        assert all(compression in text for compression in COMPRESSIONS), name
    for name in ("unknown file", "corpus file", "empty corpus"):
        assert all(s in said[name] for kind in FORMATS for s in kind.suffixes), name
