"""What an annotation job produced."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class AnnotationResult:
    """What an annotation job produced.

    Attributes:
        output_dir: The run directory.
        output_path: ``annotations.parquet``: one row per input id, sorted by id; for a
            corpus, the folder ``annotations/`` of one Parquet file per unit.
        jsonl_path: ``annotations.jsonl`` when asked for, else None.
        report_path: ``report.json``: counts, token rates, per-server statistics.
        num_rows: Rows in the consolidated output.
        num_succeeded: Rows with an answer.
        num_failed: Error rows (their ``error`` and ``error_type`` say why).
        num_resumed: Rows already done by an earlier run of the same job.
        num_sent: Rows sent to the model by this run (regenerations not counted).
        seconds: Wall time of this run.
        merged_path: For a shard (``shard=``): the whole job's ``annotations.parquet``
            in the run directory if this shard was the last to finish and merged them
            all, else None.
        num_left_out: Results in the run directory of rows that are not in this
            input (kept from a run over another input, resumed with ``force``), left
            out of the output.
    """

    output_dir: Path
    output_path: Path
    jsonl_path: Path | None
    report_path: Path
    num_rows: int
    num_succeeded: int
    num_failed: int
    num_resumed: int
    num_sent: int
    seconds: float
    merged_path: Path | None = None
    num_left_out: int = 0
