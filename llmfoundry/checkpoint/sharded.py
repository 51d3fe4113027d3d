"""Sharded checkpoints: each rank writes and reads its own shard of the model and optimizer.

Strategies that shard the model (``Strategy.sharded_checkpoints``) save model and optimizer
state into a ``sharded/`` folder of the checkpoint (`Strategy.save_shards`: FSDP through
torch.distributed.checkpoint (DCP), DeepSpeed through its own checkpoint) instead of rank 0
gathering whole tensors into ``model.safetensors``; the rest of the checkpoint (``state.pt``, the
RNG files) and the atomic `latest` pointer are io.py's, as for full checkpoints. DCP records
each tensor's global shape and which slice each file holds, so a DCP checkpoint loads into any
layout: FSDP on another number of ranks, DDP, or one process (each rank reads the slices it now
holds). `scripts/convert_checkpoint.py` merges one into a single safetensors file, and
`scripts/export_hf.py` exports one directly. Shards are read in place wherever the checkpoint is
(`shard_reader`): a local folder, or an object store through fsspec with the process's storage
settings (llmfoundry/utils/storage.py), so an endpoint configured there applies.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from llmfoundry.checkpoint.io import SHARDED_DIR, FileWriter, read_checkpoint, write_tensors
from llmfoundry.utils import storage
from llmfoundry.utils.files import join_url

# What a sharded checkpoint's shards hold (the rest is in state.pt).
SHARDED_KEYS = ("model", "optimizer")


def write_shards(
    strategy: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> FileWriter:
    """A writer of this rank's shards (`Strategy.save_shards`); every rank writes the same path."""
    return lambda path: strategy.save_shards(path, model, optimizer)


def shard_reader(folder: str) -> dcp.StorageReader:
    """A DCP reader of the shards in `folder` (a local path or an fsspec URL); remote ones open
    their filesystem with the storage settings (`storage.options_for`), as every remote read."""
    if storage.is_local(folder):
        return dcp.FileSystemReader(storage.local_path(folder))
    return FsspecReader(folder, **storage.options_for(folder))


def full_model_state(folder: str) -> dict[str, torch.Tensor]:
    """The whole model weights of a sharded checkpoint's `folder` of shards (local or remote),
    in one process (no process group).

    Tensors are allocated from the shapes DCP recorded, then filled from every shard."""
    metadata = shard_reader(folder).read_metadata()
    model = {
        key.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    if not model:
        raise ValueError(f"{folder!r} holds no model weights (was it saved by llmfoundry?)")
    dcp.load({"model": model}, storage_reader=shard_reader(folder), no_dist=True)
    return model


def convert_to_safetensors(checkpoint: str, output: str | Path) -> Path:
    """Write the whole model weights of a checkpoint (sharded or full) to one safetensors file."""
    found = read_checkpoint(checkpoint, rank=0)
    weights = found.model
    if weights is None:
        weights = full_model_state(join_url(found.path, SHARDED_DIR))
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_tensors(weights)(output)
    return output
