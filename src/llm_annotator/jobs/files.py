"""The run directory's files, opened so that nothing planted in it is written through.

A run directory is shared ground: a cluster's file system, a folder another job or
user can write to. Every file a job writes or reads there is opened through this module:

- never through a symbolic link (``O_NOFOLLOW``), and only if it is a regular file
  (checked on the open file, ``fstat``), so that a link, a FIFO, a device or a folder
  planted under one of the job's names is refused with one line naming it instead of
  being truncated, appended to, or blocking the job;
- files written in place (the lock, the timeline, the store's own files) also only if
  no other name links to them (a hard link would carry the writes elsewhere);
- never blocking in ``open``: ``O_NONBLOCK`` makes a FIFO's open return at once (to be
  refused), where a plain open waits for a writer forever;
- files replaced whole (``job.json``, the outputs, the reports) by a temporary made
  with an exclusive create under a fresh random name in the same folder
  (:func:`tempfile.mkstemp`), fsynced, then renamed over the old name: a reader sees
  the old file or the new one, and no fixed temporary name can be planted.

Inputs are the user's own paths, so links are followed there (a dataset is often a
link into shared storage), but the file at the end must be a regular one
(:func:`open_input_file`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from llm_annotator.errors import InputError, RunDirectoryError

_REMEDY = (
    "the run directory's files are the job's own: remove it (llm-annotator never writes "
    "through links or into special files), or choose another output directory"
)


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def refused(path: Path | str, what: str) -> RunDirectoryError:
    """The one-line refusal of a run-directory entry that is not what it must be."""
    return RunDirectoryError(f"{path} is {what}; {_REMEDY}", path=str(path))


def open_file(path: Path | str, flags: int, *, mode: int = 0o644, single: bool = False) -> int:
    """Open a run-directory file without following a link or blocking; a descriptor.

    Args:
        path: The file.
        flags: ``os.O_*`` flags (``O_CREAT`` creates it if missing).
        mode: The new file's mode.
        single: Refuse a file that other names link to as well (for files written in
            place).

    Raises:
        RunDirectoryError: The entry is a link, not a regular file, or (``single``)
            hard-linked elsewhere.
        OSError: It cannot be opened (missing, no permission, full disk, ...).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise refused(path, "a symbolic link") from None
        if error.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV):
            kind = "a directory" if error.errno == errno.EISDIR else "not a regular file"
            with contextlib.suppress(OSError):
                kind = _kind(os.lstat(path).st_mode)
            raise refused(path, kind) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise refused(path, _kind(info.st_mode))
        if single and info.st_nlink > 1:
            raise refused(path, f"a file with {info.st_nlink} hard links")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path: Path | str, flags: int = os.O_RDONLY, *, single: bool = False) -> io.FileIO:
    """:func:`open_file` as an unbuffered binary file object."""
    fd = open_file(path, flags, single=single)
    mode = "r+b" if flags & os.O_RDWR else "wb" if flags & os.O_WRONLY else "rb"
    return io.FileIO(fd, mode, closefd=True)


def read_bytes(path: Path | str) -> bytes | None:
    """A run-directory file's bytes, or None if there is none.

    Raises:
        RunDirectoryError: The entry is a link or not a regular file.
        OSError: It cannot be read.
    """
    try:
        file = open_binary(path)
    except FileNotFoundError:
        return None
    with file:
        return file.read()


def read_run_file(path: Path) -> bytes | None:
    """A run-directory file's bytes, or None if there is none; a file that cannot be
    read is one line naming it.

    Raises:
        RunDirectoryError: The entry is a link, not a regular file, or cannot be read.
    """
    try:
        return read_bytes(path)
    except OSError as error:
        raise RunDirectoryError(
            f"cannot read {path}: {error.strerror or error}", path=str(path)
        ) from None


def check_entry(path: Path, *, directory: bool = False) -> bool:
    """Whether ``path`` exists, refusing it if it is not what the job would make there
    (a regular file, or with ``directory`` a real directory; never a link)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    wanted = stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)
    if not wanted:
        raise refused(path, _kind(info.st_mode))
    return True


def make_directory(path: Path) -> None:
    """Create a folder of the run directory (its parent must exist), or check the one
    there is a real directory and not a link.

    Raises:
        RunDirectoryError: The entry is a link or not a directory.
        OSError: It cannot be created.
    """
    if check_entry(path, directory=True):
        return
    try:
        path.mkdir()
    except FileExistsError:  # made meanwhile by another process
        check_entry(path, directory=True)


@contextlib.contextmanager
def atomic_write(path: Path, *, durable: bool = True) -> Iterator[IO[bytes]]:
    """A file that replaces ``path`` only once written whole (and, if ``durable``,
    fsynced with its folder).

    The bytes go to a new file of a fresh name in the same folder (exclusive create),
    renamed over ``path`` at the end; if the block raises, the temporary file is removed
    and ``path`` is untouched. Advisory files rewritten every few seconds (such as
    ``status.json``) pass ``durable=False``.

    Raises:
        RunDirectoryError: ``path`` is a link or not a regular file (it is left alone).
    """
    check_entry(path)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            yield file
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if durable:
        fsync_directory(path.parent)


_TEMPORARY = re.compile(r"\.(.+)\.[A-Za-z0-9_]+\.tmp")
"""The name :func:`atomic_write` gives a temporary: the file's, between a dot and a
random part (:func:`tempfile.mkstemp`'s letters, digits and underscores)."""


def temporary_of(name: str) -> str | None:
    """The name of the file an :func:`atomic_write` temporary named ``name`` was made
    for, or None if ``name`` is not such a temporary (one is left behind only by a
    process killed while it wrote).

    Examples:
        >>> temporary_of(".job.json.k3x_9qa1.tmp"), temporary_of("job.json")
        ('job.json', None)
        >>> temporary_of("..a.parquet.new.0ab_cdef.tmp")
        '.a.parquet.new'
    """
    match = _TEMPORARY.fullmatch(name)
    return match[1] if match else None


def fsync_directory(path: Path) -> None:
    """fsync a directory, so that a new or renamed entry in it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shown_path(path: str) -> str:
    """A path for messages and JSON files: bytes that are not UTF-8 (kept in the str as
    surrogates by the file system's decoding) shown as backslash escapes.

    Examples:
        >>> shown_path("data/in.jsonl"), shown_path("caf\\udce9.jsonl")
        ('data/in.jsonl', 'caf\\\\xe9.jsonl')
    """
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _not_regular(path: str, mode: int) -> InputError:
    return InputError(
        f"{shown_path(path)} is {_kind(mode)}, not a regular file: give the path of an input "
        "file (a pipe or a device cannot be read twice, as a job does)"
    )


def _unreadable(path: str, error: OSError) -> InputError:
    return InputError(
        f"cannot read the input file {shown_path(path)}: {error.strerror or error}; check the path"
    )


def check_input_file(path: str) -> None:
    """Check that an input path leads to a regular file (links followed), without opening
    it: for readers that open the path themselves.

    Raises:
        InputError: The path is missing or not a regular file.
    """
    try:
        info = os.stat(path)
    except OSError as error:
        raise _unreadable(path, error) from None
    if not stat.S_ISREG(info.st_mode):
        raise _not_regular(path, info.st_mode)


def open_input_file(path: str) -> IO[bytes]:
    """Open an input file for reading: links followed, but only a regular file at the
    end, and never blocking in ``open`` (a FIFO or a device is refused at once).

    Raises:
        InputError: The path is missing, unreadable, or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise _unreadable(path, error) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path, info.st_mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")
