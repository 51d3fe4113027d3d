"""No import runs up the layers: a package imports only packages on a lower layer (or itself),
and no modules import each other in a circle inside a package.

The layers, lowest first, are `LAYERS` below. Every ``import`` counts, including those inside
functions and under ``TYPE_CHECKING``: an annotation-only import is still a dependency, and a
deferred one is how cycles used to be dodged. Adding a package means giving it a layer here.
Inside a package the graph is per module (`import_circles`), with the same imports.
"""

from __future__ import annotations

import ast
import functools
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


@functools.cache  # both checks read every file: parsed once
def _imports(path: Path) -> frozenset[tuple[str, int]]:
    """(module, line) of every ``llmfoundry`` module the file imports, anywhere in it: for
    ``from a.b import c``, ``a.b.c`` (a module or not: `_module_of` resolves it)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        found |= {(m, node.lineno) for m in modules if m.startswith("llmfoundry.")}
    return frozenset(found)


def _imported_units(path: Path) -> set[tuple[str, int]]:
    """(unit, line) of every ``llmfoundry.<unit>`` the file imports, anywhere in it."""
    return {(module.split(".")[1], line) for module, line in _imports(path)}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_of(name: str, modules: set[str]) -> str | None:
    """The module `name` is or lives in (``a.b.c`` -> ``a.b`` when c is a name in a.b)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_circles() -> list[str]:
    """Each set of modules inside one package that import each other in a circle (a strongly
    connected component of the module graph, every import counted), as "a -> b -> ... -> a"."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {
        name: {
            target
            for module, _ in _imports(path)
            if (target := _module_of(module, set(paths))) not in (None, name)
        }
        for name, path in paths.items()
    }
    return [" -> ".join(_circle(graph, component)) for component in _components(graph)]


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, by breadth-first search."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph[node] & members):
            if target == start:
                return [*paths[node], start]
            if target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError(f"no circle through {start}")


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


def test_no_modules_import_each_other_in_a_circle():
    circles = import_circles()
    assert not circles, "modules importing each other in a circle:\n" + "\n".join(circles)


def test_the_checker_sees_a_deferred_import_circle(tmp_path, monkeypatch):
    """A circle closed by an import inside a function (how the KV cache once reached the
    families) is reported, with the modules in order."""
    fake = tmp_path / "llmfoundry"
    (fake / "models" / "layers").mkdir(parents=True)
    (fake / "models" / "__init__.py").write_text("")
    (fake / "models" / "families.py").write_text("from llmfoundry.models.layers import cache\n")
    (fake / "models" / "layers" / "cache.py").write_text(
        "def build():\n    from llmfoundry.models.families import family_of\n"
    )
    monkeypatch.setattr(f"{__name__}.PACKAGE", fake)
    assert import_circles() == [
        "llmfoundry.models.families -> llmfoundry.models.layers.cache -> llmfoundry.models.families"
    ]
