"""What changed in a resumed job's input since its run directory's results were made.

Each record holds a hash of the row it was made from (``_input_hash``), so a job that
resumes compares its input with them row by row: an id the directory has no record of
is new and sent; a row whose content is the one its latest record was made from is
kept; a row whose content changed is sent again, after the user agreed (``force``)
when that replaces an answer rather than an error; and ids of the directory that left
the input stay out of the output, counted. Records of rows whose content changed are
*stale*: the consolidation never lets one win over the row's new record.

Records written before contents were recorded hold none (0): their rows count as
unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_annotator.jobs.ids import RowId, mix_hashes
from llm_annotator.jobs.rundir.store import StoredRecords

__all__ = ["EXAMPLES", "InputChanges", "compare"]

EXAMPLES = 5
"""Changed ids named in a refusal at most."""
_CHUNK = 1 << 14
"""Input rows compared at once."""
_CANDIDATES = 64
"""Changed rows kept (id, hash) to name the first few of those whose answers change."""

_Hashes = np.ndarray[Any, np.dtype[np.uint64]]


@dataclass(frozen=True, slots=True)
class InputChanges:
    """A resumed job's input against its run directory's records.

    Attributes:
        rows: Input rows compared.
        done: Of those, rows done already that stay done (unchanged).
        keep: The input's id hashes, sorted (what the consolidation keeps).
        redo: Id hashes (sorted) of rows whose content changed since their latest
            record: sent again.
        replaced: How many of those have an answer (not only errors): replacing them
            needs the user's agreement.
        examples: The first changed ids (at most :data:`EXAMPLES`, in input order) of
            those with an answer, else of any.
        stale: Keys (:func:`~llm_annotator.jobs.ids.mix_hashes`, sorted, unique) of the
            records made from content the input no longer holds.
        demoted: Id hashes (sorted) of rows sent again already whose every answer is
            stale: their latest error decides whether they are done.
        left_out: Ids with records that are not in the input.
        unknown: Input rows whose latest record holds no content hash (written before
            contents were recorded): counted as unchanged.
    """

    rows: int
    done: int
    keep: _Hashes
    redo: _Hashes
    replaced: int
    examples: tuple[RowId, ...]
    stale: _Hashes
    demoted: _Hashes
    left_out: int
    unknown: int = 0

    @property
    def changed(self) -> int:
        """Rows whose content changed since their latest record."""
        return len(self.redo)


def compare(rows: Iterable[tuple[RowId, int, int, bool]], stored: StoredRecords) -> InputChanges:
    """Compare an input, as ``(id, id hash, content hash, done)`` per row (done: the
    store counts it done), with the records.

    Examples:
        >>> import numpy as np
        >>> u = lambda *v: np.array(v, dtype=np.uint64)
        >>> stored = StoredRecords(u(1, 2, 3), u(10, 20, 30), np.array([True, True, False]))
        >>> rows = [("a", 1, 10, True), ("b", 2, 21, True), ("d", 4, 40, False)]
        >>> changes = compare(rows, stored)
        >>> changes.done, changes.changed, changes.replaced, changes.examples, changes.left_out
        (1, 1, 1, ('b',), 1)
    """
    last_ids, last_contents = _latest(stored)
    id_chunks: list[_Hashes] = []
    content_chunks: list[_Hashes] = []
    candidates: list[tuple[RowId, int]] = []  # the first changed rows, in input order
    batch: list[tuple[RowId, int, int, bool]] = []
    count = done = 0

    def compare_batch() -> None:
        nonlocal done
        ids = np.fromiter((row[1] for row in batch), dtype=np.uint64, count=len(batch))
        contents = np.fromiter((row[2] for row in batch), dtype=np.uint64, count=len(batch))
        finished = np.fromiter((row[3] for row in batch), dtype=bool, count=len(batch))
        id_chunks.append(ids)
        content_chunks.append(contents)
        if not len(last_ids):
            done += int(np.count_nonzero(finished))
            return
        at = np.minimum(np.searchsorted(last_ids, ids), len(last_ids) - 1)
        found = last_ids[at] == ids
        recorded = last_contents[at]
        changed = found & (recorded != 0) & (recorded != contents)
        done += int(np.count_nonzero(finished & ~changed))
        for index in np.flatnonzero(changed)[: _CANDIDATES - len(candidates)].tolist():
            candidates.append((batch[index][0], batch[index][1]))

    for row in rows:
        batch.append(row)
        count += 1
        if len(batch) == _CHUNK:
            compare_batch()
            batch = []
    if batch:
        compare_batch()
    ids = np.concatenate(id_chunks) if id_chunks else np.zeros(0, dtype=np.uint64)
    contents = np.concatenate(content_chunks) if content_chunks else ids.copy()
    order = np.argsort(ids, kind="stable")
    ids, contents = ids[order], contents[order]
    current = _lookup(ids, contents, stored.ids)
    stale = (current != 0) & (stored.contents != 0) & (stored.contents != current)
    now = _lookup(ids, contents, last_ids)
    changed = (now != 0) & (last_contents != 0) & (last_contents != now)
    redo = last_ids[changed]
    stale_answers = np.unique(stored.ids[stale & stored.ok])
    fresh_answers = np.unique(stored.ids[stored.ok & ~stale & (current != 0)])
    replacing = np.isin(redo, stale_answers)
    replaced = int(np.count_nonzero(replacing))
    wanted = set(redo[replacing].tolist()) if replaced else set(redo.tolist())
    examples = [row_id for row_id, hashed in candidates if hashed in wanted][:EXAMPLES]
    demoted = np.setdiff1d(np.setdiff1d(stale_answers, fresh_answers), redo)
    present = now != 0
    return InputChanges(
        rows=count,
        done=done,
        keep=ids,
        redo=redo,
        replaced=replaced,
        examples=tuple(examples),
        stale=np.unique(mix_hashes(stored.ids[stale], stored.contents[stale])),
        demoted=demoted,
        left_out=int(len(last_ids) - np.count_nonzero(present)),
        unknown=int(np.count_nonzero(present & (last_contents == 0))),
    )


def _latest(stored: StoredRecords) -> tuple[_Hashes, _Hashes]:
    """Per id (sorted): the content hash of its latest record."""
    order = np.argsort(stored.ids, kind="stable")
    ids, contents = stored.ids[order], stored.contents[order]
    if not len(ids):
        return ids, contents
    starts = np.flatnonzero(np.append(True, ids[1:] != ids[:-1]))
    ends = np.append(starts[1:], len(ids)) - 1
    return ids[starts], contents[ends]


def _lookup(ids: _Hashes, contents: _Hashes, wanted: _Hashes) -> _Hashes:
    """The content hash of each wanted id in the input (``ids`` sorted), 0 if absent.
    Content hashes are never 0 (:func:`~llm_annotator.jobs.ids.content_hash`)."""
    if not len(ids):
        return np.zeros(len(wanted), dtype=np.uint64)
    at = np.minimum(np.searchsorted(ids, wanted), len(ids) - 1)
    return np.where(ids[at] == wanted, contents[at], np.uint64(0))
