"""A pipeline: steps run in order over one output directory, each a resumable job.

The output directory holds::

    OUTPUT_DIR/
        pipeline.json          what each step ran with (its key and settings), and how far
        report.json            each step's figures, written after every run
        inputs/NAME.jsonl      a step's rows, written before its job (see pipeline.inputs)
        inputs/NAME/           ... one file per unit, when they come from a corpus
        steps/NAME/            the step's run directory: a job like ``llm-annotator run``'s
        fleet/GROUP/           elastic workers counting each other, by server group

Run alone, a step starts when the step it reads is done (its input is then complete
and fixed, so resuming it reads the very rows it began with).

**Elastic workers** (``shard="claim"``, ``llm-annotator pipeline run FILE --shard claim``
or ``--processes N``): any number of processes, started at any time on hosts sharing
the directory, run the same pipeline. Each step's job takes its input's units by claims
(:mod:`llm_annotator.jobs.corpus`), so the workers share every step and a worker that
dies leaves its units to the others after a lease. A worker takes turns at the steps
(:mod:`~llm_annotator.pipeline.turns`): it goes on to the next step as soon as it can
take no unit of this one now. A step that reads a step has one unit per unit of it,
which starts once that unit is finished, its rows written then by the worker that
claims it (``inputs/NAME/<unit>.jsonl``): the steps stream, unit by unit. The workers
count each other by server group in ``OUTPUT_DIR/fleet/<group>/`` to share each
server's budget, whatever step each is in. What a step writes before its job (its
rows in ``inputs/``, when they are written whole) and the pipeline's records are
written by one worker at a time, under ``OUTPUT_DIR/.steps.lock`` (an ``flock``, let go when its
holder dies). Workers hold ``.lock`` shared, so a run that is not elastic (which holds it
alone) and workers never mix; nor do workers redo steps (``force``, ``redo``, a step
made stale): run the pipeline once without claims for that, then start them.

The directory is shared ground, as a job's is (see ``jobs.files``): before any step
sends a request, every name the pipeline or a step's job writes, for every step, is
checked, and a link, a FIFO, a device or a folder where a file goes is refused with one
line naming it (:class:`RunDirectoryError`); nothing is written through a link.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import orjson
import structlog

from llm_annotator._constants import STOP_GRACE
from llm_annotator.clients.base import Client
from llm_annotator.errors import (
    ConfigurationError,
    FingerprintMismatchError,
    JobError,
    RunDirectoryError,
    RunInterruptedError,
)
from llm_annotator.jobs.annotate import RUN_FILES, AnnotationResult, Annotator
from llm_annotator.jobs.files import (
    check_entry,
    make_directory,
    open_file,
    read_run_file,
    refused,
)
from llm_annotator.jobs.loop.interrupt import BetweenJobs, between_jobs
from llm_annotator.jobs.loop.summary import write_json
from llm_annotator.jobs.rows.corpus import UnitFeed
from llm_annotator.jobs.run_directory import RunDirectory
from llm_annotator.jobs.rundir.fleet import FLEET_DIR, folder_name, leave_fleet
from llm_annotator.jobs.rundir.partitions import ANNOTATIONS_DIR, CORPUS_FILE, UNITS_DIR
from llm_annotator.jobs.rundir.store import LOCK_FILE, SHARDS_DIR, DirectoryLock
from llm_annotator.jobs.spec import JobArgs
from llm_annotator.jobs.watch.status import corpus_status, run_status
from llm_annotator.pipeline.inputs import (
    ID,
    data_identity,
    input_entries,
    remove_input,
    stream_names,
    unit_ready,
    write_input,
    write_unit_input,
    written_input,
)
from llm_annotator.pipeline.plan import Recorded, StepPlan, downstream, plan
from llm_annotator.pipeline.steps import Step, ordered, step_key
from llm_annotator.pipeline.turns import TURN_SECONDS, Turns

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

PIPELINE_FILE = "pipeline.json"
"""What each step ran with and how far it got."""
REPORT_FILE = "report.json"
"""Each step's figures."""
STEPS_DIR = "steps"
INPUTS_DIR = "inputs"
STEPS_LOCK = ".steps.lock"
"""Held by the one elastic worker that writes a step's rows or the records."""
LOCK_HOLDER_BYTES = 200
"""The holder's host and pid in ``.steps.lock``, padded to one length: a reader never
sees the file emptied, only one holder's words or the next one's."""
LOCK_WAIT_SAID = 10.0
"""Seconds a worker waits for ``.steps.lock`` before it says who holds it (again every
:data:`LOCK_WAIT_SAID` x 6): a holder stopped (SIGSTOP, a frozen node) stalls the others."""
CLAIM = "claim"
"""``shard="claim"``: run as one of any number of elastic workers."""
STEP_UNIT_BYTES = 1 << 20
"""The units of the rows a step writes for its job (from an earlier step, or prompts),
when workers share it: small enough that every worker gets some."""
_FORMAT = 1

_Work = tuple[
    Client[Any],
    "Mapping[str, Client[Any]] | None",
    Mapping[str, str],
    Mapping[str, dict[str, Any]],
    "bool | None",
    float,
    "float | None",
]
"""What an elastic worker's steps run with: the client, the server groups, the steps'
keys and settings, progress, stop grace and claim lease."""


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a run did with one step.

    Attributes:
        name: The step.
        action: ``run``, ``resume``, ``redo``, ``skip`` (done before, unchanged) or
            ``leave`` (not in ``steps``).
        why: Why, in words.
        output_dir: The step's run directory.
        result: Its job's result, when it ran now.
        figures: Its figures (rows, succeeded, failed, ...), now or from when it ran.
    """

    name: str
    action: str
    why: str
    output_dir: Path
    result: AnnotationResult | None
    figures: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class PipelineResult:
    """What a pipeline run did: each step, and the report."""

    output_dir: Path
    steps: tuple[StepResult, ...]
    report_path: Path


@dataclass(frozen=True, slots=True)
class StepView:
    """How a step stands, for ``llm-annotator pipeline describe``.

    Attributes:
        name: The step.
        reads: What it reads, in words.
        state: ``done``, ``begun``, ``not run``.
        next: What a run would do now (``skip``, ``resume``, ``run``, ``redo``) and why.
        rows: Rows with a result in its run directory, if it began.
        total: Rows it takes, if its job said.
        failed: Error rows, if it began.
        output_dir: Its run directory.
        units: ``(done, total)`` units of a step run as units (by workers, or over a
            corpus), else None.
    """

    name: str
    reads: str
    state: str
    next: StepPlan
    rows: int | None
    total: int | None
    failed: int | None
    output_dir: Path
    units: tuple[int, int] | None = None


class Pipeline:
    """Several annotation steps over one output directory, resumable as a whole.

    Each step is a job (see :class:`Step`) with its own run directory in
    ``output_dir/steps/``. Running the pipeline again skips the steps done with the
    same settings, resumes a step begun, and refuses (without ``force``) to redo a
    step whose settings changed, naming what changed and the steps that read it.

    Args:
        steps: The steps; a step may come before the one it reads (they run in an
            order that puts each after what it reads).
        output_dir: The pipeline's directory (created if needed).

    Raises:
        ConfigurationError: Two steps share a name, a step reads one that is not there,
            or steps read each other in a cycle.

    Examples:
        >>> pipeline = Pipeline(
        ...     [
        ...         Step("label", "Positive or negative? {text}", data="reviews.jsonl"),
        ...         Step("reason", "Why is this negative? {text}", from_step="label",
        ...              where="label_response == 'negative'"),
        ...     ],
        ...     "runs/reviews",
        ... )
        >>> [step.name for step in pipeline.steps]
        ['label', 'reason']
    """

    def __init__(self, steps: Sequence[Step], output_dir: str | os.PathLike[str]) -> None:
        self.steps = ordered(steps)
        self.output_dir = Path(output_dir)

    def __repr__(self) -> str:
        names = ", ".join(step.name for step in self.steps)
        return f"<Pipeline {str(self.output_dir)!r} steps=[{names}]>"

    def step_dir(self, name: str) -> Path:
        """The run directory of step ``name``."""
        return self.output_dir / STEPS_DIR / name

    def plan(
        self,
        *,
        steps: Sequence[str] | None = None,
        redo: Sequence[str] = (),
        force: bool = False,
    ) -> list[StepPlan]:
        """What :meth:`run` would do with each step now, and why.

        Raises:
            ConfigurationError: As :meth:`run` would, before running anything.
        """
        keys, settings = self._keys()
        return self._plan(keys, settings, steps, redo, force)

    def _plan(
        self,
        keys: Mapping[str, str],
        settings: Mapping[str, dict[str, Any]],
        steps: Sequence[str] | None,
        redo: Sequence[str],
        force: bool,
        retry: bool = True,
    ) -> list[StepPlan]:
        """:func:`~llm_annotator.pipeline.plan.plan` from the record; without ``retry``,
        a step with ``retry_errors`` that is done stays done (an elastic worker's plan
        of a step in its turns: done by another worker in this run)."""
        return plan(
            self._order(),
            keys,
            settings,
            self._recorded(),
            selected=steps,
            retrying=[step.name for step in self.steps if step.retry_errors and retry],
            redo=redo,
            force=force,
        )

    def describe(self) -> list[StepView]:
        """How each step stands, and what a run would do with it."""
        plans = {p.name: p for p in self.plan(force=True)}
        recorded = self._recorded()
        views = []
        for step in self.steps:
            record = recorded.get(step.name)
            rows = total = failed = units = None
            directory = self.step_dir(step.name)
            if record is not None:
                try:
                    if RunDirectory.open(directory).kind == "corpus":
                        said = corpus_status(directory) or {}
                        rows, failed = said.get("rows"), said.get("failed")
                        units = (int(said.get("units_done") or 0), int(said.get("units") or 0))
                        total = rows if said.get("complete") else None
                    else:
                        status = run_status(directory)
                        rows, total, failed = status.done, status.total, status.failed
                except (JobError, RunDirectoryError):
                    pass
            views.append(
                StepView(
                    name=step.name,
                    reads=step.describe_input(),
                    state=record.state if record is not None else "not run",
                    next=plans[step.name],
                    rows=rows,
                    total=total,
                    failed=failed,
                    output_dir=directory,
                    units=units,
                )
            )
        return views

    def run(
        self,
        client: Client[Any],
        *,
        servers: Mapping[str, Client[Any]] | None = None,
        steps: Sequence[str] | None = None,
        redo: Sequence[str] = (),
        force: bool = False,
        progress: bool | None = None,
        stop_grace: float = STOP_GRACE,
        handle_signals: bool = True,
        shard: str | None = None,
        claim_lease: float | None = None,
    ) -> PipelineResult:
        """Run the steps in order; skip those done, resume those begun.

        Args:
            client: The client that answers every step without ``servers``.
            servers: Clients by name, for steps that name one (a server group).
            steps: Run only these steps (each one they read must be done).
            redo: Redo these steps (and the steps that read them) whatever their
                record says: a step begun on other servers, say.
            force: Redo the steps whose settings changed, replacing their results and
                those of the steps that read them.
            progress: As for :class:`Annotator`.
            stop_grace: As for :class:`Annotator`.
            handle_signals: Turn SIGINT/SIGTERM into a clean stop (main thread only).
            shard: ``"claim"``: run as one of any number of elastic workers, which
                share each step's units (see the module); None: this process alone.
            claim_lease: For a worker, the seconds its claim on a unit lasts unrenewed
                before another takes the unit over (default 60).

        Returns:
            A :class:`PipelineResult`.

        Raises:
            ConfigurationError: Before anything runs: a step names a client not given,
                a plan that would replace results without ``force`` (see
                :meth:`plan`). During a run: a step's job was begun with other
                settings than the pipeline knows (another model): see ``redo``.
            RunDirectoryError: Before anything runs: a link, a FIFO, a device or a
                folder where the pipeline or a step's job writes a file (or a file
                where it keeps a folder), for any step.
            RunInterruptedError: A signal stopped a step (or, for a worker with
                ``handle_signals``, came between two of its jobs); everything done is
                kept, and running again resumes it.
            PoolExhaustedError: Every server stayed down during a step; likewise.
        """
        elastic = _elastic(shard)
        lock, plans, keys, settings = self._start(client, servers, steps, redo, force, elastic)
        try:
            if elastic:
                work = (client, servers, keys, settings, progress, stop_grace, claim_lease)
                return self._work(plans, work, handle_signals)
            results: list[StepResult] = []
            for step, step_plan in zip(self.steps, plans, strict=True):
                if step_plan.action in ("skip", "leave"):
                    results.append(self._kept(step, step_plan))
                    continue
                data, job = self._begin(step, step_plan, keys, settings)
                log.info("step_started", step=step.name, action=step_plan.action)
                work = (client, servers, keys, settings, progress, stop_grace, claim_lease)
                result = self._annotate(step, data, job, work, handle_signals)
                results.append(self._finish(step, step_plan, keys, settings, result))
            return self._report(results)
        finally:
            lock.release()

    async def arun(
        self,
        client: Client[Any],
        *,
        servers: Mapping[str, Client[Any]] | None = None,
        steps: Sequence[str] | None = None,
        redo: Sequence[str] = (),
        force: bool = False,
        progress: bool | None = None,
        stop_grace: float = STOP_GRACE,
        stop: asyncio.Event | None = None,
        shard: str | None = None,
        claim_lease: float | None = None,
    ) -> PipelineResult:
        """Async twin of :meth:`run`. Signals are the caller's: set ``stop`` for a
        clean stop. Cancelled, it lets the file work in hand finish before it lets go
        of the pipeline's lock."""
        elastic = _elastic(shard)
        lock, plans, keys, settings = await _settled(
            self._start, client, servers, steps, redo, force, elastic
        )
        try:
            if elastic:
                work = (client, servers, keys, settings, progress, stop_grace, claim_lease)
                return await self._awork(plans, work, stop)
            results: list[StepResult] = []
            for step, step_plan in zip(self.steps, plans, strict=True):
                if step_plan.action in ("skip", "leave"):
                    results.append(await _settled(self._kept, step, step_plan))
                    continue
                data, job = await _settled(self._begin, step, step_plan, keys, settings)
                log.info("step_started", step=step.name, action=step_plan.action)
                work = (client, servers, keys, settings, progress, stop_grace, claim_lease)
                result = await self._aannotate(step, data, job, work, stop)
                results.append(
                    await _settled(self._finish, step, step_plan, keys, settings, result)
                )
            return await _settled(self._report, results)
        finally:
            lock.release()

    def _start(
        self,
        client: Client[Any],
        servers: Mapping[str, Client[Any]] | None,
        steps: Sequence[str] | None,
        redo: Sequence[str],
        force: bool,
        elastic: bool = False,
    ) -> tuple[
        DirectoryLock | _SharedLock, list[StepPlan], dict[str, str], dict[str, dict[str, Any]]
    ]:
        """Check everything a run needs and decide each step's action, before any runs;
        hold the pipeline's lock (one process runs a pipeline at a time, or any number
        of elastic workers, which never redo a step)."""
        if elastic and (force or redo):
            raise ConfigurationError(
                "elastic workers (shard='claim', --shard claim) never redo a step, which "
                "other workers may be running: run the pipeline once without claims with "
                "--force or --redo, then start the workers"
            )
        for step in self.steps:
            self._client(step, client, servers)
            if elastic and not step.rewrites_input and not _is_files(step.data):
                raise ConfigurationError(
                    f"step {step.name} reads rows in memory, which elastic workers cannot "
                    "share (each would read its own): give it a file or a corpus"
                )
        self._check_directory()
        lock: DirectoryLock | _SharedLock
        lock = _SharedLock.acquire(self.output_dir) if elastic else _alone(self.output_dir)
        try:
            keys, settings = self._keys()
            plans = self._plan(keys, settings, steps, redo, force)
            if elastic:
                _refuse_redo(plans)
        except BaseException:
            lock.release()
            raise
        for step_plan in plans:
            log.info(
                "step_planned", step=step_plan.name, action=step_plan.action, why=step_plan.why
            )
        return lock, plans, keys, settings

    @staticmethod
    def _client(
        step: Step, client: Client[Any], servers: Mapping[str, Client[Any]] | None
    ) -> Client[Any]:
        if step.servers is None:
            return client
        if servers is None or step.servers not in servers:
            given = ", ".join(servers or {}) or "none"
            raise ConfigurationError(
                f"step {step.name} asks for the servers {step.servers!r}, which are not "
                f"given (servers given: {given})"
            )
        return servers[step.servers]

    def _keys(self) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
        """Each step's settings and key; a step's settings hold the key of the step it
        reads, so redoing a step changes the keys of all that read it."""
        keys: dict[str, str] = {}
        settings: dict[str, dict[str, Any]] = {}
        for step in self.steps:
            upstream = keys[step.from_step] if step.from_step is not None else None
            settings[step.name] = step.settings(upstream, data_identity(step))
            keys[step.name] = step_key(settings[step.name])
        return keys, settings

    def _check_directory(self) -> None:
        """Create the pipeline's directory, refusing, before any step sends a request, a
        link, a FIFO, a device or a folder where a file goes (or a file where a folder
        goes) under any name the pipeline or one of its steps' jobs writes."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        for path, folder in own_entries(self.output_dir, [step.name for step in self.steps]):
            _check_entry(path, folder)
        for entry_name in (STEPS_DIR, INPUTS_DIR, FLEET_DIR):
            make_directory(self.output_dir / entry_name)

    def _record(self) -> dict[str, Any]:
        path = self.output_dir / PIPELINE_FILE
        data = read_run_file(path)
        if data is None:
            return {"format": _FORMAT, "steps": {}}
        try:
            record = orjson.loads(data)
        except orjson.JSONDecodeError as error:
            raise RunDirectoryError(
                f"{path} is not a pipeline record ({error}); move it away to start the "
                "pipeline afresh"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("steps"), dict):
            raise RunDirectoryError(f"{path} is not a pipeline record; move it away")
        return record

    def _recorded(self) -> dict[str, Recorded]:
        found: dict[str, Recorded] = {}
        for name, entry in self._record()["steps"].items():
            if isinstance(entry, dict) and entry.get("state") in ("begun", "done", "stale"):
                state = entry["state"]
                if state == "done" and not _has_output(self.step_dir(name)):
                    state = "lost"  # its output was removed since: its job makes it again
                found[name] = Recorded(entry["key"], state, entry.get("settings", {}))
        return found

    def _order(self) -> list[tuple[str, str | None]]:
        return [(step.name, step.from_step) for step in self.steps]

    def _mark_stale(self, names: Sequence[str]) -> None:
        """Record the steps that read a step being redone as stale: their rows are no
        longer what they read, so they are redone at their next run."""
        record = self._record()
        changed = False
        for name in names:
            entry = record["steps"].get(name)
            if isinstance(entry, dict) and entry.get("state") in ("begun", "done"):
                entry["state"] = "stale"
                changed = True
        if changed:
            write_json(self.output_dir / PIPELINE_FILE, record)

    def _save(self, name: str, entry: dict[str, Any]) -> None:
        record = self._record()
        record["steps"][name] = entry
        record["format"] = _FORMAT
        write_json(self.output_dir / PIPELINE_FILE, record)

    def _begin(
        self,
        step: Step,
        step_plan: StepPlan,
        keys: Mapping[str, str],
        settings: Mapping[str, dict[str, Any]],
        streaming: bool = False,
    ) -> tuple[Any, JobArgs]:
        """Make ready to run a step: clear what a redo replaces, write its rows (or,
        ``streaming``, say how each unit's rows are written, see :meth:`_streamed`),
        record it begun; return its job's input and arguments."""
        inputs = self.output_dir / INPUTS_DIR
        entry = self._record()["steps"].get(step.name) or {}
        if step_plan.rows_change:
            self._mark_stale(downstream(self._order(), step.name))
        if step_plan.action == "redo":
            log.warning("step_redone", step=step.name, why=step_plan.why)
            directory = self.step_dir(step.name)
            if check_entry(directory, directory=True):
                shutil.rmtree(directory)
            remove_input(inputs, step)
            entry = {}
        data: Any = step.data
        columns = list(step.columns) if step.columns is not None else None
        names = self._streamed(step, entry, keys) if streaming else None
        if names is not None:  # written unit by unit, as the step it reads finishes them
            assert step.from_step is not None
            source = self.step_dir(step.from_step)
            folder = inputs / step.name
            data = UnitFeed(
                folder=folder,
                names=names,
                ready=functools.partial(unit_ready, source),
                write=functools.partial(_write_unit, step, folder, source),
                description=f"step {step.from_step}'s answers, unit by unit",
            )
            entry["input"] = {"streamed": True, "units": len(names)}
        elif step.rewrites_input:
            said = entry.get("input") if entry.get("key") == keys[step.name] else None
            if isinstance(said, dict) and said.get("streamed") and entry.get("state") == "begun":
                raise ConfigurationError(
                    f"step {step.name} was begun by elastic workers, its rows written unit "
                    "by unit as the step it reads finished them: go on with it with "
                    f"--shard claim (or --processes N), or redo it alone with --redo {step.name}"
                )
            existing = written_input(inputs, step)
            if existing is None or entry.get("key") != keys[step.name]:
                remove_input(inputs, step)
                upstream = self.step_dir(step.from_step) if step.from_step is not None else None
                written = write_input(step, inputs, upstream)
                entry["input"] = {
                    "rows": written.rows,
                    "read": written.read,
                    "columns": list(written.columns),
                }
                existing = written.data
            data = str(existing)
            if columns is None:
                columns = list(entry.get("input", {}).get("columns", []))
        begun = dict(entry)
        entry.update(key=keys[step.name], state="begun", settings=settings[step.name])
        if entry != begun:  # an elastic worker comes back to a step at every pass
            self._save(step.name, entry)
        job: JobArgs = {
            **step.job_args(),
            "id_column": ID if step.rewrites_input else step.id_column,
            "columns": columns,
            "force": False,  # the pipeline's force redoes steps; it never mixes results
            "skip_bad_files": step.skip_bad_files and not step.rewrites_input,
        }
        return data, job

    def _can_stream(self, step: Step) -> bool:
        """Whether elastic workers may run ``step`` unit by unit before the step it reads
        is done: that step retries no errors (a unit read could change after), and
        has begun as a corpus job (its units are known)."""
        upstream = next((s for s in self.steps if s.name == step.from_step), None)
        if upstream is None or upstream.retry_errors:
            return False
        return stream_names(self.step_dir(upstream.name)) is not None

    def _streamed(
        self, step: Step, entry: Mapping[str, Any], keys: Mapping[str, str]
    ) -> tuple[str, ...] | None:
        """The files of a step that elastic workers run unit by unit as the step it
        reads finishes its units (one a unit of it), or None where it cannot: a step
        that reads no step, or a step that retries errors (a unit it read could change
        after it), or one whose rows were written whole when it began, or whose step
        has not begun as a corpus job."""
        if step.reads != "step" or step.from_step is None:
            return None
        upstream = next(s for s in self.steps if s.name == step.from_step)
        if upstream.retry_errors:
            return None
        said = entry.get("input") if entry.get("key") == keys[step.name] else None
        if isinstance(said, dict) and not said.get("streamed"):
            return None  # begun with its rows written whole: it goes on so
        return stream_names(self.step_dir(step.from_step))

    @contextlib.contextmanager
    def _steps_lock(self, elastic: bool) -> Iterator[None]:
        """Hold ``.steps.lock`` while the block runs (elastic workers only): one worker
        at a time writes a step's rows and the pipeline's records. It waits for the
        holder; a holder that dies lets go with its process."""
        if not elastic:
            yield
            return
        fd = open_file(self.output_dir / STEPS_LOCK, os.O_RDWR | os.O_CREAT, single=True)
        try:
            _wait_for_lock(fd, self.output_dir / STEPS_LOCK)
            with contextlib.suppress(OSError):  # who holds it, for those who wait
                said = f"{socket.gethostname()} pid {os.getpid()}".encode()
                os.pwrite(fd, said.ljust(LOCK_HOLDER_BYTES)[:LOCK_HOLDER_BYTES], 0)
                os.fdatasync(fd)  # seen from other hosts now, not at the write-back
            yield
        finally:
            os.close(fd)  # closing lets go of the lock

    def _begin_step(
        self,
        step: Step,
        step_plan: StepPlan,
        keys: Mapping[str, str],
        settings: Mapping[str, dict[str, Any]],
        elastic: bool,
        claim_lease: float | None = None,
        turns: Turns | None = None,
    ) -> tuple[StepPlan, Any, JobArgs]:
        """:meth:`_begin`, by one worker at a time; a worker's job claims units. A
        worker plans the step again under the lock, from the record as other workers
        left it (a plan made at its start may be stale: the step done since, its rows
        written): a step done is skipped (its action ``skip``), one begun is resumed,
        and nothing done is marked stale again."""
        with self._steps_lock(elastic):
            if elastic:
                fresh = self._plan(keys, settings, None, (), False, retry=False)
                step_plan = next(p for p in fresh if p.name == step.name)
                _refuse_redo([step_plan])
                if step_plan.action == "skip":
                    return step_plan, None, {}
            data, job = self._begin(step, step_plan, keys, settings, streaming=elastic)
        if elastic:
            job["shard"] = CLAIM
            job["claim_lease"] = claim_lease
            if not isinstance(data, UnitFeed):
                if step.rewrites_input:  # the rows written for it: units every worker shares
                    job["unit_size"] = STEP_UNIT_BYTES
                data = UnitFeed(data=data)
            if turns is not None:
                last = turns.is_last(step.name)
                data = dataclasses.replace(
                    data,
                    wait=last,
                    turn=None if last else TURN_SECONDS,
                    owner=turns.owner,
                    fleet=self._fleet(step),
                )
        return step_plan, data, job

    def _work(self, plans: Sequence[StepPlan], work: _Work, handle_signals: bool) -> PipelineResult:
        """The steps, by an elastic worker: turn after turn at each step not done (see
        :mod:`~llm_annotator.pipeline.turns`)."""
        turns, done = self._turns(plans)
        try:
            with between_jobs(enabled=handle_signals) as between:
                return self._work_turns(turns, done, plans, work, handle_signals, between)
        finally:
            self._leave_fleets(turns.owner)

    def _work_turns(
        self,
        turns: Turns,
        done: dict[str, StepResult],
        plans: Sequence[StepPlan],
        work: _Work,
        handle_signals: bool,
        between: BetweenJobs,
    ) -> PipelineResult:
        """The turns; a signal between two jobs stops the worker at the next turn."""
        _, _, keys, settings, _, _, claim_lease = work
        paused = 0.0
        while (turn := turns.next()) is not None:
            between.check()
            if not isinstance(turn, str):
                self._leave_fleets(turns.owner)  # idle: the others take its share
                paused = _say_paused(turn, paused)
                between.pause(turn)
                continue
            begun = self._take_turn(turn, plans, keys, settings, claim_lease, turns, done)
            if begun is None:
                continue
            between.check()
            step, step_plan, data, job = begun
            result = self._annotate(step, data, job, work, handle_signals)
            paused = 0.0 if result.num_sent else paused
            self._end_turn(step, step_plan, keys, settings, result, turns, done)
        return self._report_step(self._in_order(done))

    async def _awork(
        self, plans: Sequence[StepPlan], work: _Work, stop: asyncio.Event | None
    ) -> PipelineResult:
        """Async twin of :meth:`_work`; the file work in a thread."""
        turns, done = await _settled(self._turns, plans)
        try:
            return await self._awork_turns(turns, done, plans, work, stop)
        finally:
            await _settled(self._leave_fleets, turns.owner)

    async def _awork_turns(
        self,
        turns: Turns,
        done: dict[str, StepResult],
        plans: Sequence[StepPlan],
        work: _Work,
        stop: asyncio.Event | None,
    ) -> PipelineResult:
        _, _, keys, settings, _, _, claim_lease = work
        paused = 0.0
        while (turn := turns.next()) is not None:
            if not isinstance(turn, str):
                await _settled(self._leave_fleets, turns.owner)  # idle: others take its share
                paused = _say_paused(turn, paused)
                await _pause(turn, stop)
                continue
            begun = await _settled(
                self._take_turn, turn, plans, keys, settings, claim_lease, turns, done
            )
            if begun is None:
                continue
            step, step_plan, data, job = begun
            result = await self._aannotate(step, data, job, work, stop)
            paused = 0.0 if result.num_sent else paused
            await _settled(self._end_turn, step, step_plan, keys, settings, result, turns, done)
        return await _settled(self._report_step, self._in_order(done))

    def _annotate(
        self, step: Step, data: Any, job: JobArgs, work: _Work, handle_signals: bool
    ) -> AnnotationResult:
        """Run ``step``'s job (or an elastic worker's turn at it) on its servers.

        Raises:
            ConfigurationError: Its directory holds results of other settings.
        """
        try:
            return self._annotator(step, work).annotate(
                data, step.template, self.step_dir(step.name), handle_signals=handle_signals, **job
            )
        except FingerprintMismatchError as error:
            raise _mismatch(step, error) from None

    async def _aannotate(
        self, step: Step, data: Any, job: JobArgs, work: _Work, stop: asyncio.Event | None
    ) -> AnnotationResult:
        """Async twin of :meth:`_annotate`."""
        try:
            return await self._annotator(step, work).aannotate(
                data, step.template, self.step_dir(step.name), stop=stop, **job
            )
        except FingerprintMismatchError as error:
            raise _mismatch(step, error) from None

    def _annotator(self, step: Step, work: _Work) -> Annotator:
        client, servers, _, _, progress, stop_grace, _ = work
        return Annotator(
            self._client(step, client, servers), progress=progress, stop_grace=stop_grace
        )

    def _fleet(self, step: Step) -> Path:
        """Where the elastic workers that send to ``step``'s servers count each other."""
        return self.output_dir / FLEET_DIR / folder_name(step.servers or "default")

    def _leave_fleets(self, owner: str) -> None:
        """Take worker ``owner`` out of every fleet of the pipeline (its jobs keep it in
        from one turn to the next): it is idle, or done."""
        for folder in {self._fleet(step) for step in self.steps}:
            try:
                leave_fleet(folder, owner)
            except (OSError, RunDirectoryError) as error:  # it expires after a lease
                log.warning("fleet_not_left", folder=str(folder), error=str(error))

    def _turns(self, plans: Sequence[StepPlan]) -> tuple[Turns, dict[str, StepResult]]:
        """An elastic worker's turns over the steps it runs, and the results of those
        it leaves as they are (done, or not asked for)."""
        kept = {}
        for step, step_plan in zip(self.steps, plans, strict=True):
            if step_plan.action in ("skip", "leave"):
                kept[step.name] = self._kept(step, step_plan)
        return Turns([p.name for p in plans if p.name not in kept]), kept

    def _take_turn(
        self,
        name: str,
        plans: Sequence[StepPlan],
        keys: Mapping[str, str],
        settings: Mapping[str, dict[str, Any]],
        claim_lease: float | None,
        turns: Turns,
        done: dict[str, StepResult],
    ) -> tuple[Step, StepPlan, Any, JobArgs] | None:
        """Begin step ``name`` for an elastic worker's turn: its plan, input and job
        arguments; None if other workers have finished it (its result then in ``done``)."""
        step = next(s for s in self.steps if s.name == name)
        first = next(p for p in plans if p.name == name)
        if step.from_step in turns.left and not self._can_stream(step):
            # Its rows are written whole, once the step it reads is done: not yet.
            turns.ran(name, finished=False, worked=False)
            return None
        step_plan, data, job = self._begin_step(
            step, first, keys, settings, True, claim_lease, turns
        )
        if step_plan.action == "skip":  # done meanwhile by other workers
            done[name] = self._kept(step, step_plan)
            turns.ran(name, finished=True, worked=False)
            return None
        log.debug("step_turn", step=name, action=step_plan.action, last=turns.is_last(name))
        return step, step_plan, data, job

    def _end_turn(
        self,
        step: Step,
        step_plan: StepPlan,
        keys: Mapping[str, str],
        settings: Mapping[str, dict[str, Any]],
        result: AnnotationResult,
        turns: Turns,
        done: dict[str, StepResult],
    ) -> None:
        """What an elastic worker's turn at ``step`` did: the step done (recorded, its
        result in ``done``), or left to come back to."""
        finished = self._finish_step(step, step_plan, keys, settings, result)
        if finished is not None:
            done[step.name] = finished
        worked = result.num_rows > 0 or result.num_sent > 0
        turns.ran(step.name, finished=finished is not None, worked=worked)

    def _in_order(self, done: Mapping[str, StepResult]) -> list[StepResult]:
        return [done[step.name] for step in self.steps]

    def _finish_step(
        self,
        step: Step,
        step_plan: StepPlan,
        keys: Mapping[str, str],
        settings: Mapping[str, dict[str, Any]],
        result: AnnotationResult,
    ) -> StepResult | None:
        """:meth:`_finish` for an elastic worker, by one worker at a time. Its job ends
        once every unit of the step is finished, by whichever worker, or once it can
        take no unit now (see :mod:`~llm_annotator.pipeline.turns`): the step's figures
        are then its manifest's, not the worker's part; None while units are left."""
        manifest = RunDirectory.open(self.step_dir(step.name)).manifest() or {}
        if result.merged_path is None or not manifest.get("complete"):
            return None
        whole = {key: manifest.get(key) for key in ("rows", "succeeded", "failed")}
        with self._steps_lock(True):
            return self._finish(step, step_plan, keys, settings, result, whole=whole)

    def _report_step(self, results: Sequence[StepResult]) -> PipelineResult:
        """:meth:`_report`, by one elastic worker at a time."""
        with self._steps_lock(True):
            return self._report(results)

    def _finish(
        self,
        step: Step,
        step_plan: StepPlan,
        keys: Mapping[str, str],
        settings: Mapping[str, dict[str, Any]],
        result: AnnotationResult,
        *,
        whole: Mapping[str, Any] | None = None,
    ) -> StepResult:
        """Record the step done with its figures (``whole``: the step's rows,
        succeeded and failed, where the result is one worker's part)."""
        figures = {
            "rows": result.num_rows,
            "succeeded": result.num_succeeded,
            "failed": result.num_failed,
            "sent": result.num_sent,
            "resumed": result.num_resumed,
            "seconds": round(result.seconds, 3),
            "output": str(result.output_path),
            **(whole or {}),
        }
        entry = self._record()["steps"].get(step.name) or {}
        entry.update(
            key=keys[step.name],
            state="done",
            settings=settings[step.name],
            figures=figures,
            finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        self._save(step.name, entry)
        log.info("step_finished", step=step.name, **figures)
        return StepResult(
            step.name, step_plan.action, step_plan.why, result.output_dir, result, figures
        )

    def _kept(self, step: Step, step_plan: StepPlan) -> StepResult:
        entry = self._record()["steps"].get(step.name) or {}
        figures = entry.get("figures", {}) if isinstance(entry, dict) else {}
        return StepResult(
            step.name, step_plan.action, step_plan.why, self.step_dir(step.name), None, figures
        )

    def _report(self, results: Sequence[StepResult]) -> PipelineResult:
        path = self.output_dir / REPORT_FILE
        record = self._record()["steps"]
        report = {
            "steps": [
                {
                    "name": r.name,
                    "reads": step.describe_input(),
                    "action": r.action,
                    "why": r.why,
                    "output_dir": str(r.output_dir),
                    "input": (record.get(r.name) or {}).get("input"),
                    **r.figures,
                }
                for step, r in zip(self.steps, results, strict=True)
            ]
        }
        write_json(path, report)
        return PipelineResult(self.output_dir, tuple(results), path)


def own_entries(output_dir: Path, names: Sequence[str]) -> list[tuple[Path, bool]]:
    """Every entry a run of the pipeline of steps ``names`` writes, each with whether it
    is a folder, folders before what they hold: the pipeline's own files, each step's
    rows and run directory, and the names the step's job writes there.

    Examples:
        >>> entries = dict(own_entries(Path("out"), ["label"]))
        >>> entries[Path("out/inputs/label.jsonl")], entries[Path("out/inputs/label")]
        (False, True)
        >>> entries[Path("out/steps/label/job.json")], entries[Path("out/steps/label/shards")]
        (False, True)
    """
    entries = [
        (output_dir / name, False) for name in (LOCK_FILE, STEPS_LOCK, PIPELINE_FILE, REPORT_FILE)
    ]
    entries += [(output_dir / folder, True) for folder in (STEPS_DIR, INPUTS_DIR, FLEET_DIR)]
    for name in names:
        entries += input_entries(output_dir / INPUTS_DIR, name)
        run_dir = output_dir / STEPS_DIR / name
        entries.append((run_dir, True))
        entries += [(run_dir / file, False) for file in (*RUN_FILES, CORPUS_FILE)]
        entries += [(run_dir / folder, True) for folder in (SHARDS_DIR, ANNOTATIONS_DIR, UNITS_DIR)]
    return entries


def _elastic(shard: str | None) -> bool:
    """Whether ``shard`` makes this process an elastic worker.

    Raises:
        ConfigurationError: Anything but None and ``"claim"``.
    """
    if shard is None:
        return False
    if isinstance(shard, str) and shard.strip() == CLAIM:
        return True
    raise ConfigurationError(
        f"a pipeline takes shard='claim' (--shard claim: any number of elastic workers) "
        f"or none, got {shard!r}; static shards split one job, not a pipeline"
    )


def _is_files(data: Any) -> bool:
    """Whether a step's data names files (a path, a glob, several paths), not rows."""
    if isinstance(data, str | os.PathLike):
        return True
    return isinstance(data, list | tuple) and all(isinstance(d, str | os.PathLike) for d in data)


def _alone(directory: Path) -> DirectoryLock:
    """The pipeline's lock held alone, saying so when elastic workers hold it.

    Raises:
        JobError: Another run, or elastic workers, use the directory.
    """
    try:
        return DirectoryLock.acquire(directory, "run the pipeline in")
    except JobError as alone:
        try:
            probe = _SharedLock.acquire(directory)
        except JobError:
            raise alone from None  # a run alone holds it: its own message
        probe.release()
        raise JobError(
            f"cannot run the pipeline in {directory}: elastic workers (--shard claim) are "
            "running it; wait for them to finish, or join them with --shard claim"
        ) from None


def _refuse_redo(plans: Sequence[StepPlan]) -> None:
    """Refuse, for an elastic worker, a plan that redoes a step (a stale one, say):
    removing its results could pull them from under another worker."""
    for step_plan in plans:
        if step_plan.action == "redo":
            raise ConfigurationError(
                f"step {step_plan.name} is to be redone ({step_plan.why}), which elastic "
                "workers never do (another may be running it): run the pipeline once "
                "without --shard claim to redo it, then start the workers"
            )


def _wait_for_lock(fd: int, path: Path) -> None:
    """Take the ``flock`` of ``fd`` (the file ``path``) alone, waiting as long as it
    takes; after :data:`LOCK_WAIT_SAID` seconds, and every six times that, say who holds
    it (its host and pid, as the holder wrote them) and for how long this one waited.
    A signal does not end the wait (the worker acts on it once it has the lock)."""
    started = time.monotonic()
    said_at = LOCK_WAIT_SAID
    wait = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            waited = time.monotonic() - started
            if waited >= said_at:
                holder = ""
                with contextlib.suppress(OSError):
                    holder = os.pread(fd, LOCK_HOLDER_BYTES, 0).decode(errors="replace").strip()
                log.warning(
                    "steps_lock_waiting",
                    lock=str(path),
                    holder=holder or "unknown",
                    seconds=round(waited, 1),
                    hint="a worker stopped while it holds it (SIGSTOP, a frozen node) "
                    "stalls the others: resume it or kill it",
                )
                said_at += LOCK_WAIT_SAID * 6
            time.sleep(wait)
            wait = min(wait * 2, 0.05)
        else:
            return


class _SharedLock:
    """``.lock`` held shared: any number of elastic workers, never beside a run that
    holds it alone (:class:`DirectoryLock`)."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: Path) -> _SharedLock:
        """Hold the pipeline's lock shared.

        Raises:
            JobError: A run that is not elastic holds it.
        """
        fd = open_file(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, single=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = ""
            with contextlib.suppress(OSError):
                owner = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            raise JobError(
                f"cannot run the pipeline in {directory} as a worker: a run without "
                f"--shard claim (pid {owner or 'unknown'}) is using it; wait for it to finish"
            ) from None
        except OSError as error:
            os.close(fd)
            raise JobError(
                f"cannot lock {directory / LOCK_FILE}: {error}; the output directory must be "
                "on a file system that supports flock"
            ) from error
        return cls(fd)

    def release(self) -> None:
        """Let go of the lock; idempotent."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _check_entry(path: Path, folder: bool) -> None:
    """:func:`check_entry`, saying a file where a folder goes in those words."""
    try:
        check_entry(path, directory=folder)
    except RunDirectoryError:
        if folder and path.is_file() and not path.is_symlink():
            raise refused(path, "a file where the pipeline keeps a folder") from None
        raise


def _has_output(run_dir: Path) -> bool:
    """Whether a step's run directory holds its job's output (an entry planted there
    is not an output: the run refuses it by name)."""
    try:
        return RunDirectory.open(run_dir).has_output()
    except RunDirectoryError:
        return False


def _mismatch(step: Step, error: FingerprintMismatchError) -> ConfigurationError:
    """A step's job refused to resume: its directory holds results of other settings
    than the pipeline knows (another model, say), which the pipeline never mixes."""
    changes = "; ".join(error.changes) or str(error).splitlines()[0]
    return ConfigurationError(
        f"step {step.name} was begun with other settings than it has now ({changes}); "
        f"a step never mixes them: run again with --redo {step.name} (redo=[...]) to redo "
        "it and the steps that read it, or give it the servers it began with"
    )


def _say_paused(seconds: float, longest: float) -> float:
    """Log an elastic worker's pause between passes when it is longer than the
    ``longest`` since it last sent rows (0.25 s doubling to 4 s: a few lines an idle
    stretch, not one every pause); the longest now."""
    if seconds > longest:
        log.info("worker_paused", seconds=seconds, hint="nothing to take now: others hold it")
    return max(seconds, longest)


async def _pause(seconds: float, stop: asyncio.Event | None) -> None:
    """Wait ``seconds`` between an elastic worker's passes, or until ``stop`` is set:
    then the worker stops as a job stopped by it would.

    Raises:
        RunInterruptedError: ``stop`` is set.
    """
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    if stop.is_set():
        raise RunInterruptedError(
            "stopped between two steps' turns; everything done is kept, and running the "
            "worker again goes on with it"
        )


async def _settled(function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)`` in a thread; cancelled, it waits for the thread to end (a
    thread cannot be stopped half way) before the cancellation goes on."""
    work = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await work
        raise


def _write_unit(step: Step, folder: Path, upstream: Path, name: str) -> None:
    write_unit_input(step, folder, upstream, name)
