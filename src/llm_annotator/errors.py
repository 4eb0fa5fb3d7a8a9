"""The exceptions llm_annotator raises, and the kinds of failure a request can meet.

Every exception derives from one root, so ``except LLMAnnotatorError`` catches all of
them::

    LLMAnnotatorError
    ├── ConfigurationError          a setting that cannot work (bad URL, unknown model)
    │   └── DuplicateServerError    (pool) a server given when it is a member already
    ├── ProviderError               one request failed; carries server, kind, status
    │   ├── TransportError          no HTTP answer at all
    │   │   ├── ServerConnectError  refused, connect timeout, DNS failure: server gone
    │   │   ├── TLSError            the TLS handshake failed (certificate, protocol)
    │   │   ├── ReadTimeoutError    connected, but no whole answer within the timeout
    │   │   └── DisconnectedError   the connection dropped before the answer was whole
    │   ├── StatusError             an HTTP error status or a redirect (the kind tells which)
    │   ├── MalformedResponseError  a 2xx whose body is not a chat completion
    │   └── OversizedResponseError  an answer larger than max_response_bytes
    ├── LocalServerError            (local) a local vLLM server exited or never got healthy
    ├── PoolExhaustedError          (pool) every server is gone past the deadline
    │   └── ServersUnusableError    every server refused for a reason waiting won't fix
    └── JobError                    (jobs) an annotation job cannot start or go on
        ├── InputError              unreadable input, a bad id, an unknown column
        ├── PromptError             a template that cannot be rendered safely
        ├── FingerprintMismatchError  resuming a directory made with other settings
        ├── OutputWriteError        the run directory cannot be written (disk full, ...)
        ├── RunDirectoryError       a run-directory file is a link, not a regular file,
        │                           or not what the job wrote there
        └── RunInterruptedError     stopped by a signal; everything done is written

``InputError``, ``PromptError``, ``FingerprintMismatchError`` and
``ServersUnusableError`` are also ``ConfigurationError`` (and so ``ValueError``): the
fix is in what the user passed.

A failure's ``kind`` (an :class:`ErrorKind`) says whose fault it is, which is what a
pool needs to decide between evicting a server, retrying a sample and keeping an
error row. It is also what ends up in ``Response.error_type``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from llm_annotator.response import Response


class ErrorKind(StrEnum):
    """Why a request failed, named by whose fault it is.

    Examples:
        >>> ErrorKind.CONNECT.server_gone
        True
        >>> ErrorKind.BAD_REQUEST.server_gone
        False
        >>> str(ErrorKind.READ_TIMEOUT)
        'read_timeout'
    """

    CONNECT = "connect"
    """Connection refused or DNS failure: the server is gone."""
    CONNECT_TIMEOUT = "connect_timeout"
    """No connection within the connect timeout: the host is down or drops packets (or,
    rarely, this process was too busy to see the answer in time)."""
    TLS = "tls"
    """The TLS handshake failed: an untrusted or wrong certificate, or a server that
    does not speak TLS on that port. A configuration error (``verify=``)."""
    READ_TIMEOUT = "read_timeout"
    """Connected, but the whole answer did not arrive within the request's deadline:
    slow, hung, or trickling its body."""
    DISCONNECTED = "disconnected"
    """The connection dropped mid-request (the server died or restarted)."""
    ENGINE_DEAD = "engine_dead"
    """500 from a server whose engine died; the process exits soon after."""
    OVERLOADED = "overloaded"
    """429 or 503 busy: back off and retry."""
    SERVER_ERROR = "server_error"
    """Any other 5xx: transient until proven otherwise."""
    BAD_REQUEST = "bad_request"
    """400/413/422: this sample or its options are at fault (e.g. prompt too long)."""
    AUTH = "auth"
    """401/403: a configuration error."""
    NOT_FOUND = "not_found"
    """404: wrong base URL or unknown model, a configuration error."""
    HTTP_ERROR = "http_error"
    """Any other non-2xx status."""
    REDIRECT = "redirect"
    """A 3xx: redirects are not followed (the prompt would go to another host)."""
    MALFORMED = "malformed_response"
    """A 2xx whose body is not a chat completion (server or proxy bug)."""
    OVERSIZED = "oversized"
    """An answer larger than ``max_response_bytes``, cut off while reading."""
    POISON = "poison_sample"
    """(pool) The sample was in flight on several servers that were each evicted."""
    INPUT = "input_error"
    """(jobs) The input row could not be read or turned into a prompt."""
    INVALID_OUTPUT = "invalid_output"
    """(jobs) The answer is not valid JSON or does not follow the output_schema."""
    TRUNCATED = "truncated_output"
    """(jobs) The answer hit max_completion_tokens before the output_schema was complete."""

    @property
    def server_gone(self) -> bool:
        """Whether this failure is how a dead or unreachable server looks.

        A connect timeout and a dropped connection look so, but a live server can
        cause them too (a burst of new connections, an answer cut off): the pool
        checks those with a health check before it evicts (``pool.failures``).
        """
        return self in _SERVER_GONE

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed if sent again later."""
        return self in _RETRYABLE


_SERVER_GONE = frozenset(
    {ErrorKind.CONNECT, ErrorKind.CONNECT_TIMEOUT, ErrorKind.DISCONNECTED, ErrorKind.ENGINE_DEAD}
)
_RETRYABLE = frozenset(
    {
        ErrorKind.CONNECT,
        ErrorKind.CONNECT_TIMEOUT,
        ErrorKind.READ_TIMEOUT,
        ErrorKind.DISCONNECTED,
        ErrorKind.ENGINE_DEAD,
        ErrorKind.OVERLOADED,
        ErrorKind.SERVER_ERROR,
    }
)


class LLMAnnotatorError(Exception):
    """The root of every exception this package raises."""


class ConfigurationError(LLMAnnotatorError, ValueError):
    """A setting that cannot work; the message names the setting and the fix."""


class DuplicateServerError(ConfigurationError):
    """A server was given to the pool when it is a member already."""


class ProviderError(LLMAnnotatorError):
    """A request to a model server failed.

    Attributes:
        kind: Why it failed (see :class:`ErrorKind`).
        server: Base URL of the server the request went to.
        status_code: The HTTP status, when the server answered with one.
        attempts: How many times the request was sent.
    """

    def __init__(
        self,
        message: str,
        *,
        kind: ErrorKind,
        server: str | None = None,
        status_code: int | None = None,
        attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.server = server
        self.status_code = status_code
        self.attempts = attempts

    def __str__(self) -> str:
        where = f"{self.server}: " if self.server else ""
        tries = f" (after {self.attempts} attempts)" if self.attempts > 1 else ""
        return f"{where}{self.message}{tries}"

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_provider_error, (type(self), self.message, self.__dict__))


def _rebuild_provider_error(
    cls: type[ProviderError], message: str, state: dict[str, object]
) -> ProviderError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class TransportError(ProviderError):
    """No HTTP answer arrived at all."""


class ServerConnectError(TransportError):
    """The connection could not be made: refused, timed out or the name did not resolve."""


class TLSError(TransportError):
    """The TLS handshake failed: the certificate is not trusted or not the host's, or the
    server does not speak TLS there."""


class ReadTimeoutError(TransportError):
    """Connected, but the whole answer did not arrive within the request's deadline."""


class DisconnectedError(TransportError):
    """The connection dropped before the whole answer arrived."""


class StatusError(ProviderError):
    """The server answered with an HTTP error status."""


class MalformedResponseError(ProviderError):
    """The server answered 2xx with a body that is not a chat completion."""


class OversizedResponseError(ProviderError):
    """The answer was larger than ``max_response_bytes``; it was cut off, not buffered."""


class LocalServerError(LLMAnnotatorError):
    """A local vLLM server exited or did not become healthy in time.

    The message ends with the last lines of the server's log.

    Attributes:
        base_url: The server's base URL.
        log_path: The server's log file.
        returncode: The process's exit status, or ``None`` if it was still running.
    """

    def __init__(
        self, message: str, *, base_url: str, log_path: Path, returncode: int | None
    ) -> None:
        super().__init__(message)
        self.base_url = base_url
        self.log_path = log_path
        self.returncode = returncode


class PoolExhaustedError(LLMAnnotatorError):
    """Every server of a pool stayed down past the deadline.

    Attributes:
        responses: One entry per input: the Response completed before the pool ran
            out of servers, or None for a sample still open.
        servers: Each server's base URL and the last thing it said.
    """

    def __init__(
        self,
        message: str,
        *,
        responses: list[Response | None] | None = None,
        servers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.responses: list[Response | None] = responses if responses is not None else []
        self.servers: dict[str, str] = servers if servers is not None else {}


class ServersUnusableError(PoolExhaustedError, ConfigurationError):
    """Every server of a pool refused for a reason that waiting does not fix: a wrong
    or missing API key, a TLS certificate that is not trusted, a redirect, a model it
    does not serve. Raised at once, before any sample is sent; the message names each
    server and what it said."""


class JobError(LLMAnnotatorError):
    """An annotation job cannot start or cannot go on."""


class InputError(JobError, ConfigurationError):
    """The input cannot be read as asked; the message names the file, the row and the field."""


class PromptError(JobError, ConfigurationError):
    """A prompt template that cannot be rendered safely, or a row it cannot render."""


class FingerprintMismatchError(JobError, ConfigurationError):
    """The output directory holds results made with other settings.

    Attributes:
        changes: One line per setting that differs, old and new.
    """

    def __init__(self, message: str, *, changes: list[str] | None = None) -> None:
        super().__init__(message)
        self.changes: list[str] = changes if changes is not None else []


class OutputWriteError(JobError):
    """The run directory cannot be written: a full disk, a quota, a read-only or missing
    directory. Everything written before stays readable, and running the same job again
    resumes it.

    Attributes:
        path: The file or directory that could not be written.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class RunDirectoryError(JobError):
    """A file of the run directory is not the job's own (a symbolic link, a FIFO, a
    folder where a file belongs), or holds something the job never wrote (a
    ``job.json`` or ``status.json`` of the wrong shape). Nothing was written through it.

    Attributes:
        path: The file.
    """

    def __init__(self, message: str, *, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class RunInterruptedError(JobError):
    """A job stopped by SIGINT or SIGTERM; every result completed before is written.

    Attributes:
        output_dir: The run directory; running the same job again resumes it.
        num_done: Rows with a result on disk when the job stopped.
        signum: The signal that stopped it, or None when the caller asked.
    """

    def __init__(
        self, message: str, *, output_dir: str = "", num_done: int = 0, signum: int | None = None
    ) -> None:
        super().__init__(message)
        self.output_dir = output_dir
        self.num_done = num_done
        self.signum = signum
