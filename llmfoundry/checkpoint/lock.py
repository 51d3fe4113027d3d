"""One run per folder: a run holds a lock on its run folder and its save folder while it lives.

Two launches of one `run_name` would otherwise write the same checkpoints, staging folders and
`metrics.jsonl` at once. The second one stops at start with one line naming the holder.

- Local folders: ``<folder>/.lock`` held with ``flock``. The kernel releases it when the process
  dies, however it dies, so a crashed run never blocks its relaunch.
- Object stores (fsspec URLs): no store offers a lock that dies with a process, so
  ``<folder>/.lock`` is a lease, a small JSON object naming the holder and when the lease
  expires. The holder renews it from a background thread every third of its length; a lease
  left by a killed run blocks others until it expires (or at once, when the holder was on this
  machine and its process is gone); a run that could not renew in time and finds its lease
  taken over stops at the next batch end, before it saves. Object stores have no atomic
  create-if-absent that every fsspec backend exposes, so two launches in the same instant are
  told apart by writing, waiting and reading back: the later writer wins and the other stops.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, BinaryIO

from fsspec.implementations.local import LocalFileSystem

from llmfoundry.checkpoint.manifest import CheckpointError
from llmfoundry.checkpoint.writer import probe_writable
from llmfoundry.core.engine import Callback
from llmfoundry.utils import storage
from llmfoundry.utils.files import join_url

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"
LEASE_SECONDS = 120.0


class FolderLock(Callback):
    """Holds the lock on `folder` (a local path or fsspec URL) from `acquire` until `close`.

    `what` names the folder in messages ("run folder", "save_folder"). A callback, so the
    trainer releases it when training ends, even after an error.
    """

    def __init__(self, folder: str, what: str, lease_seconds: float = LEASE_SECONDS) -> None:
        self.folder = folder
        self.what = what
        self.lease_seconds = lease_seconds
        self.token = uuid.uuid4().hex
        self.since = time.time()
        self._fs, root = storage.url_to_fs(folder)
        self._path = join_url(root, LOCK_FILE)
        self._file: BinaryIO | None = None  # closing it (even by garbage collection) unlocks
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._lost_to: dict[str, Any] | None = None  # who took an expired lease over

    def batch_end(self, state: Any, logger: Any) -> None:
        """Stop before the next checkpoint if another run took the lease over (this one could
        not renew it in time: a paused process, a store unreachable for a whole lease)."""
        if self._lost_to is not None:
            raise CheckpointError(
                f"lost the lock on {self.what} {self.folder} to another run "
                f"({_describe(self._lost_to)}); stopped before saving over its checkpoints: "
                "let one of the two runs continue (autoresume=true)"
            )

    def acquire(self) -> FolderLock:
        if isinstance(self._fs, LocalFileSystem):
            self._acquire_local()
        else:
            self._acquire_lease()
        return self

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._renewer is not None:
            self._stop.set()
            self._renewer.join()
            self._renewer = None
            try:
                if self._read_lease().get("token") == self.token:
                    self._fs.rm(self._path)
            except Exception as err:  # noqa: BLE001 - runs while training ends, maybe on error
                log.warning(
                    "could not remove the lease %s (it expires by itself): %s", self._path, err
                )

    # ------------------------------------------------------------------ local: flock
    def _acquire_local(self) -> None:
        os.makedirs(os.path.dirname(self._path), exist_ok=True)
        file = open(self._path, "a+b")  # noqa: SIM115 - held open while the run lives
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = _parse(file.read(4096))
            file.close()
            raise self._in_use(holder) from None
        file.truncate(0)
        file.write(json.dumps(self._holder()).encode())
        file.flush()
        self._file = file

    # ------------------------------------------------------------------ object stores: lease
    def _acquire_lease(self) -> None:
        holder = self._read_lease()
        if holder and holder.get("token") != self.token and not _expired_or_dead(holder):
            raise self._in_use(holder)
        self._write_lease()
        time.sleep(min(0.2, self.lease_seconds / 10))  # a launch in the same instant shows here
        holder = self._read_lease()
        if holder.get("token") != self.token:
            raise self._in_use(holder)
        self._renewer = threading.Thread(target=self._renew, name="lease-renewer", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_seconds / 3):
            try:
                holder = self._read_lease()
                if holder.get("token") != self.token:
                    self._lost_to = holder
                    return
                self._write_lease()
            except Exception as err:  # noqa: BLE001 - a flaky store must not kill training
                log.warning("could not renew the lock on %s: %s", self.folder, err)

    def _read_lease(self) -> dict[str, Any]:
        try:
            return _parse(self._fs.cat_file(self._path))
        except FileNotFoundError:
            return {}

    def _write_lease(self) -> None:
        lease = {**self._holder(), "expires": time.time() + self.lease_seconds}
        self._fs.pipe_file(self._path, json.dumps(lease).encode())

    # ------------------------------------------------------------------
    def _holder(self) -> dict[str, Any]:
        host, pid = socket.gethostname(), os.getpid()
        return {"host": host, "pid": pid, "since": self.since, "token": self.token}

    def _in_use(self, holder: dict[str, Any]) -> CheckpointError:
        url = self._fs.unstrip_protocol(self._path)
        expiry = (
            f"; its lease expires at {_utc(holder['expires'])} unless renewed, or delete {url} "
            "if that run is dead"
            if "expires" in holder
            else ""
        )
        return CheckpointError(
            f"{self.what} {self.folder} is in use by another run ({_describe(holder)}): wait for "
            f"it to end or give this run another run_name/save_folder{expiry}"
        )


def lock_run_folders(run_dir: str, save_folder: str | None) -> list[FolderLock]:
    """Check that `save_folder` takes writes (a probe object), then lock the run folder and the
    save folder; returns the held locks, to pass to the trainer as callbacks (rank 0 only)."""
    if save_folder:
        probe_writable(save_folder)
    locks: list[FolderLock] = []
    try:
        for folder, what in ((run_dir, "run folder"), (save_folder, "save_folder")):
            if folder:
                locks.append(FolderLock(folder, what).acquire())
    except BaseException:
        for lock in locks:
            lock.close()
        raise
    return locks


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        holder = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    since = holder.get("since")
    return (
        f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
        f"since {_utc(since) if isinstance(since, int | float) else '?'}"
    )


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))


def _expired_or_dead(holder: dict[str, Any]) -> bool:
    """A lease that nobody renews any more: expired, or held by a process of this machine
    that no longer exists."""
    if not isinstance(holder.get("expires"), int | float) or holder["expires"] < time.time():
        return True
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
