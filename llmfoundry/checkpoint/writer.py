"""Writing a checkpoint so that it counts only once every file of every rank is there (the
write protocol); the folder it goes into is described in catalogue.py.

The manifest is written after every file of every rank, so a save killed half-way never makes
a checkpoint that counts. On a local disk each rank writes into its own scratch folder, whose
files move into a hidden staging folder that is renamed into place with its manifest; on an
object store the files are uploaded into the checkpoint's folder and the manifest goes last.
`latest` is then replaced in one step (a rename on a local disk, a single PUT on an object
store).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import fsspec
import safetensors.torch
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from llmfoundry.checkpoint.catalogue import CHECKPOINT_NAME, LATEST
from llmfoundry.checkpoint.manifest import (
    MANIFEST,
    CheckpointError,
    Entries,
    hash_tree,
    manifest_bytes,
)
from llmfoundry.utils import storage
from llmfoundry.utils.files import FileWriter, atomic_write, fsync_path, join_url

log = logging.getLogger(__name__)

_TMP_PREFIX = "llmfoundry-ckpt-"  # local scratch folders of saves to object stores


def write_tensors(tensors: Mapping[str, torch.Tensor]) -> FileWriter:
    """A writer of a safetensors file (tensors must not share memory). Whoever saves weights
    refuses non-finite ones first, on every rank at once (llmfoundry/checkpoint/finite.py)."""
    return lambda path: safetensors.torch.save_file(dict(tensors), str(path))


def write_object(obj: Any) -> FileWriter:
    """A writer of tensors in plain containers, readable with ``weights_only=True``."""
    return lambda path: torch.save(obj, path)


def write_checkpoint(folder: str, name: str, files: Mapping[str, FileWriter]) -> str:
    """Write this rank's `files` as checkpoint `name` in `folder`, then point `latest` at it.

    Every rank calls this with its own files (rank 0 the shared ones, each rank its RNG; a
    writer may write a folder, e.g. shards); ranks synchronize through torch.distributed when it
    is initialized. Each rank hashes what it wrote, rank 0 writes the manifest of all of it and
    then `latest`. Returns the checkpoint's URL.
    """
    return begin_checkpoint(folder, name, files).finish()


def begin_checkpoint(folder: str, name: str, files: Mapping[str, FileWriter]) -> PendingCheckpoint:
    """Start `write_checkpoint`: run this rank's writers, of which one may return a Future (a
    write going on in the background: async DCP shards). Nothing of it counts until `finish`,
    which every rank calls at the same point of the run."""
    if not CHECKPOINT_NAME.match(name):
        raise ValueError(f"checkpoint name {name!r} must look like 'ep<epoch>-ba<batch>'")
    pending = PendingCheckpoint(folder, name)
    with pending.cleanup_on_error():
        if pending.rank == 0:  # a folder of this name left by an earlier attempt must not mix in
            if pending.local:
                shutil.rmtree(pending.staging, ignore_errors=True)
                pending.staging.mkdir(parents=True)
            elif pending.fs.exists(pending.target):
                pending.fs.rm(pending.target, recursive=True)
        _barrier()  # (and after rank 0's pruning of the last save, which cleans scratch folders)
        pending.make_scratch()
        for filename, write in files.items():
            result = write(pending.scratch / filename)
            if isinstance(result, Future):
                pending.background.append(result)
    return pending


class PendingCheckpoint:
    """A checkpoint this rank has begun writing (`begin_checkpoint`); `finish` makes it count."""

    def __init__(self, folder: str, name: str) -> None:
        self.folder, self.name = folder, name
        self.fs, self.root = storage.url_to_fs(folder)
        self.target = join_url(self.root, name)
        self.rank = dist.get_rank() if distributed() else 0
        self.local = isinstance(self.fs, LocalFileSystem)
        self.staging = Path(self.root) / f".{name}.staging"
        self.background: list[Future] = []
        # This rank's files go here first (`make_scratch`): in a local save folder (`clean`
        # removes it if the run dies), else in a local temporary folder that `finish` uploads.
        self.scratch: Path | None = (
            Path(self.root) / f".{name}.rank{self.rank}" if self.local else None
        )

    def make_scratch(self) -> None:
        if self.scratch is None:
            self.scratch = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX))
            return
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)

    def finish(self) -> str:
        """Wait for the background writes, then make the checkpoint count: move (or upload)
        every rank's files, write the manifest, then `latest`. Returns the checkpoint's URL."""
        with self.cleanup_on_error():
            for future in self.background:
                future.result()
            entries = hash_tree(self.scratch)
            for relative in entries:
                if self.local:
                    (self.staging / relative).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(self.scratch / relative, self.staging / relative)
                else:
                    self.fs.put_file(str(self.scratch / relative), join_url(self.target, relative))
            shutil.rmtree(self.scratch, ignore_errors=True)
            entries = _gather(entries)
            if self.rank == 0:
                if self.local:
                    (self.staging / MANIFEST).write_bytes(manifest_bytes(entries))
                    _fsync_tree(self.staging)  # on disk before any name points at it
                    _replace_folder(self.staging, Path(self.target))
                else:
                    self.fs.pipe_file(join_url(self.target, MANIFEST), manifest_bytes(entries))
                _write_latest(self.fs, self.root, self.name)
        _barrier()
        return join_url(self.folder, self.name)

    def abandon(self) -> None:
        """Wait for the background writes (their errors no longer matter) and remove this
        rank's scratch folder, without making the checkpoint count."""
        for future in self.background:
            if future.exception() is not None:
                log.warning("abandoned checkpoint %s: %s", self.name, future.exception())
        shutil.rmtree(self.scratch, ignore_errors=True)

    @contextlib.contextmanager
    def cleanup_on_error(self) -> Iterator[None]:
        """A save that fails leaves no scratch or staging folder; a full disk is one line."""
        with _disk_full_is_one_line(self.folder):
            try:
                yield
            except BaseException:
                if self.scratch is not None:
                    shutil.rmtree(self.scratch, ignore_errors=True)
                if self.local and self.rank == 0:
                    shutil.rmtree(self.staging, ignore_errors=True)
                raise


@contextlib.contextmanager
def _disk_full_is_one_line(folder: str) -> Iterator[None]:
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = str(err.filename or folder)
        fix = (  # checkpoints for object stores are written to a local temporary folder first
            "set TMPDIR to a disk with room"
            if _TMP_PREFIX in where
            else "free space there (num_checkpoints_to_keep keeps fewer) or set save_folder to "
            "a disk with room"
        )
        raise CheckpointError(
            f"no space left on the device writing {where}: the checkpoint was not saved and "
            f"'{LATEST}' still names the previous one; {fix}, then rerun with autoresume=true"
        ) from None


def _gather(entries: Entries) -> Entries:
    """Every rank's manifest entries, merged (on every rank)."""
    if not distributed():
        return entries
    gathered: list[Entries | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entries)
    return {k: v for part in gathered for k, v in (part or {}).items()}


def _fsync_tree(folder: Path) -> None:
    for directory, _, files in os.walk(folder):
        for name in files:
            fsync_path(Path(directory) / name)
        fsync_path(directory)


def _replace_folder(staging: Path, target: Path) -> None:
    """Move a finished staging folder to `target`, replacing an older copy of the same name."""
    if not target.exists():
        os.replace(staging, target)
        return
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old)


def _write_latest(fs: fsspec.AbstractFileSystem, root: str, name: str) -> None:
    path = join_url(root, LATEST)
    if isinstance(fs, LocalFileSystem):
        atomic_write(path, name + "\n")
    else:
        fs.pipe_file(path, (name + "\n").encode())


def probe_writable(folder: str) -> None:
    """A save folder that cannot be written fails in the first second of a run instead of at
    its first save (`storage.probe_writable`)."""
    storage.probe_writable(
        folder,
        "save_folder",
        "fix its permissions or the storage credentials/endpoint, or set save_folder to another "
        "folder",
        CheckpointError,
    )


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if distributed():
        dist.barrier()
