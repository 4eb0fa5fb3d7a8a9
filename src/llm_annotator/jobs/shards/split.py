"""Which units of a corpus each static shard takes.

The rule, ``bytes-contiguous``: the units in their order (the files sorted by name, a
cut Parquet file's parts in order) are laid end to end by size, and a unit goes to the
shard whose slice of the whole holds the unit's middle byte. Every unit goes to exactly
one shard; each shard reads a contiguous run of units, about ``1/count`` of the bytes,
off by at most one unit; the split depends only on the corpus's listing and the count,
both recorded in the run, so every process of a job computes the same one.
"""

from __future__ import annotations

from collections.abc import Sequence

from llm_annotator.jobs.rows.corpus import Unit

SPLIT_RULE = "bytes-contiguous/1"
"""The rule's name as a run records it (a later rule gets another name)."""


def shard_of_units(sizes: Sequence[int], count: int) -> list[int]:
    """The shard of each unit, given the units' sizes in bytes.

    A unit counts one byte more than its size, so that empty files are spread too.

    Examples:
        >>> shard_of_units([10, 10, 10, 10], 2)
        [0, 0, 1, 1]
        >>> shard_of_units([100, 1, 1, 1], 2)
        [0, 1, 1, 1]
        >>> shard_of_units([5], 3)
        [1]
        >>> shard_of_units([0, 0, 0, 0, 0, 0], 3)
        [0, 0, 1, 1, 2, 2]
    """
    if count < 1:
        raise ValueError(f"the count of shards must be at least 1, got {count}")
    weights = [size + 1 for size in sizes]
    total = sum(weights)
    shards, before = [], 0
    for weight in weights:
        middle2 = 2 * before + weight  # twice the middle byte's place: integers only
        shards.append(min(count - 1, middle2 * count // (2 * total)))
        before += weight
    return shards


def units_of_shard(units: Sequence[Unit], index: int, count: int) -> list[Unit]:
    """The units shard ``index`` of ``count`` takes.

    Examples:
        >>> from llm_annotator.jobs.rows.corpus import CorpusFile
        >>> files = [CorpusFile(f"f{i}.jsonl", "", 100, 0) for i in range(5)]
        >>> units = [Unit(i, f, size=f.size) for i, f in enumerate(files)]
        >>> [[u.name for u in units_of_shard(units, i, 2)] for i in range(2)]
        [['f0.jsonl', 'f1.jsonl'], ['f2.jsonl', 'f3.jsonl', 'f4.jsonl']]
    """
    owners = shard_of_units([unit.size for unit in units], count)
    return [unit for unit, owner in zip(units, owners, strict=True) if owner == index]
