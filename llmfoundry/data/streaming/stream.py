"""One source of samples (a remote and/or local MDS folder) and how much of it an epoch takes.

Where the shards are read from:

- ``remote`` is an object-store URL (``s3://``, ``gs://``, ``az://``, ...): shards are copied
  into ``local`` on first use; ``local`` defaults to a folder under the system temp dir named
  after the remote and its endpoint (:func:`default_cache_dir`), so every process of a machine
  shares one cache.
- ``remote`` is a local path and ``local`` is None (or the same folder): read in place.
- ``remote`` is a local path and ``local`` another folder: copied like an object store (useful
  for a slow network filesystem and a fast local disk).
- ``remote`` is None: ``local`` is read in place.

In-place data is the only copy: it is never written to and never evicted. Compressed shards
cannot be read in place, so a folder that holds them is cached like a remote (decompressed into
the default cache folder, or ``local`` when it names another folder). A cache folder must be the
user's own (private.py); in-place data may belong to anyone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmfoundry.data.mds import INDEX_NAME, ShardInfo, load_index, parse_index
from llmfoundry.data.streaming.cache import ShardCache
from llmfoundry.data.streaming.download import list_dirs, read_bytes
from llmfoundry.data.streaming.node import NodeShare
from llmfoundry.data.streaming.private import private_folder
from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.files import atomic_write, join_url
from llmfoundry.utils.storage import endpoint, is_local, local_path

__all__ = ["Stream", "default_cache_dir"]

log = logging.getLogger(__name__)

_HOW_TO_MAKE = (
    "write MDS shards there first with the data_prep/ scripts (text -> tokens -> MDS; "
    "`make demo` writes the default config's data/demo/mds), "
    "or point remote (data.remote in a training config) at an existing MDS folder"
)


def default_cache_dir(remote: str, storage_options: dict[str, Any] | None = None) -> Path:
    """Cache folder for ``remote`` when none is given: the same on every process of a machine
    that reads it as this user from the same server.

    Under a root per user (``<tmp>/llmfoundry-streaming-<uid>``, mode 0700), so no other user
    can plant shards in it; named after the endpoint (storage.endpoint) as well as the URL, so
    ``s3://bucket/x`` of two S3-compatible servers are two caches, not one mixing both.
    """
    identity = {"url": remote.rstrip("/"), "endpoint": endpoint(remote, storage_options)}
    key = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"llmfoundry-streaming-{os.geteuid()}" / key


@dataclass(frozen=True)
class Stream:
    """An MDS folder and its share of each epoch.

    Args:
        remote: URL or local path of the dataset folder (the split is a sub-folder).
        local: cache folder for ``remote``, or the dataset folder itself when remote is None.
        split: sub-folder to read (``"train"``); None uses the dataset's split.
        proportion: relative share of the epoch (all streams or none set it).
        repeat: how many times to take each sample per epoch (``0.5`` half, ``2.5`` ...).
        choose: exactly how many samples per epoch.
    """

    remote: str | None = None
    local: str | None = None
    split: str | None = None
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        for name in ("remote", "local", "split"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"stream {name} must be a string path, got {value!r}")
        if self.remote is None and self.local is None:
            raise UserError("a stream needs remote (URL or path) or local (an MDS folder)")
        given = [n for n in ("proportion", "repeat", "choose") if getattr(self, n) is not None]
        if len(given) > 1:
            raise UserError(f"a stream sets at most one of proportion/repeat/choose, got {given}")
        for name in ("proportion", "repeat"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise UserError(f"stream {name} must be a positive number, got {value!r}")
        if self.choose is not None and (
            isinstance(self.choose, bool) or not isinstance(self.choose, int) or self.choose < 1
        ):
            raise UserError(f"stream choose must be a positive integer, got {self.choose!r}")

    def open(
        self,
        split: str | None = None,
        *,
        validate_hash: str | None = None,
        keep_zip: bool = False,
        storage_options: dict[str, Any] | None = None,
        retries: int = 2,
    ) -> ShardCache:
        """Read the stream's index (fetching it when remote) and return its shard cache."""
        split = self.split if self.split is not None else split
        remote = os.fspath(self.remote) if self.remote is not None else None
        local = os.fspath(self.local) if self.local is not None else None
        options = dict(validate_hash=validate_hash, keep_zip=keep_zip, retries=retries)
        if remote is not None and is_local(remote):
            remote = os.path.abspath(local_path(remote))
            if local is None or os.path.realpath(local) == os.path.realpath(remote):
                remote, local = None, remote
        if remote is None:
            folder = Path(local) / split if split else Path(local)  # type: ignore[arg-type]
            if not (folder / INDEX_NAME).is_file():
                raise MissingInput(_missing_local(folder, local, split))
            shards = load_index(folder)
            if not _compressed(folder, shards):
                return ShardCache(shards, folder, None, **options)
            # Compressed shards cannot be read in place, and in-place data is never written:
            # cache the folder like a remote, decompressed into the default cache folder.
            remote, local = os.path.abspath(local), None  # type: ignore[arg-type]
            log.info(
                "%s holds compressed shards: decompressing them into %s (set local, i.e. "
                "data.local, to choose the folder)",
                folder,
                default_cache_dir(remote, storage_options),
            )
        if local is None:
            root_local = default_cache_dir(remote, storage_options)
            private_folder(root_local.parent)  # the user's root of default caches
        else:
            root_local = Path(local)
        folder = root_local / split if split else root_local
        for level in dict.fromkeys((root_local, folder)):  # before anything is read from them
            private_folder(level)
        url = join_url(remote, split or "")
        index_url = join_url(url, INDEX_NAME)
        node = NodeShare(folder)  # local rank 0 fetches the index and listing for the machine
        try:
            text = node.get(
                INDEX_NAME, lambda: read_bytes(index_url, storage_options, retries), index_url
            )
        except FileNotFoundError:
            raise MissingInput(_missing(url, remote, split, storage_options)) from None
        shards = parse_index(text, index_url)
        cache = ShardCache(
            shards, folder, url, storage_options=storage_options, node=node, **options
        )
        if node.leader:  # the cache folder is a readable MDS dataset too
            atomic_write(folder / INDEX_NAME, text)
        return cache


def _compressed(folder: Path, shards: list[ShardInfo]) -> bool:
    """Whether some shard of ``folder`` is stored only compressed (its raw file is absent)."""
    return any(s.zip_basename and not (folder / s.raw_basename).is_file() for s in shards)


def _missing_local(folder: Path, root: str, split: str | None) -> str:
    """Why a local folder is not an MDS dataset, in one line with the fix."""
    if not folder.exists():
        missing = next(p for p in (folder, *folder.parents) if p.parent.exists())
        problem = f"data folder {missing} does not exist"
    elif not folder.is_dir():
        problem = f"{folder} is a file, not an MDS dataset folder"
    else:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        problem = f"{folder} is not an MDS dataset (no {INDEX_NAME}; it holds {shown or 'nothing'})"
    if split and Path(root).is_dir():
        problem += f"; available splits under {root}: {list_dirs(root)}"
    return f"{problem}. To fix: {_HOW_TO_MAKE}"


def _missing(
    folder: str, root: str | None, split: str | None, storage_options: dict[str, Any] | None
) -> str:
    msg = f"no MDS dataset at {folder}: {join_url(folder, INDEX_NAME)} does not exist"
    if split and root is not None:
        splits = list_dirs(root, storage_options)
        msg += (
            f"; available splits under {root}: {splits}"
            if splits
            else f"; {root} has no split folders with an {INDEX_NAME} either"
        )
    return f"{msg}. To fix: {_HOW_TO_MAKE}"
