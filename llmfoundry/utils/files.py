"""Local files written whole or not at all, URL joining and size parsing.

Every file another process may read while it is written (a shard, an index, a tokenizer, a
checkpoint pointer) goes through :func:`atomic_write`: the bytes go to a temporary name beside
the target, are flushed to disk, and take the target's name in one ``os.replace``. A reader sees
the old file or the new one, never a part, even after a crash or a power cut.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from llmfoundry.utils.errors import UserError

__all__ = [
    "FileWriter",
    "atomic_path",
    "atomic_write",
    "fsync_path",
    "join_url",
    "parse_size",
    "temp_name",
]

# Writes a whole file at the given local path (checkpoint files, atomic_write).
FileWriter = Callable[[Path], None]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "t": 1 << 40, "tb": 1 << 40}  # fmt: skip


def temp_name(path: Path) -> Path:
    """A name next to ``path`` that no other writer (process or thread) uses."""
    return path.with_name(f"{path.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:12]}")


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path to write; on success it is flushed and renamed to ``path``.

    For files written over time (a token stream); if the block raises, the temporary file is
    removed and ``path`` is untouched. The parent folder is created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: str | os.PathLike, data: bytes | str | FileWriter) -> None:
    """Write ``path`` so that readers see the old file or the whole new one, never a part.

    ``data`` is the content (``str`` is written as UTF-8) or a function that writes the file at
    the path it is given (for writers such as ``numpy.save`` or ``safetensors``).
    """
    with atomic_path(path) as tmp:
        if callable(data):
            data(tmp)
        else:
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def join_url(url: str, *parts: str) -> str:
    """Join path parts onto a URL or local path ("/" separators; empty parts are skipped)."""
    parts = tuple(p for p in parts if p)
    if not parts:
        return url
    return posixpath.join(url.rstrip("/") if url not in ("/", "") else url, *parts)


def parse_size(value: int | str | None, name: str = "size") -> int | None:
    """``67108864``, ``"64mb"``, ``"1.5gb"`` -> bytes (powers of 1024); None stays None.

    ``name`` is the setting being parsed, for the error message.
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and (
        m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    ):
        unit = _UNITS.get(m.group(2).lower())
        if unit is None:
            raise UserError(f"unknown size unit in {name}={value!r}; use b, kb, mb, gb or tb")
        size = int(float(m.group(1)) * unit)
    else:
        raise UserError(f"bad {name} {value!r}; use a byte count or text like '64mb'")
    if size <= 0:
        raise UserError(f"{name} must be positive, got {value!r}")
    return size
