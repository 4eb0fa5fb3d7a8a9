"""The HTTP boundary: aiohttp in, our exceptions out.

Every request to a model server passes through :class:`HttpTransport`. It owns the
connection pool (one aiohttp session per event loop), applies the two timeouts (a short
connect timeout, a long read timeout), and is the one place where aiohttp's exceptions
become :mod:`llm_annotator.errors` exceptions.
"""

from __future__ import annotations

import asyncio
import weakref
from urllib.parse import urlsplit

import aiohttp

from llm_annotator._constants import KEEPALIVE_TIMEOUT, MAX_CONNECTIONS
from llm_annotator.errors import (
    ConfigurationError,
    DisconnectedError,
    ErrorKind,
    ProviderError,
    ReadTimeoutError,
    ServerConnectError,
)


def normalize_base_url(base_url: str) -> str:
    """Check a base URL and drop its trailing slash.

    Raises:
        ConfigurationError: If the URL is not an http(s) URL with a host.

    Examples:
        >>> normalize_base_url("http://127.0.0.1:8000/v1/")
        'http://127.0.0.1:8000/v1'
        >>> normalize_base_url("127.0.0.1:8000")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: base_url '127.0.0.1:8000' is not an http(s) URL with a host; write it like 'http://127.0.0.1:8000/v1'
    """  # noqa: E501
    if not isinstance(base_url, str):
        raise ConfigurationError(f"base_url must be a string, got {type(base_url).__name__}")
    url = base_url.strip().rstrip("/")
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
        parts = urlsplit("")
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigurationError(
            f"base_url {base_url!r} is not an http(s) URL with a host; "
            "write it like 'http://127.0.0.1:8000/v1'"
        )
    return url


def server_root(base_url: str) -> str:
    """The server's root URL: the base URL without a trailing ``/v1``.

    Examples:
        >>> server_root("http://127.0.0.1:8000/v1")
        'http://127.0.0.1:8000'
        >>> server_root("http://127.0.0.1:8000")
        'http://127.0.0.1:8000'
    """
    url = normalize_base_url(base_url)
    return url.removesuffix("/v1")


_LIVE: weakref.WeakSet[HttpTransport] = weakref.WeakSet()


def live_transports() -> list[HttpTransport]:
    """Transports that may still hold open sessions (for cleanup at interpreter exit)."""
    return [t for t in _LIVE if t._sessions]


class HttpTransport:
    """Connections to one server, with the exception mapping.

    Args:
        base_url: The server's base URL (``http://host:port/v1``).
        connect_timeout: Seconds to establish a TCP connection.
        read_timeout: Seconds to wait for an answer once the request is sent.
        max_connections: Sockets this transport may hold open at once.
        api_key: Sent as a bearer token when given.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int = MAX_CONNECTIONS,
        api_key: str | None = None,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.root = self.base_url.removesuffix("/v1")
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=KEEPALIVE_TIMEOUT,
                ttl_dns_cache=300,
            )
            session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                headers=self._headers,
                skip_auto_headers=("User-Agent",),
                auto_decompress=False,
            )
            self._sessions[loop] = session
            _LIVE.add(self)
        return session

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body`` to ``base_url + path``.

        Returns:
            The status code and the raw body of the answer.

        Raises:
            ProviderError: A :class:`TransportError` subclass when no whole answer came.
        """
        try:
            async with self._session().post(self.base_url + path, data=body) as answer:
                return answer.status, await answer.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._map(exc) from exc

    async def get(self, url: str, *, timeout: float | None = None) -> tuple[int, bytes]:
        """GET an absolute URL on this server, with an overall ``timeout`` if given."""
        request_timeout = (
            aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, self._connect_timeout))
            if timeout is not None
            else None
        )
        try:
            async with self._session().get(url, timeout=request_timeout) as answer:
                return answer.status, await answer.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._map(exc) from exc

    def _map(self, exc: BaseException) -> ProviderError:
        """Turn an aiohttp or timeout exception into ours."""
        server = self.base_url
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, aiohttp.ConnectionTimeoutError):
            return ServerConnectError(
                f"no connection within {self._connect_timeout:g} s (connect timeout); "
                "the host may be down or dropping packets",
                kind=ErrorKind.CONNECT_TIMEOUT,
                server=server,
            )
        if isinstance(exc, aiohttp.ClientConnectorError):
            reason = exc.os_error.strerror or str(exc.os_error) or type(exc.os_error).__name__
            if isinstance(exc.os_error, ConnectionRefusedError):
                reason = "connection refused"
            elif isinstance(exc, aiohttp.ClientConnectorDNSError):
                reason = f"the host name does not resolve ({reason})"
            return ServerConnectError(
                f"cannot connect: {reason.lower()}; is the server running at this address?",
                kind=ErrorKind.CONNECT,
                server=server,
            )
        if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
            return DisconnectedError(
                f"connection lost before the answer arrived ({detail})",
                kind=ErrorKind.DISCONNECTED,
                server=server,
            )
        if isinstance(exc, aiohttp.ClientPayloadError):
            return DisconnectedError(
                f"the answer was cut off ({detail})", kind=ErrorKind.DISCONNECTED, server=server
            )
        if isinstance(exc, TimeoutError):
            return ReadTimeoutError(
                "no answer within the read timeout; the server is slow, overloaded or hung",
                kind=ErrorKind.READ_TIMEOUT,
                server=server,
            )
        if isinstance(exc, aiohttp.InvalidURL):
            return ServerConnectError(
                f"invalid URL {detail}", kind=ErrorKind.CONNECT, server=server
            )
        return DisconnectedError(
            f"HTTP client error {type(exc).__name__}: {detail}",
            kind=ErrorKind.DISCONNECTED,
            server=server,
        )

    async def aclose(self) -> None:
        """Close every session this transport opened, on whichever loop it lives."""
        sessions, self._sessions = self._sessions, {}
        here = asyncio.get_running_loop()
        for loop, session in sessions.items():
            if session.closed:
                continue
            if loop is here:
                await session.close()
            elif loop.is_running():
                # Scheduled, not awaited: that loop's thread may be the one blocked on
                # this very call (a sync close() from inside a running loop).
                asyncio.run_coroutine_threadsafe(session.close(), loop)
            # A session whose loop has stopped cannot be closed any more; see _session.
