"""Code outside llmfoundry/distributed asks a strategy what it can do (its flags:
`sharded_checkpoints`, `saves_own_checkpoints`, `pipeline`, its mesh's axes), never which class
it is: a strategy added later, or one of your own, then works wherever its flags say it may,
and a check such as `isinstance(strategy, DeepSpeed)` in checkpoint/ cannot creep back
unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

import llmfoundry.distributed as distributed
from llmfoundry.distributed import Strategy

PACKAGE = Path(distributed.__file__).resolve().parents[1]
STRATEGIES = {
    name
    for name in distributed.__all__
    if isinstance(getattr(distributed, name), type)
    and issubclass(getattr(distributed, name), Strategy)
} | {"ProcessGroupStrategy"}


def _type_checks(path: Path) -> list[str]:
    """`file:line` of each isinstance/issubclass call in `path` that names a strategy class."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        func = getattr(node, "func", None)
        if getattr(func, "id", None) in ("isinstance", "issubclass") and len(node.args) == 2:
            named = {
                getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(node.args[1])
            }
            if named & STRATEGIES:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_nothing_outside_the_strategies_tells_them_apart_by_class():
    assert {"DeepSpeed", "FSDP", "DDP", "SingleDevice"} <= STRATEGIES
    outside = [
        p
        for p in sorted(PACKAGE.rglob("*.py"))
        if "distributed" not in p.relative_to(PACKAGE).parts
    ]
    assert [hit for path in outside for hit in _type_checks(path)] == []
