"""Fetch files from any fsspec URL (``s3://``, ``gs://``, ``az://``, a local path), with retries.

Object stores fail transiently (throttling, resets), so every fetch is retried with
exponential backoff; a missing file or a refused permission is permanent and raised at once.
Callers download into a temporary name (:func:`llmfoundry.utils.files.temp_name`) and rename,
so a reader never sees a partial file. Filesystems come from :mod:`llmfoundry.utils.storage`, so
the process-wide storage options apply.
"""

from __future__ import annotations

import os
import posixpath
import time
from typing import Any

from llmfoundry.utils import storage
from llmfoundry.utils.errors import MissingInput

__all__ = ["download", "list_dirs", "read_bytes"]

_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def _retry(what: str, fn: Any, retries: int, backoff: float) -> Any:
    for attempt in range(retries + 1):
        try:
            return fn()
        except _PERMANENT:
            raise
        except Exception as err:  # network stacks raise many types; all are worth a retry
            if attempt == retries:
                raise OSError(f"{what} failed after {retries + 1} attempt(s): {err!r}") from err
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")


def download(
    url: str,
    dest: str | os.PathLike,
    storage_options: dict[str, Any] | None = None,
    retries: int = 2,
    backoff: float = 0.5,
) -> None:
    """Copy ``url`` to the local file ``dest`` (overwritten; not atomic: pass a temp name)."""

    def fetch() -> None:
        fs, path = storage.url_to_fs(url, **(storage_options or {}))
        try:
            fs.get_file(path, os.fspath(dest))
        except FileNotFoundError:
            raise MissingInput(f"{url} does not exist") from None

    _retry(f"downloading {url}", fetch, retries, backoff)


def read_bytes(
    url: str,
    storage_options: dict[str, Any] | None = None,
    retries: int = 2,
    backoff: float = 0.5,
) -> bytes:
    """The contents of a (small) file at ``url``."""

    def fetch() -> bytes:
        fs, path = storage.url_to_fs(url, **(storage_options or {}))
        try:
            return fs.cat_file(path)
        except FileNotFoundError:
            raise MissingInput(f"{url} does not exist") from None

    return _retry(f"reading {url}", fetch, retries, backoff)


def list_dirs(url: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Names of the sub-folders of ``url`` that hold an index.json (for error messages)."""
    try:
        fs, path = storage.url_to_fs(url, **(storage_options or {}))
        entries = fs.ls(path, detail=True)
        names = [
            posixpath.basename(e["name"].rstrip("/")) for e in entries if e["type"] == "directory"
        ]
        return sorted(
            n
            for n in names
            if not n.startswith(".") and fs.exists(posixpath.join(path, n, "index.json"))
        )
    except Exception:  # only used to enrich an error message; never mask the real error
        return []
