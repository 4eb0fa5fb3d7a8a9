"""Public names of a package imported on first use (PEP 562).

A package's ``__init__`` names its public API without importing it, so importing one
light part (the errors, one client) does not load every layer: the job layer's Arrow
and NumPy, the network client's aiohttp.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


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
