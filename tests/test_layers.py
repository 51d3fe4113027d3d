"""No import runs up the layers: a package imports only packages on a lower layer (or itself).

The layers, lowest first, are `LAYERS` below. Every ``import`` counts, including those inside
functions and under ``TYPE_CHECKING``: an annotation-only import is still a dependency, and a
deferred one is how cycles used to be dodged. Adding a package means giving it a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llmfoundry"

# Lowest first. Packages on one layer do not import each other.
LAYERS: list[set[str]] = [
    {"utils", "rng"},
    {"core"},
    {"tokenizers"},
    {"data", "models", "loggers"},
    {"distributed"},
    {"checkpoint", "optim", "eval"},
    {"algorithms", "callbacks", "config", "serving", "planning", "harness"},
    {"trainer", "launch"},
    {"build"},
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names}


def _unit(path: Path) -> str:
    """The package (or top-level module) a file belongs to: ``llmfoundry/<unit>/...``."""
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def _imported_units(path: Path) -> set[tuple[str, int]]:
    """(unit, line) of every ``llmfoundry.<unit>`` the file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
            if node.module == "llmfoundry":
                modules = [f"llmfoundry.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] == "llmfoundry" and len(parts) > 1:
                found.add((parts[1], node.lineno))
    return found


def upward_imports() -> list[str]:
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue
        unit = _unit(path)
        for imported, line in sorted(_imported_units(path)):
            if imported == unit:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line} ({unit} -> {imported})"
            if unit not in LAYER or imported not in LAYER:
                violations.append(f"{where}: give the package a layer in tests/test_layers.py")
            elif LAYER[imported] >= LAYER[unit]:
                violations.append(where)
    return violations


def test_every_package_has_a_layer():
    units = {
        _unit(p) for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE) != Path("__init__.py")
    }
    assert units <= set(LAYER), f"packages without a layer: {sorted(units - set(LAYER))}"


def test_no_import_runs_up_the_layers():
    violations = upward_imports()
    assert not violations, "imports up (or across) the layers:\n" + "\n".join(violations)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The checker itself can fail: a `core` module importing the trainer is reported."""
    fake = tmp_path / "llmfoundry"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "state.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmfoundry.trainer import Trainer\n"
    )
    monkeypatch.setattr(f"{__name__}.PACKAGE", fake)
    assert upward_imports() == ["llmfoundry/core/state.py:3 (core -> trainer)"]
