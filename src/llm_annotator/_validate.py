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
