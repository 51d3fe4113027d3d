"""Keep the bytes of cached shards under ``cache_limit`` by evicting least-recently-used ones.

Only shards with a remote copy are cache. A stream read in place (no remote, or a local remote
read without a copy) is the only copy of its data: its files are never counted and never
deleted. A limit on a dataset whose streams are all in place therefore does nothing, and says
so with a warning rather than silently deleting data, the failure this design exists to avoid.

Eviction is cooperative across processes sharing the cache: last use is the file's mtime (see
cache.py), each process evicts after its own downloads, and a shard being downloaded (its lock
held) or pinned by a reader that has yet to read it (its predownload window, pins.py) is
skipped. Concurrent evictors may together free a little more than needed; that costs
a re-download, never a wrong sample. When every remaining shard is in use the limit cannot be
met (the rest are being downloaded); the cache then grows past it with a warning instead of
failing the run.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

from llmfoundry.data.streaming.cache import ShardCache
from llmfoundry.data.streaming.pins import pinned
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import parse_size

__all__ = ["CacheLimiter", "working_set_bytes"]


class CacheLimiter:
    """Evicts shards of ``caches`` (the evictable ones) to keep them under ``limit`` bytes.

    Args:
        caches: every stream's cache; those without a remote copy are left alone.
        limit: bytes, or text like ``"10gb"`` (powers of 1024).
    """

    def __init__(self, caches: list[ShardCache], limit: int | str) -> None:
        self.limit = parse_size(limit, "cache_limit")
        self.caches = [c for c in caches if c.evictable]
        self._warned = False
        if not self.caches:
            warnings.warn(
                f"cache_limit={limit!r} has no effect: every stream is read in place from local "
                "files, which are the only copy of the data and are never evicted",
                stacklevel=3,
            )
            return
        largest = max(c.max_shard_bytes() for c in self.caches)
        if self.limit < largest:
            raise UserError(
                f"cache_limit={limit!r} ({self.limit} bytes) cannot hold the largest shard "
                f"({largest} bytes); raise cache_limit well above it (a shuffle block's shards "
                "should fit), or write smaller shards"
            )

    def enforce(self, keep: tuple[ShardCache, int] | None = None) -> list[tuple[ShardCache, int]]:
        """Evict least-recently-used shards until under the limit, sparing ``keep``.

        Returns the evicted (cache, shard) pairs.
        """
        entries = [(t, size, c, j) for c in self.caches for t, size, j in c.usage()]
        total = sum(e[1] for e in entries)
        evicted: list[tuple[ShardCache, int]] = []
        if total <= self.limit:
            return evicted
        spared = {id(c): pinned(c) for c in self.caches}  # a reader still needs them (pins.py)
        for _, _, cache, j in sorted(entries, key=lambda e: e[0]):
            if keep is not None and keep[0] is cache and keep[1] == j:
                continue
            if j in spared[id(cache)]:
                continue
            freed = cache.evict(j)
            if freed:
                evicted.append((cache, j))
                total -= freed
            if total <= self.limit:
                return evicted
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"shard cache holds {total} bytes, over cache_limit={self.limit}: the shards "
                "left are being downloaded or still to be read by a reader sharing the cache; "
                "raise cache_limit (it should hold the shards of a shuffle block plus the "
                "predownload window for every reader sharing the cache)",
                stacklevel=2,
            )
        return evicted


def working_set_bytes(
    steps: Sequence[np.ndarray], shard_bytes: np.ndarray, window_steps: int, complete: bool
) -> int:
    """The most bytes of shards that readers sharing a cache need at once.

    ``steps[t]`` are the shards the readers read at step ``t`` (together, in any order). A shard
    is needed from ``window_steps`` steps before its first use (predownload) until its last, so
    at step ``t`` the cache must hold every shard whose interval covers ``t``. With a shuffle,
    those are the shards of the readers' current blocks plus the predownload window. When the
    steps are only the first part of the epoch (``complete`` False), the last uses near their
    end are unknown, so only the first half of the steps counts.
    """
    if not steps:
        return 0
    n = len(shard_bytes)
    first = np.full(n, len(steps), np.int64)
    last = np.full(n, -1, np.int64)
    for t, shards in enumerate(steps):
        first[shards] = np.minimum(first[shards], t)
        last[shards] = t
    used = last >= 0
    live = np.zeros(len(steps) + 1, np.int64)
    np.add.at(live, np.maximum(first[used] - window_steps, 0), shard_bytes[used])
    np.add.at(live, last[used] + 1, -shard_bytes[used])
    counted = len(steps) if complete else max(1, len(steps) // 2)
    return int(np.cumsum(live)[:counted].max())
