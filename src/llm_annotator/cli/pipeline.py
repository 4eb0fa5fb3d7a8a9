"""``llm-annotator pipeline``: several annotation steps from one TOML file.

The file::

    output_dir = "runs/reviews"              # the pipeline's directory
    input = "reviews.jsonl"                  # the corpus the steps read by default
    servers = ["http://127.0.0.1:8000/v1"]   # any setting of ``run``: every step's default
    max_completion_tokens = 8

    [server_groups.strong]                   # settings a step takes with server_group
    servers = ["http://127.0.0.1:9000/v1"]

    [steps.label]                            # the steps, each any setting of ``run`` ...
    prompt_template = "Positive or negative? {text}"

    [steps.reason]                           # ... and what it reads: the corpus (input),
    from = "label"                           # an earlier step (from), or prompts
    where = "label_response == 'negative'"
    prompt_template = "Why is this review negative? {text}"
    server_group = "strong"

A step's own keys are ``input``, ``from``, ``where``, ``prompts``, ``prompt`` (one
prompt), ``copies``, ``n``, ``preprocess``, ``postprocess`` (``module:function``) and
``server_group``. ``--set STEP.KEY=VALUE`` overrides a step's setting (``--set KEY=VALUE``
the pipeline's), the value read as TOML (a bare word as a string).
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_annotator._job_options import JOB_OPTIONS, STEP_OPTIONS
from llm_annotator.cli.settings import (
    ENDINGS,
    converted,
    exit_code,
    job_keywords,
    load_validator,
    pool_from,
)
from llm_annotator.errors import ConfigurationError

if TYPE_CHECKING:
    from llm_annotator.clients.base import Client
    from llm_annotator.pipeline import Pipeline

STEP_KEYS = (
    "input",
    "from",
    "where",
    "prompts",
    "prompt",
    "copies",
    "n",
    "preprocess",
    "postprocess",
    "server_group",
)
"""A step's own keys, besides the settings of ``run``."""
PIPELINE_ONLY = ("output_dir", "log_format", "log_file", "stop_grace")
"""Settings of the whole pipeline, not of one step."""
NOT_IN_PIPELINE = (
    *(o.setting for o in JOB_OPTIONS if not o.in_step and o.setting is not None),
    "processes",
    "metrics_port",
    "metrics_host",
)
"""Settings of ``run`` a pipeline does not take (its steps run in this process, whole):
the job options a step does not take (``force`` is ``pipeline run --force``), and the
process's own."""
_CLIENT_SETTINGS = (
    "servers",
    "servers_file",
    "servers_dir",
    "servers_dns",
    "offline_model",
    "tensor_parallel_size",
    "max_model_len",
    "dtype",
    "max_num_seqs",
    "enforce_eager",
    "gpu_memory_utilization",
    "model",
    "batch_size",
    "max_concurrent_batches_per_client",
    "timeout",
    "all_down_timeout",
    "hedge_tail",
    "adaptive",
    "prefix_affinity",
    "api_key_file",
    "api_key_env",
    "ca_bundle",
    "verify_tls",
    "max_response_bytes",
    "max_server_faults",
    "stall_window",
)
"""The settings that make a step's client: steps that agree on all share one."""


def add_pipeline(parser: argparse.ArgumentParser) -> None:
    """Declare ``llm-annotator pipeline run|describe`` on its parser."""
    from llm_annotator.cli.run import HUMAN_LINES

    parser.description = (
        "Run several annotation steps from one TOML file: each step reads the corpus, "
        "an earlier step's answered rows (filtered with where) or prompts to generate "
        "from, and is a resumable job in the pipeline's directory."
    )
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run = actions.add_parser("run", help="run the steps: skip those done, resume those begun")
    describe = actions.add_parser(
        "describe", help="the steps, what they read, what is done and what a run would do"
    )
    for sub in (run, describe):
        sub.add_argument("file", help="the pipeline's TOML file")
        sub.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="STEP.KEY=VALUE",
            help="override a step's setting (KEY=VALUE: the pipeline's); VALUE is TOML",
        )
    run.add_argument("--steps", default=None, help="run only these steps: NAME[,NAME...]")
    run.add_argument(
        "--redo",
        default=None,
        metavar="NAME[,NAME...]",
        help="redo these steps and the steps that read them, whatever is recorded (a step "
        "begun on other servers, say)",
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="redo the steps whose settings changed, replacing their results and those "
        "of the steps that read them",
    )
    run.add_argument(
        "--shard",
        choices=["claim"],
        default=None,
        help="run as one of any number of elastic workers (on any host sharing the "
        "output directory), which share each step's units by claims",
    )
    run.add_argument(
        "--processes",
        type=_worker_count,
        default=1,
        metavar="N",
        help="run N elastic workers on this machine (--shard claim each; each server's "
        "in-flight budget is shared among all the workers of the run directory)",
    )
    run.add_argument(
        "--claim-lease",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --shard claim: seconds a worker's claim on a unit lasts unrenewed "
        "before another worker takes the unit over (default 60)",
    )
    run.set_defaults(handler=pipeline_run, human_lines=HUMAN_LINES)
    describe.set_defaults(handler=pipeline_describe)


def pipeline_run(args: argparse.Namespace) -> int:
    """Run the pipeline; 0 when every step selected is done, 128+signal when stopped."""
    from llm_annotator.cli.run import progress_display

    loaded = load_pipeline(Path(args.file), args.set)
    steps = [name.strip() for name in args.steps.split(",")] if args.steps else None
    redo = [name.strip() for name in args.redo.split(",")] if args.redo else []
    pipeline = loaded.pipeline
    pipeline.plan(steps=steps, redo=redo, force=args.force)  # refused before clients start
    if args.processes > 1:
        return _run_workers(args, loaded)
    clients = {name: _client(settings) for name, settings in loaded.clients.items()}
    try:
        default = next(iter(clients.values()))
        result = pipeline.run(
            default,
            servers=clients,
            steps=steps,
            redo=redo,
            force=args.force,
            stop_grace=loaded.stop_grace,
            progress=progress_display(args),
            shard=args.shard,
            claim_lease=args.claim_lease,
        )
    except (*ENDINGS, KeyboardInterrupt) as error:  # KeyboardInterrupt: between steps' jobs
        kept = "the steps done are kept"
        return exit_code(error, command="pipeline", output_dir=pipeline.output_dir, kept=kept)
    finally:
        for client in clients.values():
            client.close()
    for step in result.steps:
        figures = step.figures
        if step.action == "leave":
            print(f"step {step.name}: left alone (not in --steps)")
            continue
        done = _DONE.get(step.action, step.action)
        print(
            f"step {step.name}: {done}: {figures.get('rows')} rows ({figures.get('succeeded')} "
            f"succeeded, {figures.get('failed')} failed) in {step.output_dir}"
        )
    print(f"report: {result.report_path}")
    return 0


def _worker_count(text: str) -> int:
    """``--processes``: a number of workers >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a number of workers >= 1, got {text!r}")
    return value


def _run_workers(args: argparse.Namespace, loaded: Loaded) -> int:
    """``--processes N``: N workers of the same command, each ``--shard claim``; they
    share each server's budget as the workers of any elastic job do."""
    from llm_annotator.cli._workers import supervise, worker_command

    if args.force or args.redo:
        raise ConfigurationError(
            "--processes: elastic workers never redo a step; run the pipeline once with "
            "--force or --redo alone, then start the workers"
        )
    if any(settings.get("offline_model") for settings in loaded.clients.values()):
        raise ConfigurationError(
            "--processes: a model in this process (offline_model) is loaded once per "
            "process; run one process, or serve the model and give its servers"
        )
    command = worker_command(args.argv)
    return supervise(command, args.processes, "pipeline run", "the pipeline")


_DONE = {"run": "done", "resume": "resumed, done", "redo": "redone", "skip": "skipped, done before"}
"""How ``pipeline run`` says what it did with a step."""


def pipeline_describe(args: argparse.Namespace) -> int:
    """Print each step: what it reads, how far it is, what a run would do."""
    pipeline = load_pipeline(Path(args.file), args.set).pipeline
    views = pipeline.describe()
    print(f"pipeline {pipeline.output_dir} ({len(views)} steps)")
    for view in views:
        if view.rows is None:
            progress = view.state
        else:
            total = f" of {view.total}" if view.total is not None else ""
            failed = f", {view.failed} failed" if view.failed else ""
            units = f", {view.units[0]} of {view.units[1]} units" if view.units else ""
            progress = f"{view.state}: {view.rows}{total} rows{failed}{units}"
        print(f"  {view.name}: reads {view.reads}")
        print(f"    {progress}; a run would {view.next.action} it ({view.next.why})")
        print(f"    {view.output_dir}")
    return 0


class Loaded:
    """A pipeline file read: the pipeline, the settings of each client its steps use
    (by name), and the pipeline's stop grace."""

    def __init__(
        self, pipeline: Pipeline, clients: dict[str, dict[str, Any]], stop_grace: float
    ) -> None:
        self.pipeline = pipeline
        self.clients = clients
        self.stop_grace = stop_grace


def load_pipeline(path: Path, overrides: list[str] | None = None) -> Loaded:
    """Read a pipeline file, apply ``--set`` overrides, and check every setting.

    Raises:
        ConfigurationError: The file cannot be read, a key is unknown (named, with the
            step), a value is of the wrong type, a step reads one that does not exist,
            steps read each other in a cycle, or an override names no step.
    """
    from llm_annotator.cli._offline import SERVER_SETTINGS
    from llm_annotator.cli.run import SETTINGS

    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"cannot read the pipeline file {path}: {exc}") from exc
    table = {key.replace("-", "_"): value for key, value in table.items()}
    steps = table.pop("steps", None)
    groups = table.pop("server_groups", {})
    if not isinstance(steps, dict) or not steps:
        raise ConfigurationError(f"{path}: no steps; add a [steps.NAME] table for each step")
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ConfigurationError(f"{path}: server_groups must be tables ([server_groups.NAME])")
    for name, step in steps.items():
        if not isinstance(step, dict):
            raise ConfigurationError(f"{path}: steps.{name} must be a table ([steps.{name}])")
    _apply_overrides(path, table, steps, overrides or [])
    known = {s.flag: s for s in SETTINGS}
    top = _checked(path, "", table, known, allowed_extra=(*PIPELINE_ONLY, "input"))
    if "output_dir" not in top:
        raise ConfigurationError(f"{path}: give output_dir, the pipeline's directory")
    defaults = {s.flag: s.default for s in SETTINGS}
    group_settings = {
        name: _checked(path, f"server_groups.{name}", dict(group), known, only=_CLIENT_SETTINGS)
        for name, group in groups.items()
    }
    built = []
    clients: dict[str, dict[str, Any]] = {}
    for name, raw in steps.items():
        where = f"steps.{name}"
        own = {key.replace("-", "_"): value for key, value in raw.items()}
        group = own.pop("server_group", None)
        if group is not None and not isinstance(group, str):
            raise ConfigurationError(f"{path}: {where}.server_group must be a group's name")
        if group is not None and group not in group_settings:
            raise ConfigurationError(
                f"{path}: {where}.server_group {group!r} is not a [server_groups.NAME] table; "
                f"the groups are {', '.join(group_settings) or 'none'}"
            )
        special = {key: own.pop(key) for key in STEP_KEYS if key in own}
        settings = {**defaults, **{k: v for k, v in top.items() if k in known}}
        if special.keys() & {"from", "prompts", "prompt"}:  # the corpus's, not theirs
            settings["id_column"] = None
            settings["skip_bad_files"] = False
        if group is not None:
            settings.update(group_settings[group])
        settings.update(_checked(path, where, own, known))
        if not special.keys() & {"from", "prompts", "prompt", "input"} and "input" in top:
            special["input"] = top["input"]
        if not any(settings.get(k) for k in SERVER_SETTINGS) and not settings["offline_model"]:
            raise ConfigurationError(
                f"{path}: {where} has no servers: set servers (or servers_file, servers_dir, "
                "servers_dns) at the top of the file, in a server group, or in the step"
            )
        client_key = repr([settings.get(k) for k in _CLIENT_SETTINGS])
        client_name = next((n for n, s in clients.items() if s["_key"] == client_key), None)
        if client_name is None:
            client_name = group or f"servers-{len(clients) + 1}"
            if client_name in clients:
                client_name = f"{client_name}-{len(clients) + 1}"
            clients[client_name] = {**settings, "_key": client_key}
        built.append(_step(path, name, where, special, settings, client_name))
    from llm_annotator.pipeline import Pipeline

    pipeline = Pipeline(built, top["output_dir"])
    return Loaded(pipeline, clients, float(top.get("stop_grace", defaults["stop_grace"])))


def _apply_overrides(
    path: Path, table: dict[str, Any], steps: dict[str, Any], overrides: list[str]
) -> None:
    """``--set STEP.KEY=VALUE`` and ``--set KEY=VALUE``, into the file's tables."""
    for override in overrides:
        target, equals, text = override.partition("=")
        if not equals or not target.strip():
            raise ConfigurationError(f"--set {override!r}: expected STEP.KEY=VALUE or KEY=VALUE")
        value = _toml_value(text.strip())
        name, dot, key = target.strip().rpartition(".")
        if not dot:
            table[key.replace("-", "_")] = value
            continue
        if name not in steps:
            raise ConfigurationError(
                f"--set {override!r}: {name!r} is not a step of {path}; the steps are "
                f"{', '.join(steps)}"
            )
        steps[name][key] = value


def _toml_value(text: str) -> Any:
    """A ``--set`` value: TOML (``3``, ``true``, ``["a", "b"]``, ``"x"``), else the text."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _checked(
    path: Path,
    where: str,
    table: Mapping[str, Any],
    known: Mapping[str, Any],
    *,
    allowed_extra: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """A table's settings, each converted as ``run`` converts it; an unknown key, or
    one this table does not take, is refused by name."""
    prefix = f"{where}." if where else ""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name in allowed_extra and name not in known:
            out[name] = value
            continue
        refused = (
            name in NOT_IN_PIPELINE
            or (name in PIPELINE_ONLY and bool(where))
            or (only is not None and name not in only)
            or name not in known
        )
        if refused:
            if name in known or name in PIPELINE_ONLY:
                why = "is not a setting here"
                if name == "force":
                    why = "is not a setting of the file: give --force to pipeline run"
                elif name in NOT_IN_PIPELINE:
                    why = "is a setting of llm-annotator run that a pipeline does not take"
                elif name in PIPELINE_ONLY:
                    why = "is a setting of the whole pipeline: set it at the top of the file"
                raise ConfigurationError(f"{path}: {prefix}{key} {why}")
            accepted = sorted(
                {*(only or (k for k in known if k not in NOT_IN_PIPELINE)), *allowed_extra}
                | (set(STEP_KEYS) if where.startswith("steps.") else set())
            )
            raise ConfigurationError(
                f"{path}: unknown setting {prefix}{key}; known settings: {', '.join(accepted)}"
            )
        out[name] = converted(known[name], value, f"{path}: setting {prefix}{key}")
    return out


def _step(
    path: Path,
    name: str,
    where: str,
    special: dict[str, Any],
    settings: dict[str, Any],
    client: str,
) -> Any:
    """The :class:`Step` of one table."""
    from llm_annotator.pipeline import Step

    prompts = special.get("prompts")
    if "prompt" in special:
        if prompts is not None:
            raise ConfigurationError(f"{path}: {where}: give prompt or prompts, not both")
        prompts = [special["prompt"]]
    if prompts is not None and (
        not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts)
    ):
        raise ConfigurationError(f"{path}: {where}.prompts must be a list of strings")
    data = special.get("input")
    if data is not None and not (
        (isinstance(data, str) and data)
        or (isinstance(data, list) and data and all(isinstance(d, str) and d for d in data))
    ):
        raise ConfigurationError(f"{path}: {where}.input must be a path or a list of paths")
    hooks: dict[str, Any] = {}
    for key in ("preprocess", "postprocess"):
        if key in special:
            if not isinstance(special[key], str):
                raise ConfigurationError(f"{path}: {where}.{key} must be MODULE:FUNCTION")
            hooks[key] = load_validator(special[key], f"{where}.{key}")
    for key in ("where", "from"):
        if key in special and not isinstance(special[key], str):
            raise ConfigurationError(f"{path}: {where}.{key} must be a string")
    try:
        return Step(
            name,
            settings["prompt_template"],
            data=data[0] if isinstance(data, list) and len(data) == 1 else data,
            from_step=special.get("from"),
            where=special.get("where"),
            prompts=prompts,
            copies=special.get("copies", 1),
            n=special.get("n", 1),
            servers=client,
            **job_keywords(settings, STEP_OPTIONS),
            **hooks,
        )
    except ConfigurationError as error:
        raise ConfigurationError(f"{path}: {error}") from None


def _client(settings: dict[str, Any]) -> Client[Any]:
    """The client one group of steps shares: servers, or the model in this process."""
    from llm_annotator.cli._offline import check_offline_settings, offline_client
    from llm_annotator.cli.run import SETTINGS

    settings = {k: v for k, v in settings.items() if k != "_key"}
    check_offline_settings(settings, {s.flag: s.default for s in SETTINGS})
    if settings["offline_model"]:
        return offline_client(settings)
    return pool_from(settings)
