"""Annotation jobs: rows in, prompts rendered, answers checked, results stored once.

The job layer is in rooms, each of which imports only the ones below it (the import
contract in ``pyproject.toml`` holds them to it):

- :mod:`~llm_annotator.jobs.annotate` (the :class:`Annotator`) and
  :mod:`~llm_annotator.jobs.run_report` (the HTML report): what a user calls;
- :mod:`~llm_annotator.jobs.corpus` (a job of units) and
  :mod:`~llm_annotator.jobs.run_directory` (the one reader of run directories);
- :mod:`~llm_annotator.jobs.shards`: one job over many processes;
- :mod:`~llm_annotator.jobs.loop`: one run in this process;
- :mod:`~llm_annotator.jobs.watch`: seeing a run while it goes;
- :mod:`~llm_annotator.jobs.rundir`: the run directory on disk;
- :mod:`~llm_annotator.jobs.rows` (what goes in) and
  :mod:`~llm_annotator.jobs.answers` (what comes back);
- :mod:`~llm_annotator.jobs.spec`, :mod:`~llm_annotator.jobs.ids`,
  :mod:`~llm_annotator.jobs.files` and :mod:`~llm_annotator.jobs.protocols`: what
  they all share.

The names below are the documented ones; they are imported on first use (PEP 562), so
``llm-annotator status`` reads a run directory without loading the pool and its network
client. The modules' paths of the flat layout (``llm_annotator.jobs.store`` and so on)
still import, with a :class:`DeprecationWarning`, for one release.
"""

from typing import TYPE_CHECKING

from llm_annotator._lazy import lazy_names, moved_modules

if TYPE_CHECKING:
    from llm_annotator.jobs.annotate import AnnotationResult, Annotator
    from llm_annotator.jobs.answers.schema import OutputSchema
    from llm_annotator.jobs.rows.prompts import PromptTemplate
    from llm_annotator.jobs.rows.sample import Sample
    from llm_annotator.jobs.run_directory import RunDirectory
    from llm_annotator.jobs.run_report import RunSeries, run_series, write_html_report
    from llm_annotator.jobs.shards.merge import (
        Merged,
        ShardState,
        merge,
        merge_if_complete,
        shard_states,
    )
    from llm_annotator.jobs.shards.shard import Shard
    from llm_annotator.jobs.spec import JobArgs
    from llm_annotator.jobs.watch.status import RunStatus, run_status
    from llm_annotator.jobs.watch.timeline import (
        RunRecord,
        read_timeline,
        tick_interval,
        ticks_within,
    )

_NAMES = {
    "llm_annotator.jobs.annotate": ["AnnotationResult", "Annotator"],
    "llm_annotator.jobs.answers.schema": ["OutputSchema"],
    "llm_annotator.jobs.rows.prompts": ["PromptTemplate"],
    "llm_annotator.jobs.rows.sample": ["Sample"],
    "llm_annotator.jobs.run_directory": ["RunDirectory"],
    "llm_annotator.jobs.run_report": ["RunSeries", "run_series", "write_html_report"],
    "llm_annotator.jobs.shards.merge": [
        "Merged",
        "ShardState",
        "merge",
        "merge_if_complete",
        "shard_states",
    ],
    "llm_annotator.jobs.shards.shard": ["Shard"],
    "llm_annotator.jobs.spec": ["JobArgs"],
    "llm_annotator.jobs.watch.status": ["RunStatus", "run_status"],
    "llm_annotator.jobs.watch.timeline": [
        "RunRecord",
        "read_timeline",
        "tick_interval",
        "ticks_within",
    ],
}
__getattr__, __dir__ = lazy_names(
    __name__, {name: module for module, names in _NAMES.items() for name in names}
)
__all__ = [
    "AnnotationResult",
    "Annotator",
    "JobArgs",
    "Merged",
    "OutputSchema",
    "PromptTemplate",
    "RunDirectory",
    "RunRecord",
    "RunSeries",
    "RunStatus",
    "Sample",
    "Shard",
    "ShardState",
    "merge",
    "merge_if_complete",
    "read_timeline",
    "run_series",
    "run_status",
    "shard_states",
    "tick_interval",
    "ticks_within",
    "write_html_report",
]

# The flat layout's module paths, each to its room (one release).
moved_modules(
    __name__,
    {
        "inputs": "rows.inputs",
        "sample": "rows.sample",
        "prompts": "rows.prompts",
        "schema": "answers.schema",
        "records": "answers.records",
        "store": "rundir.store",
        "fingerprint": "rundir.fingerprint",
        "consolidate": "rundir.consolidate",
        "progress": "watch.progress",
        "timeline": "watch.timeline",
        "status": "watch.status",
        "live_metrics": "watch.live_metrics",
        "runner": "loop.runner",
        "streaming": "loop.streaming",
        "interrupt": "loop.interrupt",
        "report": "loop.summary",
        "shard": "shards.shard",
        "merge": "shards.merge",
    },
)
del TYPE_CHECKING, lazy_names, moved_modules
