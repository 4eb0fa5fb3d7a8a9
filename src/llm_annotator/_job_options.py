"""The options of an annotation job, each declared once.

One entry per option says everything the library's surfaces need of it: its default,
what it does (the documentation of :meth:`~llm_annotator.Annotator.annotate`), whether
the job's fingerprint records it, how ``llm-annotator run`` reads it (its flag, the key
of a job file and of a pipeline file), and whether a pipeline step takes it. The types
are the fields of :class:`~llm_annotator.jobs.spec.JobSpec`, which takes its defaults
from here; the command line builds its job flags from here, the pipeline its step keys.

This module imports no layer: declaring ``llm-annotator run`` (its ``--help``) reads it
without loading the job layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType
from typing import Any

from llm_annotator._constants import MAX_REGENERATIONS


@dataclass(frozen=True, slots=True)
class JobOption:
    """One job option, declared once.

    Args:
        name: Its keyword: a field of ``JobSpec``, a key of ``JobArgs``.
        default: Its value when not given.
        doc: What it does, as :meth:`~llm_annotator.Annotator.annotate` documents it.
        fingerprinted: Whether the job's fingerprint records it: resuming a run
            directory with another value is refused unless forced.
        reads: How ``llm-annotator run`` reads it: the kind of its setting (a
            converter of ``cli.settings``: ``"text"``, ``"texts"``, ``"bool"``,
            ``"count"``, ``"positive_int"``, ``"seed"``, ``"seconds"``, ``"size"``,
            ``"retry_errors"``, ``"hook"`` for ``MODULE:FUNCTION``, ``"shard"``);
            ``"sampling"`` when the command's sampling settings and output schema make
            it; None when only Python gives it.
        flag: The name of its setting (``--flag-name``, a file's ``flag_name``) when
            it is not the option's own name.
        flag_help: That setting's help.
        in_step: Whether a pipeline step takes it (a ``Step`` field, a step's key);
            a pipeline refuses the others by name.
    """

    name: str
    default: Any
    doc: str
    _: KW_ONLY
    fingerprinted: bool
    reads: str | None  # said for each option: None is a choice, not an omission
    in_step: bool  # the same
    flag: str | None = None
    flag_help: str = ""

    @property
    def setting(self) -> str | None:
        """The name of its own setting of ``llm-annotator run`` (None: it has none)."""
        if self.reads is None or self.reads == "sampling":
            return None
        return self.flag or self.name


JOB_OPTIONS: tuple[JobOption, ...] = (
    JobOption(
        "system_message",
        None,
        "A system message for every row, or None.",
        fingerprinted=True,
        reads="text",
        flag_help="a system message for every row",
        in_step=True,
    ),
    JobOption(
        "id_column",
        None,
        "The column holding each row's id; None numbers rows by position.",
        fingerprinted=True,
        reads="text",
        flag_help="column with each row's id (default: the row's position)",
        in_step=True,
    ),
    JobOption(
        "options",
        None,
        "The client's runtime options (e.g. ``VLLMOnlineRuntimeOptions``); an "
        "``output_schema`` there makes answers parsed and validated.",
        fingerprinted=True,
        reads="sampling",
        in_step=True,
    ),
    JobOption(
        "gen_kwargs",
        None,
        "Raw request parameters that override ``options``.",
        fingerprinted=True,
        reads=None,
        in_step=True,
    ),
    JobOption(
        "columns",
        None,
        "The input columns to keep in the output; None keeps all.",
        fingerprinted=True,
        reads="texts",
        flag_help="input columns to keep in the output (default: all)",
        in_step=True,
    ),
    JobOption(
        "retry_errors",
        False,
        "Send again the rows whose result is an error: True for every error row, or a "
        'list of error types (``["read_timeout", "server_error"]``) for those only.',
        fingerprinted=False,
        reads="retry_errors",
        flag_help="send again the rows that ended in error; with TYPEs (read_timeout "
        "server_error ...) only those whose error type is one of them",
        in_step=True,
    ),
    JobOption(
        "force",
        False,
        "Resume even if the directory was made with other settings (a trial run on a "
        "``limit`` included: the full run then keeps its rows).",
        fingerprinted=False,
        reads="bool",
        flag_help="resume even if the directory was made with other settings",
        in_step=False,
    ),
    JobOption(
        "write_jsonl",
        False,
        "Also write ``annotations.jsonl``.",
        fingerprinted=False,
        reads="bool",
        flag="jsonl",
        flag_help="also write annotations.jsonl",
        in_step=True,
    ),
    JobOption(
        "max_regenerations",
        MAX_REGENERATIONS,
        "With an output schema or ``validate``, times an invalid or truncated answer is "
        "generated again before it is kept as an error row.",
        fingerprinted=False,
        reads="count",
        flag_help=f"with a schema: retries of invalid answers (default {MAX_REGENERATIONS})",
        in_step=True,
    ),
    JobOption(
        "limit",
        None,
        "A trial run: annotate only the first ``limit`` rows (with ``shuffle_seed``, "
        "``limit`` rows drawn from the whole input). Recorded in the fingerprint, so a "
        "later full run in the same directory is refused unless ``force`` is given; "
        "then it resumes, keeping the rows done.",
        fingerprinted=True,
        reads="positive_int",
        flag_help="a trial run: annotate only the first LIMIT rows",
        in_step=False,
    ),
    JobOption(
        "shuffle_seed",
        None,
        "With ``limit``: draw the rows with this seed (the same rows for the same seed "
        "and input) instead of taking the first ones.",
        fingerprinted=True,
        reads="seed",
        flag_help="with --limit: draw the rows with this seed, not the first ones",
        in_step=False,
    ),
    JobOption(
        "validate",
        None,
        "Your own answer check: called with the answer text, it returns the parsed "
        "value (a dict becomes columns, anything else the column ``validated``) or "
        "raises; an answer it refuses is generated again, as one that does not follow "
        "the output schema, then kept as an ``invalid_output`` error row. Recorded by "
        "name in the fingerprint.",
        fingerprinted=True,
        reads="hook",
        flag_help="MODULE:FUNCTION or FILE.py:FUNCTION, your answer check: it gets the "
        "answer text and returns the parsed value (a dict becomes columns) or raises "
        "(the answer is generated again, then an invalid_output error row)",
        in_step=True,
    ),
    JobOption(
        "shard",
        None,
        '``(index, count)``, ``"INDEX/COUNT"`` or ``"auto"``: this process takes only '
        "the rows whose id hashes to shard ``index`` of ``count``, kept in "
        "``output_dir/shard-IIII-of-NNNN``; the last shard to finish merges them all "
        "into ``output_dir`` (see :mod:`llm_annotator.jobs.shards.shard` and "
        ":func:`llm_annotator.jobs.merge`). A corpus is split by unit instead; "
        '``"claim"`` makes this process one of any number of workers that take a '
        "corpus's units by claims.",
        fingerprinted=False,
        reads="shard",
        flag_help="take only this shard's rows: INDEX/COUNT, auto (a SLURM array task) or "
        "auto/COUNT (a Kubernetes Indexed Job); the last shard to finish merges them. For "
        "a corpus, also claim: any number of workers take its units one at a time",
        in_step=False,
    ),
    JobOption(
        "skip_bad_files",
        False,
        "In a corpus, leave out a file that cannot be read, listed with why in the "
        "manifest, instead of stopping.",
        fingerprinted=False,
        reads="bool",
        flag_help="in a corpus, leave out a file that cannot be read, listed in the manifest",
        in_step=True,
    ),
    JobOption(
        "claim_lease",
        None,
        'With ``shard="claim"``: seconds a claim lasts unrenewed before another worker '
        "takes the unit over (default 60).",
        fingerprinted=False,
        reads="seconds",
        flag_help="with --shard claim: seconds a worker's claim on a unit lasts unrenewed "
        "before another worker takes the unit over (default 60)",
        in_step=False,
    ),
    JobOption(
        "unit_size",
        None,
        'In a corpus (and one file with ``shard="claim"``): the size in bytes (or '
        '``"64M"``) above which a file is cut into units: a Parquet file into runs of '
        "row groups, an uncompressed JSONL file with an ``id_column`` into byte ranges, "
        "each read alone (default 256 MiB). A run keeps the size it began with.",
        fingerprinted=False,
        reads="size",
        flag_help="for a corpus, or one file with --shard claim: files larger than this "
        "(bytes, or 64M, 1G) are cut into units: Parquet by row groups, uncompressed "
        "JSONL with an --id-column by byte ranges, each read alone (default 256M)",
        in_step=False,
    ),
    JobOption(
        "group_by",
        None,
        "With a pool's ``prefix_affinity``: the column whose value groups rows that "
        "share a long prompt prefix (a document id), so that a group goes to one server "
        "and meets its prefix cache. By default a row's group is the value of the "
        "template's first field. Not part of the fingerprint: it changes where rows go, "
        "not their answers.",
        fingerprinted=False,
        reads="text",
        flag_help="with --prefix-affinity: the column that groups rows sharing a long "
        "prefix (a document id); default: the value of the template's first field",
        in_step=True,
    ),
    JobOption(
        "postprocess",
        None,
        "Called with each accepted answer: the row's input columns and the answer (the "
        "parsed values with an output schema or ``validate``, else the text); the dict "
        "it returns adds columns to the row's output. An exception it raises makes the "
        "answer invalid, as a ``validate`` refusal does. Recorded by name in the "
        "fingerprint.",
        fingerprinted=True,
        reads=None,
        in_step=True,
    ),
)
"""Every job option, in the order of ``JobSpec``'s fields."""

OPTIONS: Mapping[str, JobOption] = MappingProxyType({o.name: o for o in JOB_OPTIONS})
"""The job options by name."""

STEP_OPTIONS: tuple[str, ...] = tuple(o.name for o in JOB_OPTIONS if o.in_step)
"""The job options a pipeline step takes (each a ``Step`` field of the same default)."""
