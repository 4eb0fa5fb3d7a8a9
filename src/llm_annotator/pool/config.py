"""The pool's settings: one frozen, validated object instead of fourteen loose ones."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from llm_annotator import _constants as default
from llm_annotator._validate import (
    non_negative_int,
    one_of,
    positive_int,
    positive_seconds,
)
from llm_annotator.errors import ConfigurationError
from llm_annotator.response import ON_ERROR_VALUES, OnError


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """What a :class:`~llm_annotator.VLLMQueueAnnotator` is set to; see its arguments.

    Every field is checked when the object is made (seconds are stored as floats); change
    one with ``dataclasses.replace``, which checks again.

    Raises:
        ConfigurationError: For the first setting out of range, naming it.

    Examples:
        >>> PoolConfig().batch_size
        256
        >>> PoolConfig(max_sample_retries=-1)
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: max_sample_retries must be an integer >= 0, got -1
    """

    model: str | None = None
    batch_size: int = default.BATCH_SIZE
    max_concurrent_batches_per_client: int = default.MAX_CONCURRENT_BATCHES
    timeout: float = default.TIMEOUT
    connect_timeout: float = default.CONNECT_TIMEOUT
    health_check_interval: float = default.HEALTH_CHECK_INTERVAL
    health_check_timeout: float = default.HEALTH_CHECK_TIMEOUT
    max_failed_health_checks: int = default.MAX_FAILED_HEALTH_CHECKS
    max_sample_evictions: int = default.MAX_SAMPLE_EVICTIONS
    max_sample_retries: int = default.MAX_SAMPLE_RETRIES
    all_down_timeout: float = default.ALL_DOWN_TIMEOUT
    on_error: OnError = "warn"
    hedge_tail: bool = True
    max_response_bytes: int = default.MAX_RESPONSE_BYTES
    max_server_faults: int = default.MAX_SERVER_FAULTS
    stall_window: float = default.STALL_WINDOW
    adaptive: bool = False
    prefix_affinity: bool = False

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings' names, in order (each is also an argument of the pool)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigurationError(
                f"model must be a non-empty string or None, got {self.model!r}"
            )
        for name in (
            "batch_size",
            "max_concurrent_batches_per_client",
            "max_failed_health_checks",
            "max_sample_evictions",
            "max_response_bytes",
            "max_server_faults",
        ):
            positive_int(name, getattr(self, name))
        non_negative_int("max_sample_retries", self.max_sample_retries)
        for name in ("timeout", "connect_timeout"):  # per request: must be finite
            object.__setattr__(self, name, positive_seconds(name, getattr(self, name)))
        for name in (
            "health_check_interval",
            "health_check_timeout",
            "all_down_timeout",
            "stall_window",
        ):
            value = getattr(self, name)  # float("inf") allowed: never / wait for ever
            if not (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and value > 0
                and not math.isnan(value)
            ):
                raise ConfigurationError(
                    f"{name} must be a positive number of seconds, got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        one_of("on_error", self.on_error, ON_ERROR_VALUES)
        object.__setattr__(self, "hedge_tail", bool(self.hedge_tail))
        object.__setattr__(self, "adaptive", bool(self.adaptive))
        object.__setattr__(self, "prefix_affinity", bool(self.prefix_affinity))


class FromConfig:
    """An attribute of the pool that is one field of its :class:`PoolConfig`, read-only.

    Reading it reads the config. Setting it raises :class:`AttributeError`: the
    settings are fixed when a pool is made (its clients, limits and windows are built
    from them), so ``pool.batch_size = 64`` would change nothing; build a new pool.
    """

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return getattr(instance.config, self.name)

    def __set__(self, instance: Any, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is fixed when a pool is made: build a new "
            f"{type(instance).__name__}(..., {self.name}={value!r}) instead"
        )
