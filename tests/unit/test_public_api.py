"""The package's public surface."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import llm_annotator


def test_all_lists_exactly_the_public_names() -> None:
    """Every name in __all__ imports, and every public attribute is in __all__."""
    for name in llm_annotator.__all__:
        assert hasattr(llm_annotator, name), name
    public = {
        name
        for name, value in vars(llm_annotator).items()
        if not name.startswith("_") and not isinstance(value, type(llm_annotator))
    }
    assert public == set(llm_annotator.__all__) - {"__version__"}


def test_seed_module_exports_its_documented_names() -> None:
    """The documented module offers exactly the names the user's document lists."""
    module = importlib.import_module("llm_annotator.clients.vllm_online_client")
    assert set(module.__all__) == {
        "MAX_CONNECTIONS",
        "VLLMBaseRuntimeOptions",
        "VLLMOnlineRuntimeOptions",
        "VLLMOnlineClient",
        "server_is_healthy",
    }
    assert module.MAX_CONNECTIONS == 8192


def test_package_ships_type_information() -> None:
    """py.typed is present, so users' type checkers read our annotations."""
    assert (Path(llm_annotator.__file__).parent / "py.typed").is_file()


def test_errors_share_one_root() -> None:
    """Every exception the package exports derives from LLMAnnotatorError."""
    for name in llm_annotator.__all__:
        value = getattr(llm_annotator, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, llm_annotator.LLMAnnotatorError), name


def _loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running ``code``."""
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return set(done.stdout.split())


HEAVY = {"pyarrow", "numpy", "jsonschema", "prometheus_client"}


@pytest.mark.parametrize(
    "code",
    [
        "import llm_annotator",
        "import llm_annotator.clients",
        "from llm_annotator import VLLMOnlineClient, VLLMOnlineRuntimeOptions",
        "from llm_annotator.clients.vllm_online_client import VLLMOnlineClient",
        "from llm_annotator import VLLMQueueAnnotator, ConfigurationError",
    ],
)
def test_importing_the_clients_or_the_pool_loads_no_arrow_or_numpy(code: str) -> None:
    """The public names are imported on first use (PEP 562): a client user pays for
    the client, not for the job layer's Arrow, NumPy, JSON Schema or metrics."""
    loaded = _loaded_after(code)
    assert loaded & HEAVY == set()
    assert not any(name.startswith("llm_annotator.jobs") for name in loaded)


def test_importing_the_package_loads_no_layer() -> None:
    """``import llm_annotator`` loads the errors and the Response only; every other
    public name resolves when first read, and dir() lists them all."""
    loaded = _loaded_after("import llm_annotator")
    ours = {name for name in loaded if name.startswith("llm_annotator")}
    assert ours == {
        "llm_annotator",
        "llm_annotator._lazy",
        "llm_annotator.errors",
        "llm_annotator.response",
    }
    assert "aiohttp" not in loaded
    assert "importlib.resources" not in loaded  # nor what importlib.abc pulls in
    assert set(llm_annotator.__all__) <= set(dir(llm_annotator))
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        llm_annotator.Nothing  # noqa: B018


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["status", "--help"],
        ["merge", "--help"],
        ["run", "--help"],
        ["demo", "--help"],
        ["serve-local", "--help"],
    ],
)
def test_the_commands_help_loads_no_job_layer_or_network_client(argv: list[str]) -> None:
    """``llm-annotator status --help`` declares only the status command: it loads no
    job layer, Arrow, NumPy or network client."""
    code = "\n".join(
        [
            "import contextlib",
            "from llm_annotator.cli import main",
            "with contextlib.suppress(SystemExit):",
            f"    main({argv!r})",
        ]
    )
    loaded = _loaded_after(code)
    assert loaded & {*HEAVY, "aiohttp", "structlog"} == set()
    assert not any(name.startswith(("llm_annotator.jobs", "llm_annotator.pool")) for name in loaded)


def test_status_of_a_run_loads_no_network_client(tmp_path: Path) -> None:
    """Reading a run directory (``llm-annotator status``) needs no pool and no client."""
    run = tmp_path / "run"
    run.mkdir()
    code = (
        "from llm_annotator.cli import main\n"
        f"assert main(['status', {str(run)!r}]) == 1  # no job in it: one line"
    )
    loaded = _loaded_after(code)
    assert "aiohttp" not in loaded
    assert "llm_annotator.pool.queue" not in loaded
    assert "llm_annotator.clients.openai_client" not in loaded


def test_the_job_layer_names_its_documented_api() -> None:
    """Every name in ``llm_annotator.jobs.__all__`` resolves, and each is the object its
    room defines (the reference documents them by room)."""
    import llm_annotator.jobs as jobs
    from llm_annotator.jobs.shards.merge import merge
    from llm_annotator.jobs.watch.status import run_status

    for name in jobs.__all__:
        assert getattr(jobs, name).__name__ == name
    assert set(jobs.__all__) <= set(dir(jobs))
    assert jobs.run_status is run_status
    assert jobs.merge is merge


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("llm_annotator.jobs.store", "llm_annotator.jobs.rundir.store"),
        ("llm_annotator.jobs.status", "llm_annotator.jobs.watch.status"),
        ("llm_annotator.jobs.report", "llm_annotator.jobs.loop.summary"),
        ("llm_annotator.jobs.inputs", "llm_annotator.jobs.rows.inputs"),
        ("llm_annotator.pool.pace", "llm_annotator.pool.tail"),
        ("llm_annotator.pool.scheduler", "llm_annotator.pool.failures"),
        ("llm_annotator.pool.policy", "llm_annotator.pool.failures"),
    ],
)
def test_a_module_of_the_flat_layout_still_imports_with_a_warning(old: str, new: str) -> None:
    """``from llm_annotator.jobs.store import ResultStore`` keeps working for a release:
    it warns, and gives the module at its new path, the same object."""
    code = "\n".join(
        [
            "import importlib, warnings",
            "with warnings.catch_warnings(record=True) as caught:",
            "    warnings.simplefilter('always')",
            f"    old = importlib.import_module({old!r})",
            f"new = importlib.import_module({new!r})",
            "assert old is new and new.__spec__.name == new.__name__",
            "print(caught[0].category.__name__, caught[0].message)",
        ]
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == (
        f"DeprecationWarning {old} moved to {new}; the old path goes in the next release"
    )


def test_an_old_module_path_spelled_like_a_public_name_leaves_the_name() -> None:
    """``llm_annotator.jobs.merge`` is the function, also after the flat layout's module
    ``llm_annotator.jobs.merge`` was imported by its old path."""
    code = "\n".join(
        [
            "import warnings",
            "warnings.simplefilter('ignore', DeprecationWarning)",
            "import importlib",
            "old = importlib.import_module('llm_annotator.jobs.merge')",
            "from llm_annotator.jobs.merge import merge_if_complete",
            "import llm_annotator.jobs as jobs",
            "from llm_annotator.jobs import merge",
            "assert callable(jobs.merge) and merge is jobs.merge, jobs.merge",
            "assert old is jobs.shards.merge and old.merge is merge",
            "assert merge_if_complete is jobs.merge_if_complete",
        ]
    )
    subprocess.run([sys.executable, "-c", code], timeout=60, check=True)


def test_a_name_that_never_was_a_module_of_the_job_layer_does_not_import() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("llm_annotator.jobs.nothing_here")


def test_the_pool_imports_no_job_layer_and_the_annotator_joins_them() -> None:
    """Parted layers: the pool alone (``QueuePool``) has no ``annotate``; the class users
    make is the pool with it, and the old path to it says where it went."""
    import llm_annotator.pool as pool
    from llm_annotator import VLLMQueueAnnotator

    assert issubclass(VLLMQueueAnnotator, pool.QueuePool)
    assert not hasattr(pool.QueuePool, "annotate")
    assert hasattr(VLLMQueueAnnotator, "aannotate")
    with pytest.raises(ImportError, match=r"now llm_annotator\.VLLMQueueAnnotator"):
        pool.VLLMQueueAnnotator  # noqa: B018
    with pytest.raises(ImportError, match=r"from llm_annotator import VLLMQueueAnnotator"):
        from llm_annotator.pool import VLLMQueueAnnotator as _gone  # noqa: F401
