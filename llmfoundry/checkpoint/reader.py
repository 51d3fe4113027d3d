"""Reading our own checkpoints back, on any filesystem fsspec reaches.

Files are only ever read back as tensors and plain containers: safetensors for weights and
``torch.load(weights_only=True)`` for the rest, and sharded/ through dcp_reader.py (DCP's metadata
with an unpickler that admits only DCP's classes), and DeepSpeed's shards with
``weights_only=True`` too (llmfoundry/checkpoint/deepspeed.py), so a checkpoint cannot run code
when loaded; each file is checked against the manifest before it is parsed.
"""

from __future__ import annotations

import io
from typing import Any

import fsspec
import safetensors.torch
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from llmfoundry.checkpoint.catalogue import MODEL_FILE, STATE_FILE, damage, rng_file
from llmfoundry.checkpoint.loaded import Checkpoint
from llmfoundry.checkpoint.manifest import (
    CheckpointError,
    Entries,
    check_bytes,
    check_file,
    describe,
    read_manifest,
)
from llmfoundry.checkpoint.probe import reading, resolve
from llmfoundry.checkpoint.writer import distributed
from llmfoundry.utils import storage
from llmfoundry.utils.files import join_url


def read_checkpoint(path: str, rank: int) -> Checkpoint:
    """Read the checkpoint at `path` (see `resolve`) for `rank`, never unpickling objects.

    Every file is checked against the manifest: those this rank reads as it reads them, the
    rest (other ranks' files) shared out between the ranks, so a corrupt file is named on load.
    """
    path = resolve(path)
    with reading(path):
        fs, root = storage.url_to_fs(path)
        files = read_manifest(fs, root)
        if problem := damage(fs, root, files):
            raise CheckpointError(
                f"checkpoint {path} {problem}; load an earlier checkpoint (or the save folder, "
                "which finds the newest complete one)"
            )
        own = [MODEL_FILE, STATE_FILE, rng_file(rank)]
        world = dist.get_world_size() if distributed() else 1
        others = sorted(set(files) - set(own))
        for name in others[rank % world :: world]:
            check_file(fs, join_url(root, name), files[name])
        return Checkpoint(
            path=path,
            model=_load_tensors(fs, root, files) if MODEL_FILE in files else None,  # sharded
            state=_load_object(fs, root, STATE_FILE, files),
            rng=_load_object(fs, root, rng_file(rank), files) if rng_file(rank) in files else None,
        )


def read_state(path: str) -> dict[str, Any]:
    """The run state of the checkpoint at `path` (see `resolve`) alone, checked against its
    manifest: its recorded config without reading the weights."""
    path = resolve(path)
    with reading(path):
        fs, root = storage.url_to_fs(path)
        files = read_manifest(fs, root)
        if files is None or STATE_FILE not in files:
            raise CheckpointError(
                f"checkpoint {path} {damage(fs, root, files)}; load an earlier checkpoint"
            )
        return _load_object(fs, root, STATE_FILE, files)


def _verified(fs: fsspec.AbstractFileSystem, root: str, name: str, files: Entries) -> Any:
    """The file `name`, checked against its manifest entry: a local path, or (object stores,
    read once) a file object over its bytes."""
    path = join_url(root, name)
    if isinstance(fs, LocalFileSystem):
        check_file(fs, path, files[name])
        return path
    return io.BytesIO(check_bytes(fs.unstrip_protocol(path), fs.cat_file(path), files[name]))


def _load_tensors(fs: fsspec.AbstractFileSystem, root: str, files: Entries) -> dict:
    source = _verified(fs, root, MODEL_FILE, files)
    try:
        if isinstance(source, str):
            return safetensors.torch.load_file(source)
        return safetensors.torch.load(source.getvalue())
    except Exception as err:  # noqa: BLE001 - bytes the manifest vouches for that do not parse
        raise _unreadable(fs, join_url(root, MODEL_FILE), err) from None


def _load_object(fs: fsspec.AbstractFileSystem, root: str, name: str, files: Entries) -> Any:
    source = _verified(fs, root, name, files)
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - bytes the manifest vouches for that do not parse
        raise _unreadable(fs, join_url(root, name), err) from None


def _unreadable(fs: fsspec.AbstractFileSystem, path: str, err: Exception) -> CheckpointError:
    return CheckpointError(
        f"cannot read {fs.unstrip_protocol(path)}: {describe(err)}; the file matches its "
        "checkpoint's manifest but is not what llmfoundry saves (tensors and plain containers): "
        "it was damaged before it was hashed, or holds objects that loading refuses to "
        "unpickle; load an earlier checkpoint"
    )
