"""Package namespaces whose names are imported on first use (PEP 562 ``__getattr__``).

A package ``__init__`` that imports its submodules eagerly makes every light submodule as heavy
as the heaviest: ``llmfoundry.core.time`` (Time strings, needed to check a config) would load
torch through ``llmfoundry.core.engine``. The packages on the config check's path
(`llmfoundry.config`) export their names lazily instead, so a config error is reported before
torch is imported (scripts/train.py answers it in about a second); ``from package import Name``
works as before and imports only the submodule that defines ``Name``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, modules: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for `package`, whose names ``modules`` lists by the
    submodule (relative, e.g. ``".engine"``) that defines them; a name is imported once, then
    cached."""
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__, sorted(exports)
