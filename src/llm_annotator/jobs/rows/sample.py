"""A trial run on part of the input: the first ``limit`` rows, or ``limit`` rows drawn
with a seed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from llm_annotator.errors import ConfigurationError
from llm_annotator.jobs.rows.inputs import Row, RowSource


@dataclass(frozen=True, slots=True)
class Sample:
    """Which rows of the input a job takes.

    Without a ``limit`` every row. With one, the first ``limit`` rows, or, with a
    ``shuffle_seed`` as well, ``limit`` rows spread over the whole input, the same ones
    for the same seed and input (Knuth's selection sampling on ``random.random``, whose
    sequence for a seed Python keeps from version to version).

    Attributes:
        limit: Rows to take at most, or None for all.
        shuffle_seed: Draw the rows with this seed instead of taking the first ones.

    Examples:
        >>> Sample(3).positions(10)
        [0, 1, 2]
        >>> Sample(3, shuffle_seed=7).positions(10) == Sample(3, shuffle_seed=7).positions(10)
        True
        >>> len(set(Sample(3, shuffle_seed=7).positions(10)))
        3
        >>> Sample(0)
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: limit must be a positive number of rows, got 0
    """

    limit: int | None = None
    shuffle_seed: int | None = None

    def __post_init__(self) -> None:
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            raise ConfigurationError(f"limit must be a positive number of rows, got {self.limit!r}")
        if self.shuffle_seed is not None:
            if isinstance(self.shuffle_seed, bool) or not isinstance(self.shuffle_seed, int):
                raise ConfigurationError(f"shuffle_seed must be an int, got {self.shuffle_seed!r}")
            if self.limit is None:
                raise ConfigurationError(
                    "shuffle_seed chooses which rows a limit takes; give limit too (CLI "
                    "--limit N --shuffle-seed S)"
                )

    @property
    def everything(self) -> bool:
        """Whether every row is taken."""
        return self.limit is None

    def fingerprint(self, total: int) -> dict[str, Any] | None:
        """What the job's fingerprint records of the sample of an input of ``total``
        rows: None for every row (so a full run's fingerprint is what it was before
        samples existed); with a seed, the input's size too, since the rows drawn depend
        on it (a resumed trial on an input that grew would draw others).

        Examples:
            >>> Sample(5).fingerprint(100)
            {'limit': 5, 'shuffle_seed': None}
            >>> Sample(5, 1).fingerprint(100)
            {'limit': 5, 'shuffle_seed': 1, 'input_rows': 100}
        """
        if self.limit is None:
            return None
        if self.shuffle_seed is None:
            return {"limit": self.limit, "shuffle_seed": None}
        return {"limit": self.limit, "shuffle_seed": self.shuffle_seed, "input_rows": total}

    def size(self, total: int) -> int:
        """Rows taken from an input of ``total`` rows."""
        return total if self.limit is None else min(self.limit, total)

    def chosen(self, total: int) -> Iterator[bool]:
        """For each position of an input of ``total`` rows, whether it is taken."""
        take = self.size(total)
        if self.shuffle_seed is None:
            for position in range(total):
                yield position < take
            return
        draw = random.Random(self.shuffle_seed).random
        left = total
        for _ in range(total):
            pick = draw() * left < take
            take -= pick
            left -= 1
            yield pick

    def positions(self, total: int) -> list[int]:
        """The positions taken from an input of ``total`` rows, in order."""
        return [p for p, taken in enumerate(self.chosen(total)) if taken]

    def rows(self, source: RowSource, total: int) -> Iterator[Row]:
        """The rows of ``source`` (``total`` rows, from its scan) that are taken."""
        if self.limit is None:
            yield from source
            return
        take = self.size(total)
        chosen = self.chosen(total)
        for row in source:
            if take == 0:
                return  # the rest of the input need not be read
            if next(chosen, False):
                take -= 1
                yield row

    def describe(self) -> str:
        """The sample in words, for messages.

        Examples:
            >>> Sample(100, 7).describe()
            '100 rows drawn with shuffle_seed 7'
        """
        if self.limit is None:
            return "every row"
        if self.shuffle_seed is None:
            return f"the first {self.limit} rows"
        return f"{self.limit} rows drawn with shuffle_seed {self.shuffle_seed}"
