"""A small instruction set from Python sources: prompt a function's signature, answer its docstring.

Every Python ships its standard library as source, so the finetuning demo (``make
finetune-demo``) makes its data locally with no download: each documented top-level function or
method becomes ``{"prompt": "def name(args) -> ret:", "response": first docstring paragraph}``.
"""

from __future__ import annotations

import ast
import json
import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import atomic_write

__all__ = ["choice_task", "docstring_examples", "write_docstring_examples"]

log = logging.getLogger(__name__)


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"


def docstring_examples(source: str, max_response_chars: int = 400) -> Iterator[dict[str, str]]:
    """The ``{prompt, response}`` pairs of one module's source (nothing if it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("_"):
            continue
        first = doc.split("\n\n")[0].strip()
        if 10 <= len(first) <= max_response_chars:
            yield {"prompt": _signature(node), "response": first}


def choice_task(
    examples: Sequence[dict[str, str]], n_choices: int = 4, seed: int = 17
) -> list[dict]:
    """Multiple-choice lines ``{"query": prompt, "choices": [responses], "gold"}`` (see
    llmfoundry/eval/icl.py): each example's response among ``n_choices - 1`` others, drawn with
    a generator seeded by ``seed``; the query is the example's ``prompt`` as given."""
    responses = sorted({ex["response"] for ex in examples})
    if len(responses) < n_choices:
        raise UserError(f"{len(responses)} distinct responses, fewer than {n_choices} choices")
    rng = random.Random(seed)
    lines = []
    for ex in examples:
        others = rng.sample([r for r in responses if r != ex["response"]], n_choices - 1)
        gold = rng.randrange(n_choices)
        choices = others[:gold] + [ex["response"]] + others[gold:]
        lines.append({"query": ex["prompt"], "choices": choices, "gold": gold})
    return lines


def write_docstring_examples(
    roots: Sequence[str | Path], out: str | Path, excludes: Sequence[str] = ("test", "tests")
) -> int:
    """Write the pairs of every ``*.py`` under ``roots`` (sorted, skipping folders named in
    ``excludes``) to the .jsonl file ``out``, atomically; return how many."""
    lines = []
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            if any(part in excludes for part in path.relative_to(root).parts[:-1]):
                continue
            try:
                source = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            lines += [json.dumps(ex) + "\n" for ex in docstring_examples(source)]
    if not lines:
        raise UserError(f"no documented functions found under {list(map(str, roots))}")
    atomic_write(out, "".join(lines))
    log.info("%s: %d examples", out, len(lines))
    return len(lines)
