"""Checkpoint folders on any filesystem fsspec reaches: a local path, s3://, gs://, memory://.

A save folder holds checkpoints and a pointer to the newest complete one::

    <save_folder>/latest            one line: the name of the newest complete checkpoint
    <save_folder>/ep0-ba200/        a checkpoint, named by the epoch and batch it was taken at
        model.safetensors           model weights (written by rank 0), or
        sharded/                    model and optimizer shards of every rank (sharded.py)
        state.pt                    the rest of the run (rank 0; contents: state_dict.py)
        rng-rank<r>.pt              each rank's random generator states

`latest` is what makes a checkpoint count. It is replaced in one step (a rename on a local disk,
a single PUT on an object store) and only after every file of the checkpoint is written by every
rank, so a run killed while saving leaves `latest` naming the previous checkpoint. On a local
disk the files are first written into a hidden staging folder that is renamed into place; on an
object store they are uploaded into the checkpoint's folder, which stays unnamed by `latest`
(and is later overwritten or pruned) if the upload is cut short.

Files are only ever read back as tensors and plain containers: safetensors for weights and
``torch.load(weights_only=True)`` for the rest, so a checkpoint cannot run code when loaded.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import safetensors.torch
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from llmfoundry.utils import storage
from llmfoundry.utils.files import FileWriter, atomic_write, fsync_path, join_url

LATEST = "latest"
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
SHARDED_DIR = "sharded"
# Checkpoint names; also what `latest` may contain, so a pointer can never lead outside the folder.
_NAME = re.compile(r"^ep(\d+)-ba(\d+)$")
_STAGING = re.compile(r"^\.(ep\d+-ba\d+)\.(staging|old)$")


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def checkpoint_name(epoch: int, batch: int) -> str:
    return f"ep{epoch}-ba{batch}"


def write_tensors(tensors: Mapping[str, torch.Tensor]) -> FileWriter:
    """A writer of a safetensors file (tensors must not share memory)."""
    return lambda path: safetensors.torch.save_file(dict(tensors), str(path))


def write_object(obj: Any) -> FileWriter:
    """A writer of tensors in plain containers, readable with ``weights_only=True``."""
    return lambda path: torch.save(obj, path)


def write_checkpoint(folder: str, name: str, files: Mapping[str, FileWriter]) -> str:
    """Write this rank's `files` as checkpoint `name` in `folder`, then point `latest` at it.

    Every rank calls this with its own files (rank 0 the shared ones, each rank its RNG); ranks
    synchronize through torch.distributed when it is initialized. Returns the checkpoint's URL.
    """
    if not _NAME.match(name):
        raise ValueError(f"checkpoint name {name!r} must look like 'ep<epoch>-ba<batch>'")
    fs, root = storage.url_to_fs(folder)
    target = join_url(root, name)
    rank = dist.get_rank() if _distributed() else 0
    if isinstance(fs, LocalFileSystem):
        staging = Path(root) / f".{name}.staging"
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        _barrier()
        for filename, write in files.items():
            write(staging / filename)
        _barrier()
        if rank == 0:
            _fsync_tree(staging)  # on disk before any name points at it, even after a power cut
            _replace_folder(staging, Path(target))
    else:
        with tempfile.TemporaryDirectory(prefix="llmfoundry-ckpt-") as tmp:
            for filename, write in files.items():
                write(Path(tmp) / filename)
                fs.put(str(Path(tmp) / filename), f"{target}/{filename}", recursive=True)
        _barrier()
    if rank == 0:
        _write_latest(fs, root, name)
    _barrier()
    return join_url(folder, name)


def _fsync_tree(folder: Path) -> None:
    for path in (*folder.iterdir(), folder):
        fsync_path(path)


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


def read_latest(folder: str) -> str | None:
    """The checkpoint `latest` names in a save folder, or None when there is no `latest`."""
    fs, root = storage.url_to_fs(folder)
    try:
        name = fs.cat_file(join_url(root, LATEST)).decode().strip()
    except FileNotFoundError:
        return None
    if not _NAME.match(name):
        raise ValueError(
            f"{folder}/{LATEST} contains {name[:80]!r}, not a checkpoint name like 'ep0-ba100'; "
            "fix or delete the file"
        )
    return name


def latest_checkpoint(folder: str) -> str | None:
    """URL of the checkpoint `latest` points to in `folder`, or None if nothing was saved yet."""
    name = read_latest(folder)
    return None if name is None else join_url(folder, name)


def prune(folder: str, keep: int) -> list[str]:
    """Keep the checkpoint `latest` names and the `keep - 1` before it (by batch); delete older.

    Checkpoints after `latest` are left alone: a save killed mid-upload, or the future of a run
    resumed from an earlier point; the run's own save of that name replaces them. Staging
    folders of killed local saves are removed. ``keep < 1`` deletes no checkpoint. Returns the
    names of the deleted checkpoints.
    """
    fs, root = storage.url_to_fs(folder)
    latest = read_latest(folder)
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    for name in names:
        if _STAGING.match(name):
            fs.rm(join_url(root, name), recursive=True)
    if keep < 1 or latest is None:
        return []
    order = {n: _batch_epoch(n) for n in names if _NAME.match(n)}
    older = sorted((n for n in order if order[n] < _batch_epoch(latest)), key=order.__getitem__)
    doomed = older[: max(0, len(older) - (keep - 1))]
    for name in doomed:
        fs.rm(join_url(root, name), recursive=True)
    return doomed


def _batch_epoch(name: str) -> tuple[int, int]:
    epoch, batch = _NAME.match(name).groups()
    return int(batch), int(epoch)


@dataclass
class Checkpoint:
    """What one rank reads back: the weights (None in a sharded checkpoint, whose weights
    sharded.py loads), the run state, and its own RNG states if saved."""

    path: str
    model: dict[str, torch.Tensor] | None
    state: dict[str, Any]
    rng: dict[str, Any] | None


def resolve(path: str) -> str:
    """A checkpoint folder, or a save folder (its `latest` checkpoint) -> the checkpoint folder."""
    fs, root = storage.url_to_fs(path)
    if fs.exists(join_url(root, STATE_FILE)):
        return path
    latest = latest_checkpoint(path) if fs.isdir(root) else None
    if latest is None:
        raise FileNotFoundError(
            f"load_path {path!r} is neither a checkpoint folder (with {MODEL_FILE} and "
            f"{STATE_FILE}) nor a save folder with a '{LATEST}' file; point it at a folder like "
            "<save_folder>/ep0-ba100 or at the save_folder itself"
        )
    return latest


def read_checkpoint(path: str, rank: int) -> Checkpoint:
    """Read the checkpoint at `path` (see `resolve`) for `rank`, never unpickling objects."""
    path = resolve(path)
    fs, root = storage.url_to_fs(path)
    sharded = fs.exists(join_url(root, SHARDED_DIR))
    expected = (STATE_FILE,) if sharded else (MODEL_FILE, STATE_FILE)
    missing = [f for f in expected if not fs.exists(join_url(root, f))]
    if missing:
        raise FileNotFoundError(f"checkpoint {path!r} is incomplete: {', '.join(missing)} missing")
    if sharded:
        model = None
    elif isinstance(fs, LocalFileSystem):
        model = safetensors.torch.load_file(join_url(root, MODEL_FILE))
    else:
        model = safetensors.torch.load(fs.cat_file(join_url(root, MODEL_FILE)))
    rng_path = join_url(root, rng_file(rank))
    return Checkpoint(
        path=path,
        model=model,
        state=_load_object(fs, join_url(root, STATE_FILE)),
        rng=_load_object(fs, rng_path) if fs.exists(rng_path) else None,
    )


def _load_object(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    try:
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        first_line = (str(err).splitlines() or [""])[0]
        raise ValueError(
            f"cannot read {fs.unstrip_protocol(path)}: {type(err).__name__}: {first_line} "
            "(checkpoints hold only tensors and plain containers; this file is corrupt or holds "
            "objects that loading refuses to unpickle)"
        ) from None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()
