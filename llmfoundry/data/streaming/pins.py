"""Pins: the shards a reader still has to read, which no evictor sharing its cache may delete.

Least-recently-used eviction alone thrashes when a cache is tight: a shard predownloaded for a
batch a few steps ahead has not been read yet, so it looks older than the shards being read,
and the next download evicts it; its reader then fetches it again, evicting another one. So
each iterating reader (a rank, or one of its DataLoader workers) publishes the shards of its
predownload window and of the batch it is reading in the cache folder, and an evictor skips
them all (eviction.py). A cache smaller than the readers' pinned shards then grows past
``cache_limit`` (with a warning) instead of downloading a shard twice.

    <local>/.pins/<reader>.lock   flock held by the reader while it lives
    <local>/.pins/<reader>.json   its pinned shards (indices into the stream's index)

The lock tells a live reader's pins from a crashed one's: the kernel releases a dead
process's flock, so an evictor that can take the lock deletes the leftover files.
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import ExitStack
from pathlib import Path

from llmfoundry.data.streaming.cache import ShardCache
from llmfoundry.data.streaming.locking import file_lock
from llmfoundry.utils.files import atomic_write

__all__ = ["Pins", "pinned"]

_PINS = ".pins"


class Pins:
    """This reader's pinned shards in every evictable cache (global shard numbers in, as the
    reader pool numbers them: stream 0's shards first)."""

    def __init__(self, caches: list[ShardCache]) -> None:
        self._where = [(c, j) for c in caches for j in range(len(c.shards))]
        self._caches = [c for c in caches if c.evictable]
        self._name = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._held = ExitStack()
        self._current: frozenset[int] = frozenset()
        for cache in self._caches:
            self._held.enter_context(file_lock(_folder(cache) / f"{self._name}.lock"))

    def set(self, shards: frozenset[int]) -> None:
        """Pin exactly ``shards`` (a write only when the set changed)."""
        if shards == self._current:
            return
        self._current = shards
        per_cache: dict[int, list[int]] = {id(c): [] for c in self._caches}
        for shard in shards:
            cache, j = self._where[shard]
            if id(cache) in per_cache:
                per_cache[id(cache)].append(j)
        for cache in self._caches:
            atomic_write(_folder(cache) / f"{self._name}.json", json.dumps(per_cache[id(cache)]))

    def close(self) -> None:
        """Unpin everything (the reader is done)."""
        for cache in self._caches:
            (_folder(cache) / f"{self._name}.json").unlink(missing_ok=True)
            (_folder(cache) / f"{self._name}.lock").unlink(missing_ok=True)
        self._held.close()


def pinned(cache: ShardCache) -> set[int]:
    """Shards of ``cache`` that a live reader still needs; a dead reader's pins are deleted."""
    out: set[int] = set()
    for record in _folder(cache).glob("*.json"):
        lock = record.with_suffix(".lock")
        with file_lock(lock, blocking=False) as free:
            if free:  # nobody holds it: the reader is gone (or has not pinned anything yet)
                record.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
                continue
        try:
            out.update(json.loads(record.read_text()))
        except (FileNotFoundError, ValueError):  # closed meanwhile
            pass
    return out


def _folder(cache: ShardCache) -> Path:
    return cache.local / _PINS
