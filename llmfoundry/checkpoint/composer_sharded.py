"""Composer's sharded checkpoints (FSDP with ``state_dict_type: sharded``), read whole.

Composer saves ``{'state': State.state_dict(), 'rng': ...}`` with torch.distributed.checkpoint
into a folder (``.metadata`` + ``__<rank>_0.distcp``), flattened to keys such as
``state.model.model.transformer.wte.weight``; `.metadata` keeps the nesting (``planner_data``).
`read` loads every key in this process (no process group), as `composer.read` loads the
monolithic file, and nests it back: tensors are allocated from the shapes DCP recorded and
filled from every shard; the other values (timestamp, integrations, RNG) are ``torch.save``
bytes, read with the restricted unpickler (restricted_pickle.py) where DCP would unpickle
anything. The metadata is read by dcp_reader.py's unpickler (DCP's classes only).

Memory is bounded by the files: the tensors `.metadata` declares must fit in the shard files'
bytes, and its nesting paths may not name list positions beyond its number of keys.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from llmfoundry.checkpoint import restricted_pickle
from llmfoundry.checkpoint.dcp_reader import SafeFileSystemReader
from llmfoundry.checkpoint.manifest import CheckpointError
from llmfoundry.utils import storage

METADATA = ".metadata"
MODEL_PREFIX = "state.model."


def is_sharded(path: str) -> bool:
    """Whether `path` is a local DCP folder whose keys are Composer's (``state.model.*``)."""
    if not storage.is_local(path):
        return False
    folder = Path(storage.local_path(path))
    if not (folder / METADATA).is_file():
        return False
    metadata = SafeFileSystemReader(str(folder)).read_metadata()
    return any(key.startswith(MODEL_PREFIX) for key in metadata.state_dict_metadata)


class _RestrictedBytesPlanner(DefaultLoadPlanner):
    """DCP's planner over a flat state dict, reading non-tensor values with the restricted
    unpickler."""

    def __init__(self, url: str) -> None:
        super().__init__(flatten_state_dict=False)
        self.url = url

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = restricted_pickle.loads(value.read(), f"{self.url} ({fqn})")


def read(path: str) -> dict[str, Any]:
    """Everything in the Composer sharded checkpoint at `path`, nested as Composer saved it."""
    folder = Path(storage.local_path(path))
    reader = SafeFileSystemReader(str(folder))
    metadata = reader.read_metadata()
    _check_bounds(metadata, folder)
    flat: dict[str, Any] = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        if isinstance(item, TensorStorageMetadata)
        else None
        for key, item in metadata.state_dict_metadata.items()
    }
    planner = _RestrictedBytesPlanner(path)
    with warnings.catch_warnings():  # one process, asked for: torch's notice says nothing
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointException as err:
            for failure in err.failures.values():
                if isinstance(failure[0], CheckpointError):  # (exception, traceback)
                    raise CheckpointError(str(failure[0])) from None
            raise
    # dcp.load writes non-tensor values into the planner's copy of `flat`, not into `flat`.
    return unflatten_state_dict(planner.state_dict, metadata.planner_data)


def _check_bounds(metadata: Metadata, folder: Path) -> None:
    """Refuse metadata that would allocate more than the shard files hold."""
    stored = sum(f.stat().st_size for f in folder.glob("*.distcp"))
    declared = sum(
        item.size.numel() * item.properties.dtype.itemsize
        for item in metadata.state_dict_metadata.values()
        if isinstance(item, TensorStorageMetadata)
    )
    if declared > stored:
        raise CheckpointError(
            f"refusing to load {folder}: its {METADATA} declares {declared:,} bytes of tensors "
            f"but its shard files hold {stored:,}; the checkpoint is damaged or incomplete"
        )
    keys = len(metadata.state_dict_metadata)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else None
    if paths is None or set(paths) != set(metadata.state_dict_metadata):
        raise CheckpointError(
            f"refusing to load {folder}: its {METADATA} does not say how its keys nest "
            "(planner_data); it was not written by Composer"
        )
    for path in paths.values():
        if not isinstance(path, tuple) or not all(
            isinstance(p, str) or (type(p) is int and 0 <= p <= keys) for p in path
        ):
            raise CheckpointError(
                f"refusing to load {folder}: its {METADATA} nests a key at {path!r}"
            )
