"""Reading .jsonl files (local or fsspec URLs) line by line, with errors that name the line.

Instruction data (data/prep/instructions.py) and evaluation tasks (eval/icl.py) are both one
JSON object per line; this reader is the one place that parses them, so a bad line reads the
same everywhere: ``<url> line <n>: <problem>``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, BinaryIO

from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput, UserError

__all__ = ["MAX_LINE_BYTES", "read_jsonl"]

# An example or task line is text for a context of at most a few hundred thousand tokens; a line
# far beyond that is a broken file (a dump without newlines), and reading it whole to refuse it
# afterwards took a 300 MB line to 16.7 GB of memory before the kernel killed the process.
MAX_LINE_BYTES = 16 * 2**20
_CHUNK = 1 << 20


def read_jsonl(
    url: str, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each JSON object of the .jsonl file ``url`` with where it stands (``"<url> line <n>"``).

    Blank lines are skipped. A line that is longer than ``max_line_bytes`` (found while reading
    it, in bounded chunks), not UTF-8, not JSON, or JSON but not an object raises `UserError`
    naming the line, so callers can prefix their own checks with ``where``.
    """
    try:
        f = storage.open_url(url, "rb").open()  # opened here, so a missing file is named
    except FileNotFoundError:
        raise MissingInput(f"{url} does not exist; check the path") from None
    with f:
        for number, raw in enumerate(_lines(f, url, max_line_bytes), 1):
            where = f"{url} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(
                    f"{where}: not UTF-8 (byte {err.start} of the line: {err.reason}); "
                    "re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(
                    f"{where}: invalid JSON ({err.msg}); fix or remove the line"
                ) from None
            if not isinstance(obj, dict):
                raise UserError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def _lines(f: BinaryIO, url: str, limit: int) -> Iterator[bytes]:
    """The lines of `f` (without their newline), never holding more than `limit` bytes of one."""
    pending, number = b"", 1
    while chunk := f.read(_CHUNK):
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete:
            if len(line) > limit:
                break
            yield line
            number += 1
        else:
            if len(pending) <= limit:
                continue
        raise UserError(
            f"{url} line {number}: longer than {limit:,} bytes (the limit of one example or "
            "task line); split the file into lines, or raise the limit (--max-example-bytes "
            "in data_prep/instructions_to_mds.py)"
        )
    if pending:
        yield pending
