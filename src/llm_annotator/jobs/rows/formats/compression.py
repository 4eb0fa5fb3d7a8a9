"""Compressed input files, read as a stream, never whole.

A file's compression is its last suffix (``data.jsonl.zst``), one of
:data:`COMPRESSIONS`; :func:`decompressed` opens the file and gives its content.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import sys
import zlib
from collections.abc import Iterator
from typing import IO, Any, cast

from llm_annotator.jobs.files import open_input_file

COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")
"""The compressions an input file may have, by suffix (``data.jsonl.zst``): gzip,
Zstandard (the ``zstandard`` package), bzip2 and xz; read as a stream, never whole."""

_READ = 1 << 17
"""Bytes of a compressed input read from the file at a time."""
_ZSTD_FEED = 1 << 12
"""Bytes of a ``.zst`` input decompressed at a time: zstd's decompressor takes no bound
on its output, so a small input bounds it (text expands ~5-10x; the worst case, a
run of one byte, about 32,000x: 128 MiB)."""
_ZSTD_WINDOW = 1 << 31
"""The largest window a ``.zst`` frame may need (``zstd --long`` writes up to 2 GiB)."""


def compression_of(name: str) -> str | None:
    """A file's compression by its name: one of :data:`COMPRESSIONS`, or None.

    Examples:
        >>> compression_of("crawl/A.JSONL.ZST"), compression_of("a.jsonl")
        ('.zst', None)
    """
    lower = name.lower()
    return next((suffix for suffix in COMPRESSIONS if lower.endswith(suffix)), None)


@contextlib.contextmanager
def decompressed(path: str, compressed: str | None) -> Iterator[IO[bytes]]:
    """An input file's bytes, decompressed by its suffix ``compressed`` (one of
    :data:`COMPRESSIONS`, or None for the file as it is; see :func:`open_input_file`).

    Examples:
        >>> import gzip, tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "a.jsonl.gz"
        >>> _ = path.write_bytes(gzip.compress(b'{"t": 1}\\n'))
        >>> with decompressed(str(path), ".gz") as file:
        ...     file.read()
        b'{"t": 1}\\n'
    """
    with open_input_file(path) as raw:
        if compressed is None:
            yield raw
        elif compressed == ".gz":
            with gzip.GzipFile(fileobj=raw, mode="rb") as file:
                yield cast(IO[bytes], file)
        else:
            with io.BufferedReader(_Streams(raw, compressed), _READ) as file:
                yield cast(IO[bytes], file)


def unreadable(*also: type[BaseException]) -> tuple[type[BaseException], ...]:
    """What reading a damaged or cut-off input raises: :class:`OSError` (gzip, bz2),
    :class:`EOFError` (a stream that ends early), zlib's, LZMA's and zstd's own errors,
    and ``also``."""
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error, lzma.LZMAError, *also]
    zstandard = sys.modules.get("zstandard")
    if zstandard is not None:
        errors.append(zstandard.ZstdError)
    return tuple(errors)


class _Streams(io.RawIOBase):
    """A bzip2, xz or zstd file's content, one or more streams (frames) in a row as
    ``pbzip2``, ``pixz`` or ``pzstd`` write them, decompressed a bounded piece at a time.

    Stricter than the standard library's readers, which stop quietly at a damaged
    second stream (and the ``zstandard`` package's, which stops quietly at a cut): a
    file that ends inside a stream raises :class:`EOFError`, and anything after a stream
    that is not another one raises the decompressor's error. Either way no row is lost
    without a word.
    """

    def __init__(self, raw: IO[bytes], compressed: str) -> None:
        self._raw = raw
        self._new: Any
        if compressed == ".bz2":
            self._new = bz2.BZ2Decompressor
        elif compressed == ".xz":
            self._new = lzma.LZMADecompressor
        else:
            import zstandard  # only for .zst inputs

            self._new = zstandard.ZstdDecompressor(max_window_size=_ZSTD_WINDOW).decompressobj
        self._zstd = compressed == ".zst"
        self._unit = self._new()
        self._fed = False
        """Whether the current stream was given any input (a file may end only between
        streams)."""
        self._input = memoryview(b"")
        """Input read from the file and not yet given to a decompressor."""
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, target: Any) -> int:
        while not self._out:
            if self._unit.eof:  # the next stream begins with what this one left
                self._input = memoryview(self._unit.unused_data + self._input.tobytes())
                self._unit, self._fed = self._new(), False
                continue
            if not self._input and (self._zstd or self._unit.needs_input):
                self._input = memoryview(self._raw.read(_READ))
                if not self._input:
                    if self._fed:
                        raise EOFError(
                            "Compressed file ended before the end-of-stream marker was reached"
                        )
                    return 0
                continue
            self._out = memoryview(self._step(max(len(target), io.DEFAULT_BUFFER_SIZE)))
        count = min(len(target), len(self._out))
        target[:count] = self._out[:count]
        self._out = self._out[count:]
        return count

    def _step(self, at_most: int) -> bytes:
        """Decompress a bounded piece (``at_most`` bytes out, for bzip2 and xz)."""
        if self._zstd:
            piece, self._input = self._input[:_ZSTD_FEED], self._input[_ZSTD_FEED:]
            self._fed = True
            return bytes(self._unit.decompress(piece))
        data = memoryview(b"")
        if self._unit.needs_input:
            data, self._input = self._input, memoryview(b"")
            self._fed = self._fed or bool(data)
        return bytes(self._unit.decompress(data, at_most))
