"""A target's keyword schema read from its source, so a config error is reported before torch loads.

`schema.py` checks a node against its ``_target_``'s signature, which needs the target imported:
for an optimizer, a callback, a logger or a dataset that means importing torch (seconds), only to
say ``optimizer.lr: expected float, got 'abc'``. `static_schema` reads the same signature from
the module's source (``ast``; nothing is imported): the ``__init__`` of a class (followed to its
bases while it passes ``**kwargs`` on) or a function's parameters, with each annotation
evaluated over builtins and the names the module imports from modules already loaded (``typing``,
``TimeString`` from ``llmfoundry.core.time``, say). Anything it cannot read for certain (a
dataclass, an ``__init__`` inherited from outside the package, a name it cannot find) gives
None, and the node is checked only after the import, as before; an annotation it cannot evaluate
checks the key's name only. So this pass can report an error early but never one that the full
check would not report.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import sys
import typing
from functools import cache
from pathlib import Path
from typing import Any

__all__ = ["StaticSchema", "static_fields", "static_schema"]

# The builtins an annotation may name without importing them.
_BUILTINS: dict[str, Any] = {
    t.__name__: t for t in (int, float, str, bool, bytes, dict, list, tuple, set, type)
}


class StaticSchema(typing.NamedTuple):
    """What `schema.validate_node` needs of a target: annotation per keyword, the keywords
    without a default, and whether it takes arbitrary keywords."""

    hints: dict[str, Any]
    required: list[str]
    var_kwargs: bool
    keyword_only: list[str]


class _Module(typing.NamedTuple):
    name: str
    is_package: bool
    tree: ast.Module


@cache
def _module(name: str) -> _Module | None:
    """The parsed source of module `name`, found without importing it (or its packages)."""
    top, *rest = name.split(".")
    spec = importlib.machinery.PathFinder.find_spec(top)
    for part in rest:
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(part, spec.submodule_search_locations)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text(), filename=spec.origin)
    return _Module(name, bool(spec.submodule_search_locations), tree)


def _imported_from(module: _Module, name: str) -> str | None:
    """The absolute module that `module`'s top level imports `name` from, if it does: by
    ``from x import name``, or by a package's ``lazy_exports`` table (`llmfoundry.utils.lazy`)."""
    package = module.name if module.is_package else module.name.rpartition(".")[0]
    for node in module.tree.body:
        if isinstance(node, ast.ImportFrom) and any(
            (alias.asname or alias.name) == name and alias.name == name for alias in node.names
        ):
            if node.level == 0:
                return node.module
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            return f"{base}.{node.module}" if node.module else base
        if (source := _lazy_export(node, name)) is not None:
            return importlib.util.resolve_name(source, package)  # as lazy_exports imports it
    return None


def _lazy_export(node: ast.stmt, name: str) -> str | None:
    """The module that ``... = lazy_exports(__name__, {module: (names, ...), ...})`` names for
    `name` (as written: relative modules start with a dot), if `node` is that statement."""
    call = node.value if isinstance(node, ast.Assign) else None
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "lazy_exports"
        and len(call.args) == 2
        and isinstance(call.args[1], ast.Dict)
    ):
        return None
    for key, names in zip(call.args[1].keys, call.args[1].values, strict=True):
        if (
            isinstance(key, ast.Constant)
            and isinstance(names, (ast.Tuple, ast.List))
            and any(isinstance(n, ast.Constant) and n.value == name for n in names.elts)
        ):
            return key.value
    return None


def _definition(module_name: str, name: str, depth: int = 0) -> tuple[_Module, ast.AST] | None:
    """The class or function statement that defines `name` as seen from `module_name`,
    following ``from x import name`` re-exports (a package's ``__init__``)."""
    module = _module(module_name)
    if module is None or depth > 8:
        return None
    for node in module.tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return module, node
    source = _imported_from(module, name)
    return None if source is None else _definition(source, name, depth + 1)


def _evaluate(module: _Module, annotation: ast.expr | None) -> Any:
    """`annotation` as an object, or Any when it names something not safely at hand."""
    if annotation is None:
        return Any
    namespace: dict[str, Any] = {"__builtins__": {}}
    for name in {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)}:
        source = _imported_from(module, name)  # what the module's own imports bind it to
        loaded = sys.modules.get(source or "")
        if loaded is not None and hasattr(loaded, name):
            namespace[name] = getattr(loaded, name)
        elif source is None and name in _BUILTINS:
            namespace[name] = _BUILTINS[name]
        else:
            return Any  # defined here or in a module not loaded yet: the key's name is checked
    try:
        return eval(compile(ast.Expression(annotation), "<annotation>", "eval"), namespace)
    except Exception:
        return Any


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target).split(".")[-1] == "dataclass":
            return True
    return False


_Parameters = dict[str, tuple[Any, bool, bool]]  # keyword: (annotation, has default, kw-only)


def _parameters(
    module: _Module, function: ast.FunctionDef, skip_first: bool
) -> tuple[_Parameters, bool]:
    """The keywords of a function (`_Parameters`), and whether it takes **kwargs."""
    args = function.args
    positional = [*args.posonlyargs, *args.args][1 if skip_first else 0 :]
    defaults = [False] * (len(positional) - len(args.defaults)) + [True] * len(args.defaults)
    found = {
        a.arg: (_evaluate(module, a.annotation), d, False)
        for a, d in zip(positional, defaults, strict=True)
    }
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        found[arg.arg] = (_evaluate(module, arg.annotation), default is not None, True)
    return found, args.kwarg is not None


def _class_parameters(
    module: _Module, node: ast.ClassDef, depth: int = 0
) -> tuple[_Parameters, bool] | None:
    """As `schema._parameters` collects a class's: its ``__init__``, then its base's while
    ``**kwargs`` are passed on; None when any step is not in readable source."""
    if _is_dataclass(node) or depth > 8:
        return None
    init = next(
        (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    if init is not None and init.decorator_list:
        return None
    found: _Parameters = {}
    var_kwargs = True  # no __init__ of its own: its base's, as is
    if init is not None:
        found, var_kwargs = _parameters(module, init, skip_first=True)
    if not var_kwargs or (init is None and not node.bases and not node.keywords):
        return found, False  # (a class of no base and no __init__ takes no arguments)
    if len(node.bases) != 1 or not isinstance(node.bases[0], ast.Name):
        return None
    base = _definition(module.name, node.bases[0].id)
    if base is None or not isinstance(base[1], ast.ClassDef):
        return None
    inherited = _class_parameters(base[0], base[1], depth + 1)
    if inherited is None:
        return None
    return {**inherited[0], **found}, inherited[1]


def static_schema(target: str) -> StaticSchema | None:
    """The schema of ``_target_`` `target` from its source, or None (module docstring)."""
    module_name, _, name = target.rpartition(".")
    found = _definition(module_name, name)
    if found is None:
        return None
    module, node = found
    if isinstance(node, ast.ClassDef):
        parameters = _class_parameters(module, node)
    elif node.decorator_list:
        parameters = None  # a decorator may change the signature
    else:
        parameters = _parameters(module, node, skip_first=False)
    if parameters is None:
        return None
    params, var_kwargs = parameters
    return StaticSchema(
        hints={key: annotation for key, (annotation, _, _) in params.items()},
        required=[key for key, (_, has_default, _) in params.items() if not has_default],
        var_kwargs=var_kwargs,
        keyword_only=[key for key, (_, _, keyword) in params.items() if keyword],
    )


def static_fields(target: str) -> dict[str, Any] | None:
    """The fields (name: annotation) of dataclass `target` from its source, or None."""
    module_name, _, name = target.rpartition(".")
    found = _definition(module_name, name)
    if found is None or not isinstance(found[1], ast.ClassDef) or not _is_dataclass(found[1]):
        return None
    module, node = found
    if node.bases:
        return None  # fields inherited: not read here
    return {
        statement.target.id: _evaluate(module, statement.annotation)
        for statement in node.body
        if isinstance(statement, ast.AnnAssign)
        and isinstance(statement.target, ast.Name)
        and "ClassVar" not in ast.unparse(statement.annotation)
    }
