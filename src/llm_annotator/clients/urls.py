"""Base URLs of model servers: one spelling for each, checked once."""

from __future__ import annotations

from urllib.parse import urlsplit

from llm_annotator.errors import ConfigurationError


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
    if "@" in parts.netloc:
        # A password in the URL would show in every log line, error and result row.
        shown = parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]).geturl()
        raise ConfigurationError(
            f"base_url {shown!r} holds credentials; give the URL without them and the key "
            "as api_key (VLLM_API_KEY, or --api-key-file on the command line)"
        )
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
