"""Reading .jsonl files (local or fsspec URLs) line by line, with errors that name the line.

Instruction data (data/prep/instructions.py) and evaluation tasks (eval/icl.py) are both one
JSON object per line; this reader is the one place that parses them, so a bad line reads the
same everywhere: ``<url> line <n>: <problem>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from llmfoundry.utils import storage

__all__ = ["read_jsonl"]


def read_jsonl(url: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each JSON object of the .jsonl file ``url`` with where it stands (``"<url> line <n>"``).

    Blank lines are skipped. A line that is not JSON, or JSON but not an object, raises
    ValueError naming the line, so callers can prefix their own checks with ``where``.
    """
    with storage.open_url(url, "r", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{url} line {number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}: invalid JSON ({err.msg}); fix or remove the line"
                ) from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj
