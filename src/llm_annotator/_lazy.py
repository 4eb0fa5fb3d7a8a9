"""Public names of a package imported on first use (PEP 562).

A package's ``__init__`` names its public API without importing it, so importing one
light part (the errors, one client) does not load every layer: the job layer's Arrow
and NumPy, the network client's aiohttp.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from importlib.abc import Loader


def lazy_names(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``names`` (each public name and
    the module that defines it): a name is imported when first read, then kept in the
    package, so later reads do not come back here.

    Examples:
        >>> getattr_, dir_ = lazy_names("json", {"JSONDecoder": "json.decoder"})
        >>> getattr_("JSONDecoder").__name__, "JSONDecoder" in dir_()
        ('JSONDecoder', True)
        >>> getattr_("nothing")
        Traceback (most recent call last):
        ...
        AttributeError: module 'json' has no attribute 'nothing'
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*names, *vars(sys.modules[package])})

    return __getattr__, __dir__


def moved_modules(package: str, moves: Mapping[str, str]) -> None:
    """Keep the old paths of the modules of ``package`` that moved (each old name and
    its new path under ``package``) importable for a release: importing one warns
    (:class:`DeprecationWarning`) and gives the module at its new path, the same object,
    so that its private names and a test's patches reach it too.

    Installed once per package, after the file system's finders: an old path that a
    file still holds is never shadowed.

    Examples:
        >>> import warnings
        >>> moved_modules("json", {"old_decoder": "decoder"})
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     import json.old_decoder
        >>> import json.decoder
        >>> json.old_decoder is json.decoder, json.decoder.__spec__.name
        (True, 'json.decoder')
        >>> str(caught[0].message)
        'json.old_decoder moved to json.decoder; the old path goes in the next release'
        >>> sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "package", 0) != "json"]
        >>> del sys.modules["json.old_decoder"], json.old_decoder
    """
    if not any(getattr(f, "package", None) == package for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder(package, dict(moves)))
    sys.modules[package].__class__ = _KeepsPublicNames


class _KeepsPublicNames(ModuleType):
    """A package whose public names (its ``__all__``) no submodule replaces: importing
    an old module path spelled like a public name (``jobs.merge``, the module, beside
    ``jobs.merge``, the function) leaves the name as it is."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ModuleType) and name in self.__dict__.get("__all__", ()):
            return  # the import system sets each submodule on its package: not this one
        super().__setattr__(name, value)


class _MovedFinder:
    """A meta path finder (``sys.meta_path``) for the old paths of ``package``; not an
    ``importlib.abc`` subclass, whose import loads ``importlib.resources`` and more."""

    def __init__(self, package: str, moves: dict[str, str]) -> None:
        self.package = package
        self.moves = moves

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != self.package or name not in self.moves:
            return None
        loader = cast("Loader", _Alias(f"{self.package}.{self.moves[name]}"))
        return ModuleSpec(fullname, loader)


class _Alias:
    """Gives the module at ``target`` for an old path."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.target}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system labelled the module with the old path's spec: give it back
        # its own, so that it stays the module at its new path in every respect.
        module.__spec__ = self._spec
