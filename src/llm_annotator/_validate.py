"""Checks of settings, written once: each raises ConfigurationError naming the setting.

Examples:
    >>> positive_int("batch_size", 256)
    256
    >>> positive_int("batch_size", 0)
    Traceback (most recent call last):
    ...
    llm_annotator.errors.ConfigurationError: batch_size must be a positive integer, got 0
    >>> positive_seconds("timeout", float("inf"))
    Traceback (most recent call last):
    ...
    llm_annotator.errors.ConfigurationError: timeout must be a positive, finite number of seconds, got inf
"""  # noqa: E501

from __future__ import annotations

import math

from llm_annotator.errors import ConfigurationError


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 1."""
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
    return value  # type: ignore[return-value]


def non_negative_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 0."""
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}")
    return value  # type: ignore[return-value]


def positive_seconds(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number > 0."""
    if not _is_number(value) or not 0 < value < math.inf:  # type: ignore[operator]
        raise ConfigurationError(
            f"{name} must be a positive, finite number of seconds, got {value!r}"
        )
    return float(value)  # type: ignore[arg-type]


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def size_in_bytes(name: str, value: object) -> int:
    """A size as a positive integer of bytes, or text with a binary unit (``"64M"``,
    ``"1 GiB"``, ``"512kb"``).

    Examples:
        >>> size_in_bytes("unit_size", "64M"), size_in_bytes("unit_size", "1 GiB")
        (67108864, 1073741824)
        >>> size_in_bytes("unit_size", "x")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: unit_size must be a positive size in bytes (4096, 64M, 1G), got 'x'
    """  # noqa: E501
    if _is_int(value) and value > 0:  # type: ignore[operator]
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        text = text.removesuffix("ib").removesuffix("b") if text[-1:] == "b" else text
        number, unit = text.rstrip("kmgt"), text[len(text.rstrip("kmgt")) :]
        if number.isdigit() and unit in _SIZE_UNITS and int(number) > 0:
            return int(number) * _SIZE_UNITS[unit]
    raise ConfigurationError(
        f"{name} must be a positive size in bytes (4096, 64M, 1G), got {value!r}"
    )


def non_negative_seconds(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number >= 0."""
    if not _is_number(value) or not 0 <= value < math.inf:  # type: ignore[operator]
        raise ConfigurationError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def one_of(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``."""
    if value not in allowed:
        raise ConfigurationError(f"{name} must be one of {allowed}, got {value!r}")
    return str(value)


def check_api_key(api_key: object, where: str = "api_key") -> None:
    """Reject an API key that is not a string (the message never shows the key).

    Raises:
        ConfigurationError: If ``api_key`` is not None or a string.
    """
    if api_key is not None and not isinstance(api_key, str):
        raise ConfigurationError(f"{where} must be a string or None, got {type(api_key).__name__}")
    try:
        check_key_text(api_key)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None


def check_key_text(api_key: str | None) -> None:
    r"""Reject a key that cannot be sent in a header (the message never shows it).

    Raises:
        ConfigurationError: If the key holds whitespace, control or non-ASCII characters
            (a key file or secret with a trailing newline, say).

    Examples:
        >>> check_key_text("sk-abc123")
        >>> check_key_text("sk-abc\n")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: the API key holds a space, a control or a non-ASCII character ...
    """  # noqa: E501
    if api_key is None:
        return
    if not isinstance(api_key, str):
        raise ConfigurationError(f"the API key must be a string, got {type(api_key).__name__}")
    if not api_key.isascii() or not api_key.isprintable() or any(c.isspace() for c in api_key):
        raise ConfigurationError(
            "the API key holds a space, a control or a non-ASCII character (a trailing "
            "newline from a file or secret?); give the key alone"
        )
