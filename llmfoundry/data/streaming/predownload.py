"""A background thread that downloads the shards a reader will need next.

The iterator looks ahead ``predownload`` samples into its own sample order and hands the shards
of that window to this thread in order of first use, so downloads overlap with training instead
of stalling it. Failures are left for the reader: it fetches the shard itself when it gets
there and raises the real error in the main thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["Predownloader"]

log = logging.getLogger(__name__)


class Predownloader:
    """Runs ``fetch(shard)`` for each requested shard, in request order, on a daemon thread."""

    def __init__(self, fetch: Callable[[int], None]) -> None:
        self._fetch = fetch
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="predownload", daemon=True)
        self._thread.start()

    def request(self, shard: int) -> None:
        """Queue ``shard`` for download (a shard already local costs one stat)."""
        self._queue.put(shard)

    def close(self) -> None:
        """Stop after the download in progress; queued requests are dropped."""
        self._stop.set()
        self._queue.put(None)

    def _run(self) -> None:
        while not self._stop.is_set():
            shard = self._queue.get()
            if shard is None or self._stop.is_set():
                return
            try:
                self._fetch(shard)
            except Exception as err:  # the reader re-fetches and reports it where it matters
                log.debug("predownload of shard %d failed: %r", shard, err)
