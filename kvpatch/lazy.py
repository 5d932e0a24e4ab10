"""Names a package exports, imported on first use.

``import kvpatch`` and the ``kvpatch`` command's ``--help`` and argument errors then cost no torch
or transformers import (several seconds on a small machine): the first name used imports the
module that defines it, once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def lazy_exports(
    package: str, exports: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps each module to the
    names it gives the package; any other name is tried as a submodule (``kvpatch.compat``)."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> object:
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
        else:
            value = _submodule(package, name)
        setattr(sys.modules[package], name, value)  # found once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__


def _submodule(package: str, name: str) -> object:
    try:
        return importlib.import_module(f"{package}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{package}.{name}":
            raise  # the submodule exists and failed to import something of its own
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
