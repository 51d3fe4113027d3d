"""A pool of this process's open shard readers (LRU-bounded), over every stream's shards.

A reader maps its shard once; keeping a bounded number open makes random access cheap without
exhausting memory maps. A cached shard in use is checked at most once a second: still the file
we mapped (not deleted, by another process's eviction or by hand, nor replaced)? If not, it is
unmapped and fetched again, so a deleted file's space is freed and a fresh copy is read. With a
cache limit the same check re-touches the file (its mtime is the cross-process LRU clock), and a
shard evicted by this process is unmapped at once.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from llmfoundry.data.mds import ShardReader
from llmfoundry.data.streaming.cache import ShardCache
from llmfoundry.data.streaming.eviction import CacheLimiter

__all__ = ["ShardReaderPool"]

_TOUCH_EVERY_S = 1.0


@dataclass
class _Open:
    reader: ShardReader
    touched: float
    arrays: dict[str, np.ndarray]


class ShardReaderPool:
    """Readers for global shard numbers ``0 .. sum(len(cache.shards)) - 1``.

    Args:
        caches: one per stream, in stream order.
        limiter: the cache limit, or None.
        allow_unsafe: allow decoding pickle columns.
        max_open: readers kept open at once (least recently used are closed).
    """

    def __init__(
        self,
        caches: list[ShardCache],
        limiter: CacheLimiter | None,
        allow_unsafe: bool = False,
        max_open: int = 64,
    ) -> None:
        self.limiter = limiter
        self.allow_unsafe = allow_unsafe
        self.max_open = max_open
        self._where = [(c, j) for c in caches for j in range(len(c.shards))]
        starts = np.cumsum([0] + [len(c.shards) for c in caches])
        self._first = {c: int(start) for c, start in zip(caches, starts, strict=False)}
        self._open: OrderedDict[int, _Open] = OrderedDict()
        # Shards evicted by this process (possibly on the predownload thread); the reading
        # thread drops its maps of them, since their disk space is only freed once unmapped.
        self._evicted: set[int] = set()

    def fetch(self, shard: int) -> None:
        """Make ``shard`` local (download if needed) and keep the cache under its limit.

        Safe to call from another thread (the predownload thread) while readers are in use.
        """
        cache, j = self._where[shard]
        _, downloaded = cache.ensure(j)
        if downloaded and self.limiter is not None:
            for victim, k in self.limiter.enforce(keep=(cache, j)):
                self._evicted.add(self._first[victim] + k)

    def _lookup(self, shard: int) -> _Open:
        cache, j = self._where[shard]
        entry = self._open.get(shard)
        tracks_lru = self.limiter is not None and cache.evictable
        if entry is not None and self._evicted and shard in self._evicted:
            self._close(shard)  # this process evicted it: read the next copy, free the space
            entry = None
        if entry is not None:
            if cache.evictable and time.monotonic() - entry.touched >= _TOUCH_EVERY_S:
                if (not tracks_lru or cache.touch(j)) and cache.is_file(j, entry.reader.inode):
                    entry.touched = time.monotonic()
                else:  # deleted or replaced by another process: map the current copy instead
                    self._close(shard)
                    entry = None
            if entry is not None:
                self._open.move_to_end(shard)
                return entry
        self._evicted.discard(shard)
        for attempt in range(3):
            self.fetch(shard)
            try:
                reader = ShardReader(cache.path(j), cache.shards[j], self.allow_unsafe)
                break
            except FileNotFoundError:  # evicted between the fetch and the open
                if attempt == 2:
                    raise
        if tracks_lru:
            cache.touch(j)
        entry = _Open(reader, time.monotonic(), {})
        self._open[shard] = entry
        while len(self._open) > self.max_open:
            self._close(next(iter(self._open)))
        return entry

    def get(self, shard: int) -> ShardReader:
        """The open reader of ``shard``."""
        return self._lookup(shard).reader

    def array(self, shard: int, column: str) -> np.ndarray:
        """``shard``'s fixed-size ``column`` as one ``[samples, ...]`` view (see ShardReader)."""
        entry = self._open.get(shard)
        if (  # hot path: nothing to touch or re-check yet
            self.limiter is None
            and entry is not None
            and column in entry.arrays
            and (
                not self._where[shard][0].evictable
                or time.monotonic() - entry.touched < _TOUCH_EVERY_S
            )
        ):
            self._open.move_to_end(shard)
            return entry.arrays[column]
        entry = self._lookup(shard)
        view = entry.arrays.get(column)
        if view is None:
            view = entry.arrays[column] = entry.reader.array(column)
        return view

    def _close(self, shard: int) -> None:
        entry = self._open.pop(shard)
        entry.arrays.clear()
        entry.reader.close()
