"""Run llm-annotator itself under the vLLM Python, for the in-process (offline) client.

vLLM lives in an environment of its own (see :func:`find_vllm_python`), whose pinned
packages must not be disturbed. :func:`annotator_environment` gives the environment
variables that let that Python import this package anyway: the package's own folder,
linked into the cache, and the few packages it needs that the vLLM environment lacks,
installed once beside it with ``pip --target`` (never into the vLLM environment).
Tests, benchmarks and ``llm-annotator run --offline-model`` on such a machine use it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import llm_annotator
from llm_annotator.errors import ConfigurationError
from llm_annotator.local.servers import (
    CACHE_ENV,
    COMPLETE_STAMP,
    _move_into_place,
    _pip,
    _run_step,
    cache_dir,
    find_vllm_python,
)

CPU_ENGINE_ENV: Mapping[str, str] = MappingProxyType(
    {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
)
"""The environment of a small in-process engine on a CPU, as the local servers get
theirs: 1 GiB of KV cache, one unpinned compute thread (vLLM's default pins every
engine's threads to the first core), nothing fetched from a hub, no usage report."""

_MISSING_SCRIPT = """
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
for line in sys.argv[1:]:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        found = version(req.name)
    except PackageNotFoundError:
        print(line)
        continue
    if req.specifier and not req.specifier.contains(found, prereleases=True):
        print(line)
"""


def required_packages() -> list[str]:
    """This package's own requirements (no extras), as pip reads them.

    Examples:
        >>> any(r.startswith("orjson") for r in required_packages())
        True
    """
    requires = importlib.metadata.requires("llm-annotator") or []
    return [r for r in requires if "extra ==" not in r]


def missing_packages(python: str) -> list[str]:
    """The requirements that ``python`` does not satisfy.

    Raises:
        ConfigurationError: ``python`` could not be asked.
    """
    try:
        result = subprocess.run(
            [python, "-c", _MISSING_SCRIPT, *required_packages()],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise ConfigurationError(f"cannot run {python}: {error}") from error
    if result.returncode != 0:
        raise ConfigurationError(
            f"cannot list the packages {python} has: {result.stderr.strip()[-1000:]}"
        )
    return [line for line in result.stdout.splitlines() if line.strip()]


def annotator_environment(python: str | None = None) -> dict[str, str]:
    """Environment variables under which ``python`` (the vLLM one by default) imports
    llm-annotator: ``PYTHONPATH`` with this package and its missing requirements first,
    then whatever ``PYTHONPATH`` already held.

    Raises:
        ConfigurationError: The packages could not be installed or the cache written.
    """
    interpreter = python or find_vllm_python()
    paths = [str(_package_link()), str(_packages_for(interpreter))]
    given = os.environ.get("PYTHONPATH")
    if given:
        paths.append(given)
    return {"PYTHONPATH": os.pathsep.join(paths)}


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _package_link() -> Path:
    """A cache folder holding only a link to this package's folder."""
    package = Path(llm_annotator.__file__).resolve().parent
    folder = cache_dir() / f"annotator-link-{_key(str(package))}"
    link = folder / "llm_annotator"
    if link.is_symlink() and link.resolve() == package:
        return folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = folder / f".link-{os.getpid()}"
        scratch.unlink(missing_ok=True)
        scratch.symlink_to(package, target_is_directory=True)
        scratch.replace(link)
    except OSError as error:
        raise ConfigurationError(
            f"cannot write the cache {folder}: {error.strerror or error}; make it writable, "
            f"or point {CACHE_ENV} at a folder that is"
        ) from None
    return folder


def _packages_for(interpreter: str) -> Path:
    """The requirements ``interpreter`` lacks, installed once into the cache."""
    missing = missing_packages(interpreter)
    folder = cache_dir() / f"annotator-packages-{_key(interpreter, *missing)}"
    if (folder / COMPLETE_STAMP).is_file():
        return folder
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as error:
        raise ConfigurationError(
            f"cannot write the cache {folder.parent}: {error.strerror or error}; make it "
            f"writable, or point {CACHE_ENV} at a folder that is"
        ) from None
    try:
        if missing:
            _run_step(
                "install llm-annotator's packages beside vLLM",
                [
                    *_pip(interpreter),
                    "install",
                    "--quiet",
                    "--no-deps",
                    "--target",
                    str(scratch),
                    *missing,
                ],
                timeout=900,
            )
        (scratch / COMPLETE_STAMP).touch()
        _move_into_place(scratch, folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


__all__ = ["annotator_environment", "missing_packages", "required_packages"]
