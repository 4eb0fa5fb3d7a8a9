"""The package's public surface."""

from __future__ import annotations

import importlib
from pathlib import Path

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
