"""Metadata fetched once per machine: the local leader fetches, the other local ranks read its copy.

Every rank of a run opens the same streams, and opening one costs requests to the object store:
the split's ``index.json``, the listing that tells a stale cached shard from a current one
(cache.py) and data_prep's ``meta.json``. At 256 ranks that is over a thousand requests at
every start, all for identical bytes. So on each machine one process, local rank 0 (torchrun's
``LOCAL_RANK``), fetches them into the machine's cache folder and the other local ranks wait for
its copy. DataLoader workers copy the dataset from their rank's process and never fetch.

A copy must be this launch's, never one a previous run left in the cache (the remote may have
been rewritten since, and every local rank must see the same index, or their orders differ). A
copy is therefore stamped with the launch: the local ranks of one launch on one machine share
their parent process (the torchrun agent, or the launcher that started them), its start time and
torchrun's restart count. When the leader's fetch fails, it records the error in place of the
copy, so the other ranks fail with it at once instead of timing out.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from llmfoundry.data.streaming.world import World, _env_int
from llmfoundry.utils.errors import MissingInput
from llmfoundry.utils.files import atomic_write

__all__ = ["NodeShare"]

_FOLDER = ".node"
# How long a local rank waits for the leader's copy; generous, since the leader may be slow to
# start (imports, a cold object store), yet a dead leader must not hang the run forever.
WAIT_S = 600.0
_STALE_S = 24 * 3600.0  # other launches' copies older than this are deleted


def _launch_key() -> str:
    """What the local ranks of one launch on one machine have in common (module docstring)."""
    parent = os.getppid()
    try:  # the parent's start time (clock ticks since boot), so a reused pid is another launch
        started = Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = ""
    words = [
        str(parent),
        started,
        os.environ.get("TORCHELASTIC_RUN_ID", ""),
        os.environ.get("TORCHELASTIC_RESTART_COUNT", ""),
    ]
    return hashlib.sha1("\0".join(words).encode()).hexdigest()[:16]


class NodeShare:
    """Fetches named small files once per machine into ``folder`` (module docstring).

    Args:
        folder: the machine's cache folder of one stream (every local rank passes the same).
        local_rank, local_world_size: this process among the machine's ranks; default
            torchrun's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        local_rank: int | None = None,
        local_world_size: int | None = None,
    ) -> None:
        if local_rank is None or local_world_size is None:
            size = _env_int("LOCAL_WORLD_SIZE", _env_int("WORLD_SIZE", 1))
            local_rank, local_world_size = _env_int("LOCAL_RANK", 0), size
        World(rank=local_rank, world_size=local_world_size)  # validates the pair
        self.folder = Path(folder) / _FOLDER
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self._key = _launch_key()

    @property
    def leader(self) -> bool:
        """Whether this process fetches (local rank 0)."""
        return self.local_rank == 0

    def get(self, name: str, fetch: Callable[[], bytes], what: str) -> bytes:
        """The bytes ``fetch()`` returns, fetched by the leader; the others read its copy.

        ``what`` names the source (a URL) in errors. A FileNotFoundError of the leader's fetch
        is raised as FileNotFoundError on every local rank, any other error as OSError.
        """
        path = self.folder / f"{name}.{self._key}"
        if self.leader:
            try:
                data = fetch()
            except FileNotFoundError as err:
                self._record(path, {"missing": str(err)})
                raise
            except Exception as err:
                self._record(path, {"error": f"{type(err).__name__}: {err}"})
                raise
            self._record(path, {"size": len(data)}, data)
            self._forget_old(name)
            return data
        return self._wait(path, what)

    def _record(self, path: Path, header: dict, data: bytes = b"") -> None:
        if self.local_world_size == 1:
            return  # nobody reads it
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(header).encode() + b"\n" + data)

    def _wait(self, path: Path, what: str) -> bytes:
        deadline = time.monotonic() + WAIT_S
        pause = 0.01
        while True:
            try:
                raw = path.read_bytes()
                break
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"local rank {self.local_rank} waited {WAIT_S:.0f} s for local rank 0 "
                        f"to fetch {what} into {path}; local rank 0 failed or is stuck (see "
                        "its log), or this machine's ranks do not share the cache folder "
                        "(give them the same data.local)"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.5)
        line, _, data = raw.partition(b"\n")
        header = json.loads(line)
        if "missing" in header:
            raise MissingInput(header["missing"])
        if "error" in header:
            raise OSError(f"local rank 0 could not fetch {what}: {header['error']}")
        return data

    def _forget_old(self, name: str) -> None:
        """Delete copies that other launches left behind long ago (they are never read)."""
        now = time.time()
        for old in self.folder.glob(f"{name}.*"):
            try:
                if now - old.stat().st_mtime > _STALE_S:
                    old.unlink()
            except FileNotFoundError:
                pass
