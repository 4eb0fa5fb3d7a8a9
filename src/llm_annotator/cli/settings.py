"""What ``llm-annotator run`` and ``llm-annotator pipeline`` share: how a setting is read
(from a flag or a TOML value), the job options' settings, and what the settings make (the
runtime options, the user's hooks, the pool, the job's keywords, the exit status).

The job options' settings are built from their declarations
(:data:`llm_annotator.jobs.spec.OPTIONS`): each option ``llm-annotator run`` reads has
one row here, with its flag, its help and its default.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_annotator._job_options import JOB_OPTIONS, OPTIONS
from llm_annotator._validate import size_in_bytes
from llm_annotator.errors import (
    ConfigurationError,
    PoolExhaustedError,
    RunInterruptedError,
    ServersUnusableError,
)

# The clients, the pool and the job layer are imported by the functions that use them,
# not here: declaring a command (its --help) loads none of them.
if TYPE_CHECKING:
    from llm_annotator.annotator import VLLMQueueAnnotator
    from llm_annotator.clients.tls import Verify
    from llm_annotator.pool.discovery import ServerDiscovery


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting of ``llm-annotator run``: a flag, and a key of a job or pipeline file.

    Args:
        flag: Its name, with underscores (the flag is ``--`` and the name with ``-``).
        kind: Reads a value (a flag's text or a TOML value); raises :class:`BadValue`.
        help: The flag's help.
        default: Its value when neither the flags nor a file give it.
        nargs: The flag's number of values (argparse's ``nargs``), for lists.
    """

    flag: str
    kind: Callable[[Any], Any]
    help: str
    default: Any = None
    nargs: str | None = None


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A value a setting cannot take; argparse prints it as it is, TOML wraps it."""


def boolean(value: Any) -> bool:
    """A true or false setting (a flag's ``--name``/``--no-name``, a TOML boolean)."""
    if isinstance(value, bool):
        return value
    raise BadValue(f"expected true or false, got {value!r}")


def text(value: Any) -> str:
    """A non-empty string."""
    if isinstance(value, str) and value:
        return value
    raise BadValue(f"expected a non-empty string, got {value!r}")


def strings(value: Any) -> list[str]:
    """A list of strings (one string: a list of one)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise BadValue(f"expected a list of strings, got {value!r}")


def paths(value: Any) -> list[str]:
    """One or more non-empty paths."""
    found = strings(value)
    if not found or not all(found):
        raise BadValue(f"expected one or more paths, got {value!r}")
    return found


def number(
    *, integer: bool, low: float, high: float | None = None, low_open: bool = False
) -> Callable[[Any], Any]:
    """A converter for a number in a range, from a flag's text or a TOML value.

    Examples:
        >>> number(integer=True, low=1)("3")
        3
        >>> number(integer=False, low=0, low_open=True)(0)
        Traceback (most recent call last):
        ...
        llm_annotator.cli.settings.BadValue: expected a number > 0, got 0
    """
    what = "an integer" if integer else "a number"
    bound = f"> {low:g}" if low_open else f">= {low:g}"
    if high is not None:
        bound += f" and <= {high:g}"

    def convert(value: Any) -> int | float:
        found: int | float | None = None
        if isinstance(value, str):
            try:
                found = int(value) if integer else float(value)
            except ValueError:
                found = None
        elif isinstance(value, int | float) and not isinstance(value, bool):
            found = value if (not integer or isinstance(value, int)) else None
        ok = found is not None and math.isfinite(found)
        if ok and found is not None:
            ok = (found > low if low_open else found >= low) and (high is None or found <= high)
        if not ok or found is None:
            raise BadValue(f"expected {what} {bound}, got {value!r}")
        return found

    return convert


POSITIVE_INT = number(integer=True, low=1)
COUNT = number(integer=True, low=0)
SEED = number(integer=True, low=-(2**63))
SECONDS = number(integer=False, low=0, low_open=True)
GRACE = number(integer=False, low=0)


def size(value: Any) -> int:
    """A size in bytes, from a flag's text or a TOML value (``4096``, ``"64M"``)."""
    try:
        return size_in_bytes("the size", value)
    except ConfigurationError:
        raise BadValue(f"expected a size in bytes (4096, 64M, 1G), got {value!r}") from None


def retry_errors(value: Any) -> bool | list[str]:
    """``retry_errors``: true or false, or a list of error types (an empty one: none)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise BadValue(f"expected true, false or a list of error types, got {value!r}")


READERS: Mapping[str, Callable[[Any], Any]] = {
    "text": text,
    "texts": strings,
    "bool": boolean,
    "count": COUNT,
    "positive_int": POSITIVE_INT,
    "seed": SEED,
    "seconds": SECONDS,
    "size": size,
    "retry_errors": retry_errors,
    "hook": text,  # MODULE:FUNCTION, loaded by job_keywords
    "shard": text,  # parsed by job_keywords
}
"""How a job option's setting is read, by the kind its declaration names (``reads``)."""
_NARGS = {"texts": "+", "retry_errors": "*"}

SAMPLING_SETTINGS = ("max_completion_tokens", "temperature", "top_p", "seed", "output_schema")
"""The settings that make the job option ``options`` (see :func:`options_from`)."""


def job_settings() -> tuple[Setting, ...]:
    """The settings of the job options that ``llm-annotator run`` reads, each built from
    its declaration, in the order of the options.

    Examples:
        >>> [s.flag for s in job_settings()][:3]
        ['system_message', 'id_column', 'columns']
    """
    return tuple(
        Setting(
            option.setting,
            READERS[option.reads],
            option.flag_help,
            option.default,
            nargs=_NARGS.get(option.reads),
        )
        for option in JOB_OPTIONS
        if option.setting is not None and option.reads is not None
    )


def add_settings(parser: argparse.ArgumentParser, settings: Iterable[Setting]) -> None:
    """Declare a flag on ``parser`` for each setting; every flag defaults to None (not
    given), so that a file's value shows through."""
    for setting in settings:
        flag = "--" + setting.flag.replace("_", "-")
        if setting.kind is boolean:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=setting.help
            )
        elif setting.kind is retry_errors:
            parser.add_argument(flag, nargs="*", default=None, metavar="TYPE", help=setting.help)
            parser.add_argument(
                "--no-" + flag[2:],
                dest=setting.flag,
                action="store_const",
                const=False,
                help="(the default) keep error rows as they are",
            )
        elif setting.nargs:
            parser.add_argument(flag, nargs=setting.nargs, default=None, help=setting.help)
        else:
            parser.add_argument(flag, type=setting.kind, default=None, help=setting.help)


def converted(setting: Setting, value: Any, said: str) -> Any:
    """A file's value for ``setting``, converted as its flag's would be.

    Raises:
        ConfigurationError: The value is of the wrong type or out of range; the
            message begins with ``said`` (the file and the key).
    """
    try:
        return setting.kind(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigurationError(f"{said}: {exc}") from None


def job_keywords(settings: Mapping[str, Any], names: Iterable[str] = OPTIONS) -> dict[str, Any]:
    """The job options among ``names`` that the settings give, as the keywords of
    ``Annotator.annotate`` (or of a pipeline ``Step``): each read from its setting, the
    runtime options made from the sampling settings, a ``MODULE:FUNCTION`` loaded, a
    shard parsed. An option only Python gives is left out (its default holds).

    Raises:
        ConfigurationError: The output schema, a hook or the shard cannot be used.
    """
    keywords: dict[str, Any] = {}
    for name in names:
        option = OPTIONS[name]
        if option.reads is None:
            continue
        if option.reads == "sampling":
            keywords[name] = options_from(settings)
            continue
        value = settings[option.setting or name]
        if option.reads == "hook" and value:
            value = load_validator(value, "--" + (option.setting or name).replace("_", "-"))
        elif option.reads == "shard":
            value = _shard(value)
        keywords[name] = value
    return keywords


def options_from(settings: Mapping[str, Any]) -> Any:
    """The runtime options the settings name (sampling, the output schema), for
    servers or for the model in this process.

    Raises:
        ConfigurationError: The output schema file cannot be read or is not a schema.
    """
    from llm_annotator.clients.vllm_offline_client import VLLMOfflineRuntimeOptions
    from llm_annotator.clients.vllm_online_client import VLLMOnlineRuntimeOptions
    from llm_annotator.jobs.answers.schema import OutputSchema

    schema = None
    if settings["output_schema"]:
        schema = OutputSchema.from_file(settings["output_schema"]).schema
    option_type = (
        VLLMOfflineRuntimeOptions if settings["offline_model"] else VLLMOnlineRuntimeOptions
    )
    return option_type(
        max_completion_tokens=settings["max_completion_tokens"],
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        seed=settings["seed"],
        output_schema=schema,
    )


def _shard(given: str | None) -> Any:
    """``--shard``: None, ``claim``, or a static shard (parsed, so that a bad one is
    said before any server is asked)."""
    if not given:
        return None
    if given.strip() == "claim":
        return "claim"
    from llm_annotator.jobs.shards.shard import Shard

    return Shard.parse(given)


def load_validator(spec: str, flag: str = "--validate") -> Callable[..., Any]:
    """The callable that ``--validate`` (or another ``flag``: a pipeline's hooks) names:
    ``module:function`` (the module found from the working directory too) or
    ``path/to/file.py:function``.

    Raises:
        ConfigurationError: The module cannot be imported, has no such name, or the
            name is not callable; the message says which.

    Examples:
        >>> load_validator("json:loads")('{"a": 1}')
        {'a': 1}
        >>> load_validator("json")
        Traceback (most recent call last):
        ...
        llm_annotator.errors.ConfigurationError: --validate 'json': expected MODULE:FUNCTION ...
    """
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigurationError(
            f"{flag} {spec!r}: expected MODULE:FUNCTION (my_checks:parse_label) or FILE.py:FUNCTION"
        )
    try:
        if where.endswith(".py"):
            path = Path(where)
            private = f"_llm_annotator_validate_{path.stem}"  # never shadows a real module
            loader = importlib.util.spec_from_file_location(private, path)
            if loader is None or loader.loader is None or not path.is_file():
                raise ConfigurationError(f"{flag} {spec!r}: no file {where}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[loader.name] = module
            loader.loader.exec_module(module)
        else:
            if "" not in sys.path and os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())  # as `python -m` would find it
            module = importlib.import_module(where)
    except ConfigurationError:
        raise
    except Exception as error:  # the user's module: any failure is theirs to see
        raise ConfigurationError(
            f"{flag} {spec!r}: cannot import {where}: {type(error).__name__}: {error}"
        ) from error
    found = getattr(module, name, None)
    if found is None:
        raise ConfigurationError(f"{flag} {spec!r}: {where} has no {name!r}")
    if not callable(found):
        raise ConfigurationError(f"{flag} {spec!r}: {where}.{name} is not callable")
    validate: Callable[..., Any] = found
    return validate


def pool_from(settings: Mapping[str, Any]) -> VLLMQueueAnnotator:
    """The pool of servers the settings name.

    Raises:
        ConfigurationError: A server's URL, the API key or the CA bundle cannot be used.
    """
    from llm_annotator.annotator import VLLMQueueAnnotator
    from llm_annotator.clients.urls import normalize_base_url

    for url in settings["servers"] or []:
        try:
            normalize_base_url(url)
        except ConfigurationError as exc:
            raise ConfigurationError(f"--servers: {exc}") from None
    return VLLMQueueAnnotator(
        settings["servers"] or [],
        discovery=_discovery(settings),
        model=settings["model"],
        batch_size=settings["batch_size"],
        max_concurrent_batches_per_client=settings["max_concurrent_batches_per_client"],
        timeout=settings["timeout"],
        all_down_timeout=settings["all_down_timeout"],
        hedge_tail=settings["hedge_tail"],
        adaptive=settings["adaptive"],
        prefix_affinity=settings["prefix_affinity"],
        api_key=api_key_from(settings),
        verify=verify_from(settings),
        max_response_bytes=settings["max_response_bytes"],
        max_server_faults=settings["max_server_faults"],
        stall_window=settings["stall_window"],
    )


def api_key_from(settings: Mapping[str, Any]) -> str | None:
    """The API key that ``--api-key-file`` or ``--api-key-env`` names, if either.

    The key itself is never taken from the command line, where other users of the
    machine would see it.

    Raises:
        ConfigurationError: If the file cannot be read or is empty, or the variable
            is not set; the message names the flag and never shows the key.
    """
    if settings["api_key_file"]:
        path = Path(settings["api_key_file"])
        try:
            key = path.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"--api-key-file {path}: cannot read it ({exc.__class__.__name__}: "
                f"{getattr(exc, 'strerror', None) or exc})"
            ) from None
        if not key or "\n" in key:
            raise ConfigurationError(
                f"--api-key-file {path}: expected the key alone on one line"
                + (", the file is empty" if not key else "")
            )
        return key
    if settings["api_key_env"]:
        name = settings["api_key_env"]
        key = os.environ.get(name, "").strip()
        if not key:
            raise ConfigurationError(
                f"--api-key-env {name}: the environment variable {name} is not set or empty"
            )
        return key
    return None


def verify_from(settings: Mapping[str, Any]) -> Verify:
    """``verify=`` for the pool: ``--ca-bundle``, ``--no-verify-tls`` or the default.

    Raises:
        ConfigurationError: If the CA bundle cannot be read.
    """
    from llm_annotator.clients.tls import ssl_setting

    if settings["ca_bundle"]:
        bundle = settings["ca_bundle"]
        try:
            ssl_setting(bundle)
        except ConfigurationError as exc:
            raise ConfigurationError(f"--ca-bundle {bundle}: {exc}") from None
        return str(bundle)
    return bool(settings["verify_tls"])


def _discovery(settings: Mapping[str, Any]) -> ServerDiscovery | None:
    """The server sources the settings name, re-read during the run."""
    from llm_annotator.pool.discovery import (
        DirectorySource,
        DnsSource,
        FileSource,
        ServerDiscovery,
        ServerSource,
    )

    sources: list[ServerSource] = []
    if settings["servers_file"]:
        sources.append(FileSource(Path(settings["servers_file"])))
    if settings["servers_dir"]:
        sources.append(DirectorySource(Path(settings["servers_dir"])))
    if settings["servers_dns"]:
        sources.append(DnsSource.parse(settings["servers_dns"]))
    return ServerDiscovery(sources) if sources else None


ENDINGS = (RunInterruptedError, ServersUnusableError, PoolExhaustedError)
"""The errors that end a job with an exit status of their own (see :func:`exit_code`)."""


def exit_code(
    error: BaseException, *, command: str, output_dir: str | os.PathLike[str], kept: str
) -> int:
    """Say on standard error how ``error`` ended ``command``, and return its exit status:
    128 + the signal after a stop by a signal (a ``KeyboardInterrupt``: SIGINT), 1 when
    the servers cannot be used, 3 when every server stayed down.

    Args:
        error: One of :data:`ENDINGS`, or a ``KeyboardInterrupt``.
        command: The command, as its lines begin (``run``, ``pipeline``).
        output_dir: Where what is done is kept.
        kept: What a new run keeps, said after servers that cannot be used.

    Raises:
        BaseException: ``error`` itself, when it is none of these.
    """
    said = f"llm-annotator {command}"
    again = "run the same command again"
    if isinstance(error, RunInterruptedError):
        line, code = f"{said}: {error}", 128 + (error.signum or int(signal.SIGINT))
    elif isinstance(error, KeyboardInterrupt):
        line = (
            f"{said}: stopped by SIGINT; what is done is kept in {output_dir}. "
            f"{again.capitalize()} to resume."
        )
        code = 128 + int(signal.SIGINT)
    elif isinstance(error, ServersUnusableError):  # before PoolExhaustedError, its base
        line = f"{said}: error: {error}\nFix the settings named above and {again}; {kept}."
        code = 1
    elif isinstance(error, PoolExhaustedError):
        written = f"Everything completed is written in {output_dir}"
        line = f"{said}: {error}\n{written}; {again} to resume."
        code = 3
    else:
        raise error
    print(line, file=sys.stderr, flush=True)
    return code
