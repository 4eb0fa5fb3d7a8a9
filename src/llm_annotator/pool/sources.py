"""Where servers are listed: a file, a directory of ``*.url`` files, a DNS name.

- :class:`FileSource`: a file of base URLs, one a line; blank lines and ``#``
  comments (at a line's start or after a space) are ignored.
- :class:`DirectorySource`: a directory where each server writes ``<name>.url`` (one
  base URL) once it is healthy, and deletes it when it goes away. Write the file under
  another name and rename it, so a reader never sees half a URL.
- :class:`DnsSource`: a name with many addresses, such as a Kubernetes headless
  service; each address becomes ``http://<address>:<port>/v1``.

Any object with a ``description`` and the two read methods of :class:`ServerSource`
is a source too. :class:`~llm_annotator.pool.discovery.ServerDiscovery` reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import os
import re
import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from llm_annotator.clients.urls import has_credentials, normalize_base_url, shown_url
from llm_annotator.errors import ConfigurationError

log = structlog.get_logger(__name__)

_COMMENT = re.compile(r"(?:^|\s)#")
"""Where a comment starts in a servers file: a ``#`` at the start or after a space."""

_MAX_URL_FILE = 4096
"""Bytes read from one ``*.url`` file: a base URL is far shorter."""
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9_.])?")


class ServerSource(Protocol):
    """Somewhere that lists servers. Both reads return the normalized base URLs listed
    now, or None for "nothing to say this round: keep the last list". A read that fails
    raises (OSError for the sources here); the caller keeps the last list and logs it."""

    @property
    def description(self) -> str: ...

    async def read(self) -> set[str] | None: ...

    def read_sync(self) -> set[str] | None: ...


def parse_dns_target(text: str) -> tuple[str, int]:
    """Split ``name:port`` into a host name and a port; an IPv6 address goes in brackets.

    Raises:
        ConfigurationError: If the text is not a host name (or address), a colon and a
            port between 1 and 65535.

    Examples:
        >>> parse_dns_target("vllm.annotate.svc.cluster.local:8000")
        ('vllm.annotate.svc.cluster.local', 8000)
        >>> parse_dns_target("[fd00::7]:8000")
        ('fd00::7', 8000)
        >>> parse_dns_target("vllm")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: DNS target 'vllm' is not name:port; write it like 'vllm.annotate.svc.cluster.local:8000'
    """  # noqa: E501
    if not isinstance(text, str):
        raise ConfigurationError(f"DNS target must be a string, got {type(text).__name__}")
    host, _, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1] if _is_ipv6(host[1:-1]) else ""
    elif ":" in host:
        host = ""  # an IPv6 address without brackets: where does the port start?
    try:
        return _check_host(host), _check_port(
            int(port) if port.isascii() and port.isdigit() else -1
        )
    except (ConfigurationError, ValueError):
        raise ConfigurationError(
            f"DNS target {text!r} is not name:port; "
            "write it like 'vllm.annotate.svc.cluster.local:8000'"
        ) from None


def _is_ipv6(text: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(text), ipaddress.IPv6Address)
    except ValueError:
        return False


def _check_host(host: object) -> str:
    if not isinstance(host, str) or not (_HOST_NAME.fullmatch(host) or _is_ipv6(host)):
        raise ConfigurationError(f"{host!r} is not a host name or an IP address")
    return host


def _check_port(port: object) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigurationError(f"port must be an integer from 1 to 65535, got {port!r}")
    return port


def _check_path(path: object, what: str) -> Path:
    if isinstance(path, str) and not path.strip():
        raise ConfigurationError(f"{what} must not be empty")
    if not isinstance(path, str | os.PathLike):
        raise ConfigurationError(f"{what} must be a path, got {type(path).__name__}")
    return Path(os.fspath(path))


def address_url(address: str, port: int) -> str:
    """The base URL of a server at an IP address and port.

    Examples:
        >>> address_url("10.0.0.7", 8000)
        'http://10.0.0.7:8000/v1'
        >>> address_url("fd00::7", 8000)
        'http://[fd00::7]:8000/v1'
    """
    host = f"[{address.replace('%', '%25')}]" if ":" in address else address
    return normalize_base_url(f"http://{host}:{port}/v1")


class _Memo:
    """What a file source read last: shared by the sync and async reads."""

    __slots__ = ("digest", "good", "lock", "seen", "urls", "warned")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.digest = b""
        self.urls: frozenset[str] = frozenset()
        self.seen: dict[str, tuple[tuple[int, int, int], str | None]] = {}
        self.good: dict[str, str] = {}
        self.warned: set[str] = set()


@dataclass(frozen=True, slots=True)
class FileSource:
    """A file of base URLs, one a line; blank lines and ``#`` comments are ignored.

    A comment starts at a ``#`` at the start of a line or after a space: a ``#`` within
    an entry (a password, wrongly written in the URL) stays part of it, so the entry
    is refused and masked whole, not cut into a URL that shows part of the password.

    It is read every round and parsed again when its content changes. A line that is
    not an http(s) URL is skipped and logged once. A file that cannot be read (missing,
    no permission) keeps the last list: empty it to remove every server.

    Args:
        path: The file.

    Raises:
        ConfigurationError: If ``path`` is not a path.

    Examples:
        >>> FileSource(Path("servers.txt")).description
        'file servers.txt'
    """

    path: Path
    _memo: _Memo = field(default_factory=_Memo, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _check_path(self.path, "the servers file"))

    @property
    def description(self) -> str:
        return f"file {self.path}"

    async def read(self) -> set[str]:
        return await asyncio.to_thread(self.read_sync)

    def read_sync(self) -> set[str]:
        data = self.path.read_bytes()
        digest = hashlib.blake2b(data, digest_size=16).digest()
        memo = self._memo
        with memo.lock:
            if digest != memo.digest:
                memo.urls = frozenset(self._parse(data.decode("utf-8", errors="replace")))
                memo.digest = digest
            return set(memo.urls)

    def _parse(self, text: str) -> set[str]:
        urls: set[str] = set()
        for number, line in enumerate(text.splitlines(), start=1):
            entry = _COMMENT.split(line, maxsplit=1)[0].strip()
            if not entry:
                continue
            try:
                urls.add(normalize_base_url(entry))
            except ConfigurationError:
                log.warning(
                    "discovery_entry_skipped",
                    source=self.description,
                    line=number,
                    entry=shown_url(entry)[:200],
                    reason=_skip_reason(entry),
                )
        return urls


@dataclass(frozen=True, slots=True)
class DirectorySource:
    """A directory where each server writes ``<name>.url`` holding its base URL.

    A file appearing is a server joining; a file disappearing is a server leaving.
    Other files and hidden files are ignored. A ``*.url`` file that is empty or does
    not hold a URL yet (being written) is skipped and logged once; if it held a URL
    before, that URL stays listed until the file holds a new one. A directory that
    cannot be read keeps the last list.

    Args:
        path: The directory.

    Raises:
        ConfigurationError: If ``path`` is not a path.

    Examples:
        >>> DirectorySource(Path("servers.d")).description
        'directory servers.d'
    """

    path: Path
    _memo: _Memo = field(default_factory=_Memo, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", _check_path(self.path, "the servers directory"))

    @property
    def description(self) -> str:
        return f"directory {self.path}"

    async def read(self) -> set[str]:
        return await asyncio.to_thread(self.read_sync)

    def read_sync(self) -> set[str]:
        memo = self._memo
        with memo.lock, os.scandir(self.path) as entries:
            names = set()
            for entry in entries:
                if entry.name.startswith(".") or not entry.name.endswith(".url"):
                    continue
                try:
                    if entry.is_file():
                        self._look_at(entry, memo)
                        names.add(entry.name)
                except FileNotFoundError:
                    continue  # deleted since the listing: its server left
                except OSError:
                    names.add(entry.name)  # unreadable for now: keep what it said
            for table in (memo.seen, memo.good):
                for name in set(table) - names:
                    del table[name]
            memo.warned &= names
            return set(memo.good.values())

    def _look_at(self, entry: os.DirEntry[str], memo: _Memo) -> None:
        """Read one ``*.url`` file if it changed since the last round."""
        stat = entry.stat()
        key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        before = memo.seen.get(entry.name)
        if before is not None and before[0] == key:
            return
        with open(entry.path, "rb") as file:
            text = file.read(_MAX_URL_FILE).decode("utf-8", errors="replace").strip()
        url: str | None = None
        with contextlib.suppress(ConfigurationError):
            url = normalize_base_url(text) if text else None
        memo.seen[entry.name] = (key, url)
        if url is not None:
            memo.good[entry.name] = url
            memo.warned.discard(entry.name)
        elif entry.name not in memo.warned:
            memo.warned.add(entry.name)
            log.info(
                "discovery_entry_skipped",
                source=self.description,
                file=entry.name,
                entry=shown_url(text)[:200],
                reason="empty" if not text else _skip_reason(text, later=True),
            )


@dataclass(frozen=True, slots=True)
class DnsSource:
    """A DNS name with many addresses and the port every server listens on.

    Each address becomes ``http://<address>:<port>/v1`` (an IPv6 address in
    brackets). The name is resolved each round with the event loop's resolver; a
    failure (or an answer without addresses) keeps the last list, so a DNS hiccup
    drops no server.

    Args:
        host: The name, e.g. a Kubernetes headless service
            ``vllm.annotate.svc.cluster.local``.
        port: The servers' port.

    Raises:
        ConfigurationError: If the host or port is not valid.

    Examples:
        >>> DnsSource.parse("vllm.annotate.svc.cluster.local:8000")
        DnsSource(host='vllm.annotate.svc.cluster.local', port=8000)
    """

    host: str
    port: int

    def __post_init__(self) -> None:
        _check_host(self.host)
        _check_port(self.port)

    @classmethod
    def parse(cls, text: str) -> DnsSource:
        """A source from ``name:port`` (as given to ``--servers-dns``).

        Raises:
            ConfigurationError: If the text is not ``name:port``.
        """
        host, port = parse_dns_target(text)
        return cls(host, port)

    @property
    def description(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"dns {host}:{self.port}"

    async def read(self) -> set[str]:
        loop = asyncio.get_running_loop()
        found = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        return self._urls(found)

    def read_sync(self) -> set[str]:
        return self._urls(socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM))

    def _urls(self, found: Iterable[tuple[Any, ...]]) -> set[str]:
        urls = {
            address_url(str(info[4][0]), self.port)
            for info in found
            if info[0] in (socket.AF_INET, socket.AF_INET6)
        }
        if not urls:
            raise OSError(f"{self.host} resolved to no IP address")
        return urls


def _skip_reason(entry: str, *, later: bool = False) -> str:
    """Why a discovered entry is not a server's URL, in words for the log.

    Examples:
        >>> _skip_reason("http://u:sk-1@10.0.0.1:8000/v1")
        'holds a user name or password (list the URL without them; give the key with --api-key-file)'
        >>> _skip_reason("http:", later=True)
        'not an http(s) URL (yet)'
    """  # noqa: E501
    if has_credentials(entry):
        return (
            "holds a user name or password (list the URL without them; give the key "
            "with --api-key-file)"
        )
    return "not an http(s) URL (yet)" if later else "not an http(s) URL"
