"""Config schema checks before anything heavy: unknown keys, wrong types, impossible combinations.

Every object in the config is named by its ``_target_``; the target's own signature (or dataclass
fields) is the schema, so there is no second list of allowed keys to keep in sync. A problem is
reported as one `ConfigError` naming the key (``model.n_layer``), what is wrong, and what is
allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from collections import abc
from collections.abc import Callable
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

from llmfoundry.config.static_schema import static_schema
from llmfoundry.utils.errors import UserError

# Keys Hydra's instantiate understands in any node that has a _target_.
HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}


class ConfigError(UserError):
    """A config problem, with the dotted key it concerns."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


def suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}allowed: {', '.join(sorted(allowed))}"


def check_keys(path: str, given: list[str], allowed: list[str]) -> None:
    for key in given:
        if key not in allowed:
            raise ConfigError(
                f"{path}.{key}" if path else key, f"unknown key; {suggest(key, allowed)}"
            )


def check_type(key: str, value: Any, annotation: Any) -> None:
    """The value has the annotated type, and passes the checks an ``Annotated`` type carries
    (e.g. `llmfoundry.core.time.TimeString` parses the time string)."""
    if not _matches(value, annotation):
        raise ConfigError(
            key, f"expected {_describe(annotation)}, got {value!r} ({type(value).__name__})"
        )
    for validate in _validators(annotation, value):
        try:
            validate(value)
        except ValueError as err:
            raise ConfigError(key, str(err)) from None


def _describe(annotation: Any) -> str:
    """An annotation in the words of the config: enums list their values, null is null."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _describe(typing.get_args(annotation)[0])
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _validators(annotation: Any, value: Any) -> list[Callable[[Any], Any]]:
    """The callables in the ``Annotated`` metadata of the annotation's branch ``value`` takes."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        return [m for m in metadata if callable(m)] if _matches(value, base) else []
    if origin in (typing.Union, types.UnionType):
        return [v for arg in typing.get_args(annotation) for v in _validators(arg, value)]
    return []


def _matches(value: Any, annotation: Any) -> bool:
    if annotation in (Any, inspect.Parameter.empty) or isinstance(annotation, str):
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _matches(value, typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    container = origin or annotation
    if container in (list, tuple, abc.Sequence):
        return isinstance(value, (list, tuple, ListConfig))
    if container in (dict, abc.Mapping):
        return isinstance(value, (dict, DictConfig))
    return True  # anything richer is checked by the target itself


def _parameters(target: Callable) -> tuple[list[tuple[inspect.Parameter, Any]], bool]:
    """(parameter, annotation) of every keyword a target takes, and whether it takes any.

    A class whose ``__init__`` passes ``**kwargs`` on to its base (a dataset subclass adding a
    few arguments) takes the base's keywords too: they are followed up the MRO until an
    ``__init__`` without ``**kwargs``, so its config stays checked key by key.
    """
    is_class = inspect.isclass(target)
    levels: list[tuple[Callable, list[inspect.Parameter]]] = [
        (
            target.__init__ if is_class else target,
            list(inspect.signature(target).parameters.values()),
        )
    ]
    for base in target.__mro__[1:] if is_class else ():
        if base is not object and "__init__" in vars(base):
            levels.append(
                (base.__init__, list(inspect.signature(base.__init__).parameters.values())[1:])
            )
    found: dict[str, tuple[inspect.Parameter, Any]] = {}
    var_kwargs = False
    for function, parameters in levels:
        try:
            resolved = typing.get_type_hints(function, include_extras=True)
        except Exception:  # unresolvable forward references: check names only
            resolved = {}
        var_kwargs = False
        for param in parameters:
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                var_kwargs = True
            elif param.kind is not inspect.Parameter.VAR_POSITIONAL and param.name not in found:
                found[param.name] = (param, resolved.get(param.name, param.annotation))
        if not var_kwargs:
            break
    return list(found.values()), var_kwargs


def target_schema(target: Callable) -> tuple[dict[str, Any], bool]:
    """Parameter annotations of a target, and whether it takes arbitrary keyword arguments."""
    params, var_kwargs = _parameters(target)
    return {param.name: annotation for param, annotation in params}, var_kwargs


def validate_node(
    path: str, node: DictConfig, extra: dict[str, Any] | None = None, static: bool = False
) -> None:
    """Check one `_target_` node: the target exists, its keys and value types are allowed.

    ``extra``: annotations of keys the node may hold besides its target's (those a builder
    reads, e.g. the data group's splits). Dataclass targets are cheap and check their own
    combinations in ``__post_init__``, so they are built here too; other targets are only
    checked by signature. ``static``: read the signatures from the source instead of importing
    the targets (`static_schema`); a node whose target it cannot read is left to the full check.
    """
    target_name = node["_target_"]
    if static:
        schema = static_schema(target_name)
        if schema is None:
            return
        annotations, required, var_kwargs = schema.hints, schema.required, schema.var_kwargs
        target = None
    else:
        try:
            target = get_object(target_name)
        except Exception:
            raise ConfigError(f"{path}._target_", f"cannot import {target_name!r}") from None
        params, var_kwargs = _parameters(target)
        annotations = {param.name: annotation for param, annotation in params}
        required = [
            param.name
            for param, _ in params
            if param.default is inspect.Parameter.empty
            and param.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
        ]
    hints = annotations | (extra or {})
    keys = [k for k in node.keys() if k not in HYDRA_KEYS]
    if not var_kwargs:
        check_keys(path, keys, list(hints))
    partial = bool(node.get("_partial_", False))
    for key in keys:
        value = node[key]
        child = f"{path}.{key}"
        if isinstance(value, DictConfig) and "_target_" in value:
            validate_node(child, value, static=static)
            continue
        if key in hints:
            plain = (
                OmegaConf.to_container(value)
                if isinstance(value, (DictConfig, ListConfig))
                else value
            )
            check_type(child, plain, hints[key])
        validate_targets(child, value, static=static)  # nested in mappings: {label: node}
    missing = [name for name in required if name not in keys]
    if missing and not partial:
        raise ConfigError(path, f"missing required key(s) {', '.join(missing)} for {target_name}")
    if target is not None and dataclasses.is_dataclass(target):
        values = OmegaConf.to_container(node, resolve=True)
        try:
            target(**{k: v for k, v in values.items() if k not in HYDRA_KEYS})
        except (TypeError, ValueError) as err:
            raise ConfigError(path, str(err)) from None


def validate_targets(
    path: str, node: Any, extra: dict[str, Any] | None = None, static: bool = False
) -> None:
    """Validate every `_target_` node below `node` (``extra``, ``static``: see `validate_node`)."""
    if isinstance(node, DictConfig):
        if "_target_" in node:
            validate_node(path, node, extra, static)
            return
        for key in node.keys():
            validate_targets(f"{path}.{key}" if path else str(key), node[key], static=static)
    elif isinstance(node, ListConfig):
        for index, item in enumerate(node):
            validate_targets(f"{path}[{index}]", item, static=static)
