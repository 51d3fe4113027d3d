"""Inter-process file locks (``fcntl.flock``) guarding one shard of a shared cache folder.

Why flock and not shared memory: the kernel drops a flock the moment its holder exits, even
by SIGKILL, so a crashed process never leaves a lock behind, and lock files live in the cache
folder itself, so two runs or eight local ranks that share the folder share the locks, with no
global names that could collide. Separate ``open`` calls conflict even within one process, so
the same lock also orders threads (the predownload thread and the reader).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["file_lock"]


@contextmanager
def file_lock(path: str | os.PathLike, blocking: bool = True) -> Iterator[bool]:
    """Hold an exclusive lock on ``path`` (created if needed); yields whether it was acquired.

    With ``blocking=False`` it yields False at once when another holder has the lock.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock
