"""Base URLs of model servers: one spelling for each, checked once."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from llm_annotator.errors import ConfigurationError

_USERINFO = re.compile(r"^(\s*(?:[A-Za-z][A-Za-z0-9+.-]*:)?//|\s*).*@", re.DOTALL)
"""What comes after the scheme of a URL up to its last ``@``, wherever that is: a user
name and password (which may hold ``/``, ``?`` or ``#`` unescaped) and anything with
them. A base URL never needs an ``@``, so masking too much is the safe error."""


def shown_url(text: str) -> str:
    """A URL (or what was meant as one) as it may be logged or shown: any user name and
    password in it replaced by ``***``.

    Examples:
        >>> shown_url("http://user:sk-1@10.0.0.1:8000/v1")
        'http://***@10.0.0.1:8000/v1'
        >>> shown_url("user:sk-1@10.0.0.1:8000"), shown_url("http://u:sk/a?b#c@10.0.0.1/v1")
        ('***@10.0.0.1:8000', 'http://***@10.0.0.1/v1')
    """
    return _USERINFO.sub(lambda match: match.group(1) + "***@", text, count=1)


def has_credentials(text: str) -> bool:
    """Whether a URL (or what was meant as one) holds a user name or password.

    Examples:
        >>> has_credentials("http://u:p@10.0.0.1/v1"), has_credentials("http://10.0.0.1/v1")
        (True, False)
    """
    return shown_url(text) != text


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
    if "@" in parts.netloc or has_credentials(url):
        # A password in the URL would show in every log line, error and result row.
        raise ConfigurationError(
            f"base_url {shown_url(url)!r} holds credentials; give the URL without them and "
            "the key as api_key (VLLM_API_KEY, or --api-key-file on the command line)"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigurationError(
            f"base_url {shown_url(base_url)!r} is not an http(s) URL with a host; "
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
