"""The HTTP boundary: aiohttp in, our exceptions out.

Every request to a model server passes through :class:`HttpTransport`. It owns the
connection pool (one aiohttp session per event loop) and treats the server as untrusted:
one deadline bounds the whole request (connecting, waiting, reading the body), a short
connect timeout bounds connecting, a size cap bounds the body (read in pieces, never
buffered past the cap), redirects are not followed, and TLS is verified as configured.
It is the one place where aiohttp's exceptions become :mod:`llm_annotator.errors`
exceptions, and where an API key quoted back by a server is cut out of every message.
"""

from __future__ import annotations

import asyncio
import re
import weakref

import aiohttp
import structlog

from llm_annotator import _sync
from llm_annotator._constants import KEEPALIVE_TIMEOUT, MAX_CONNECTIONS, MAX_RESPONSE_BYTES
from llm_annotator._validate import check_key_text
from llm_annotator.clients._deadline import Deadlines
from llm_annotator.clients.tls import Verify, ssl_setting, unverified_context
from llm_annotator.clients.urls import normalize_base_url, server_root
from llm_annotator.errors import (
    DisconnectedError,
    ErrorKind,
    OversizedResponseError,
    ProviderError,
    ReadTimeoutError,
    ServerConnectError,
    TLSError,
)

log = structlog.get_logger(__name__)

__all__ = [
    "REDACTED",
    "HttpTransport",
    "Verify",
    "check_key_text",
    "live_transports",
    "normalize_base_url",
    "server_root",
    "ssl_setting",
    "unverified_context",
]

REDACTED = "[redacted]"


def escaped_key_pattern(api_key: str) -> re.Pattern[bytes]:
    r"""A pattern of every spelling of ``api_key`` inside a JSON string: each character
    as itself or as a ``\uXXXX`` escape (hex in either case), and ``/``, ``"`` and ``\``
    by their short escapes too. A body is searched with it before it is parsed, so that
    no decoded value (an answer's text, its reasoning, an error message) holds the key.

    Examples:
        >>> pattern = escaped_key_pattern("sk-1/")
        >>> pattern.sub(b"[redacted]", rb'{"text": "\u0073k\u002D1\/ and sk-1/"}')
        b'{"text": "[redacted] and [redacted]"}'
    """
    short = {"/": rb"\\/", '"': rb'\\"', "\\": rb"\\\\"}
    parts = []
    for char in api_key:
        code = f"{ord(char):04x}".encode()
        hex_digits = b"".join(b"[" + bytes([d]) + bytes([d]).upper() + b"]" for d in code)
        spellings = [re.escape(char.encode()), rb"\\u" + hex_digits]
        if char in short:
            spellings.append(short[char])
        parts.append(b"(?:" + b"|".join(spellings) + b")")
    return re.compile(b"".join(parts))


_LIVE: weakref.WeakSet[HttpTransport] = weakref.WeakSet()


def live_transports() -> list[HttpTransport]:
    """Transports that may still hold open sessions (for cleanup at interpreter exit)."""
    return [t for t in _LIVE if t._sessions]


async def _close_live_transports() -> None:
    """Close the sessions clients left open, at interpreter exit (see ``_sync``)."""
    await asyncio.gather(*(t.aclose() for t in live_transports()), return_exceptions=True)


_sync.on_shutdown(_close_live_transports)


class HttpTransport:
    """Connections to one server, with the bounds and the exception mapping.

    Args:
        base_url: The server's base URL (``http://host:port/v1``).
        connect_timeout: Seconds to establish a TCP connection (and its TLS handshake).
        read_timeout: Seconds the whole of one POST may take, from sending it to the
            last byte of its answer. A server that trickles its body or never ends it
            fails at this deadline, not at the gap between two reads.
        max_connections: Sockets this transport may hold open at once.
        api_key: Sent as a bearer token when given, and cut out of every error
            message (servers sometimes quote the header back).
        verify: How to check TLS certificates (see :data:`Verify`).
        max_response_bytes: The largest answer read; a larger one is an
            ``oversized`` error, cut off as soon as it is known to be too large.
    """

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        max_connections: int = MAX_CONNECTIONS,
        api_key: str | None = None,
        verify: Verify = True,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.base_url = normalize_base_url(base_url)
        self.root = self.base_url.removesuffix("/v1")
        # The whole-request deadline is ours (clients/_deadline.py: cheaper than
        # aiohttp's total); aiohttp bounds only the connect.
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=connect_timeout, sock_read=None
        )
        self._read_timeout = read_timeout
        self._deadlines: dict[asyncio.AbstractEventLoop, Deadlines] = {}
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        self._max_bytes = max_response_bytes
        self._ssl = ssl_setting(verify)
        # identity: a compressed body would be undecodable (auto_decompress is off) and
        # would hide its real size from the cap.
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        check_key_text(api_key)
        self._secret = api_key or None
        self._secret_bytes = api_key.encode() if api_key else b""
        self._escaped_secret = escaped_key_pattern(api_key) if api_key else None
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def __repr__(self) -> str:
        return f"<HttpTransport {self.base_url}>"

    def redact(self, text: str) -> str:
        """``text`` with the API key, if any, replaced by ``[redacted]``.

        Examples:
            >>> HttpTransport("http://h:1/v1", connect_timeout=1, read_timeout=1,
            ...               api_key="sk-123").redact("bad key sk-123")
            'bad key [redacted]'
        """
        if self._secret and self._secret in text:
            return text.replace(self._secret, REDACTED)
        return text

    def redact_body(self, body: bytes) -> bytes:
        """``body`` with the API key replaced, before anything is parsed or quoted from it
        (a cut-off quote must not leave half a key either), in any JSON spelling of it
        (:func:`escaped_key_pattern`)."""
        if not self._secret_bytes:
            return body
        if self._secret_bytes in body:
            body = body.replace(self._secret_bytes, REDACTED.encode())
        if b"\\" in body and self._escaped_secret is not None:  # escapes: the key spelled so
            body = self._escaped_secret.sub(REDACTED.encode(), body)
        return body

    def scrub(self, error: ProviderError) -> ProviderError:
        """``error`` with the API key cut out of its message."""
        if self._secret:
            clean = self.redact(error.message)
            if clean != error.message:
                error.message = clean
                error.args = (clean,)
        return error

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=KEEPALIVE_TIMEOUT,
                ttl_dns_cache=300,
                ssl=self._ssl,
            )
            session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                headers=self._headers,
                skip_auto_headers=("User-Agent",),
                auto_decompress=False,
                trust_env=False,
            )
            self._sessions[loop] = session
            self._deadlines[loop] = Deadlines(loop)
            _LIVE.add(self)
        return session

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, str | None]:
        """POST ``body`` to ``base_url + path``.

        Returns:
            The status code, the raw body of the answer (at most ``max_response_bytes``)
            and the ``Location`` header of a redirect (None otherwise).

        Raises:
            ProviderError: A :class:`TransportError` subclass when no whole answer came
                in time, or :class:`OversizedResponseError`.
        """
        session = self._session()
        task: asyncio.Task[object] = asyncio.current_task()  # type: ignore[assignment]
        deadlines = self._deadlines[task.get_loop()]
        deadlines.watch(task, self._read_timeout)
        try:
            async with session.post(
                self.base_url + path, data=body, allow_redirects=False
            ) as answer:
                raw = self.redact_body(await self._read(answer))
                return answer.status, raw, _location(answer)
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Not chained: aiohttp's exception holds the request headers (the key) and
            # may quote the raw answer.
            raise self._map(exc) from None
        except asyncio.CancelledError:
            if not deadlines.expired(task):
                raise
            task.uncancel()  # the deadline's cancellation, not the caller's
            raise self._map(TimeoutError()) from None
        finally:
            deadlines.release(task)

    async def get(self, url: str, *, timeout: float | None = None) -> tuple[int, bytes, str | None]:
        """GET an absolute URL on this server, with an overall ``timeout`` if given.

        Returns:
            As :meth:`post`: the status, the body and a redirect's Location.
        """
        request_timeout = (
            aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, self._connect_timeout))
            if timeout is not None
            else None
        )
        try:
            async with self._session().get(
                url, timeout=request_timeout, allow_redirects=False
            ) as answer:
                raw = self.redact_body(await self._read(answer))
                return answer.status, raw, _location(answer)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._map(exc) from None

    async def _read(self, answer: aiohttp.ClientResponse) -> bytes:
        """The whole body, or OversizedResponseError as soon as it passes the cap."""
        cap = self._max_bytes
        length = answer.content_length
        if length is not None and length <= cap:
            return await answer.read()  # the parser stops at Content-Length
        if length is not None:
            answer.close()
            raise self._oversized(f"announces {length} bytes (Content-Length)")
        pieces: list[bytes] = []
        size = 0
        async for piece in answer.content.iter_any():
            size += len(piece)
            if size > cap:
                answer.close()  # drop the connection: the rest is never read
                raise self._oversized(f"sent more than that ({size} bytes read so far)")
            pieces.append(piece)
        return b"".join(pieces)

    def _oversized(self, detail: str) -> OversizedResponseError:
        return OversizedResponseError(
            f"the answer is larger than max_response_bytes={self._max_bytes} and was cut "
            f"off: it {detail}; raise max_response_bytes if such answers are expected",
            kind=ErrorKind.OVERSIZED,
            server=self.base_url,
        )

    def _map(self, exc: BaseException) -> ProviderError:
        """Turn an aiohttp or timeout exception into ours."""
        return self.scrub(self._mapped(exc))

    def _mapped(self, exc: BaseException) -> ProviderError:
        server = self.base_url
        detail = str(exc) or type(exc).__name__
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            return TLSError(
                f"the TLS certificate is not trusted ({exc.certificate_error}); give the "
                "authority that signed it: verify='/path/to/ca.pem' (--ca-bundle on the "
                "command line), or skip the check with verify=False (--no-verify-tls), "
                "which also accepts an impostor",
                kind=ErrorKind.TLS,
                server=server,
            )
        if isinstance(exc, aiohttp.ClientConnectorSSLError | aiohttp.ClientSSLError):
            return TLSError(
                f"the TLS handshake failed ({detail}); check that the server speaks "
                "https on this port and that the URL's scheme is right",
                kind=ErrorKind.TLS,
                server=server,
            )
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
                "no whole answer within the timeout; the server is slow, overloaded or "
                "hung, or sends its answer too slowly",
                kind=ErrorKind.READ_TIMEOUT,
                server=server,
            )
        if isinstance(exc, aiohttp.InvalidURL):
            return ServerConnectError(
                f"invalid URL {detail}", kind=ErrorKind.CONNECT, server=server
            )
        if isinstance(exc, aiohttp.ClientResponseError):
            # A status line or headers aiohttp cannot parse: a server or proxy bug.
            return DisconnectedError(
                f"the answer is not valid HTTP ({exc.message or detail})",
                kind=ErrorKind.DISCONNECTED,
                server=server,
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
        deadlines = self._deadlines.pop(here, None)
        if deadlines is not None:
            deadlines.close()
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


def _location(answer: aiohttp.ClientResponse) -> str | None:
    if 300 <= answer.status < 400:
        return answer.headers.get("Location", "")
    return None
