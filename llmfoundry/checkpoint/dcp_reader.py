"""Reading torch.distributed.checkpoint (DCP) shards without running code from them.

DCP's own reader opens ``sharded/.metadata`` with ``pickle.load`` and its default planner reads
every non-tensor value (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``:
whoever writes a checkpoint (and so its manifest) could make loading it run their code. Every
DCP load of ours goes through `shard_reader` and `load_shards_state`, which close both doors:

- `.metadata` is read by `read_metadata` with an unpickler that admits only DCP's metadata
  classes and the torch values they hold (sizes, dtypes, layouts), then checked: every shard
  file it names is a plain file name inside the shards folder;
- non-tensor values are read with ``torch.load(weights_only=True)`` (`SafeLoadPlanner`).

A file that needs anything else is refused with a `CheckpointError` naming it.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from llmfoundry.checkpoint.manifest import CheckpointError, describe
from llmfoundry.utils import storage

# Everything a DCP .metadata file refers to by name (torch 2.x); dtypes are checked by value.
_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout's pickled form (by name)
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
}


class _NotAllowed(pickle.UnpicklingError):
    """The metadata names something outside `_ALLOWED`: what a payload does."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _ALLOWED:
            raise _NotAllowed(f"it refers to {module}.{name}")
        return super().find_class(module, name)


def read_metadata(data: bytes, url: str) -> dcp_metadata.Metadata:
    """The DCP metadata in `data` (the bytes of `url`), unpickled with only DCP's classes."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _NotAllowed as err:
        raise _refused(url, str(err)) from None
    except Exception as err:  # noqa: BLE001 - whatever damaged bytes make the unpickler raise
        raise CheckpointError(
            f"cannot read {url}: it does not parse as DCP checkpoint metadata ({describe(err)}); "
            "the file matches its checkpoint's manifest, so it was damaged before it was hashed "
            "or written by another program; load an earlier checkpoint"
        ) from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise _refused(url, f"it holds a {type(metadata).__name__}, not DCP metadata")
    if not isinstance(metadata.state_dict_metadata, Mapping) or not isinstance(
        metadata.storage_data, Mapping
    ):
        raise _refused(url, "its tables are not mappings")
    for info in metadata.storage_data.values():
        path = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _plain_name(path):
            raise _refused(url, f"it names the shard file {path!r}, outside its folder")
    return metadata


def _plain_name(path: Any) -> bool:
    return isinstance(path, str) and path not in ("", ".", "..") and not set("/\\\0") & set(path)


def _refused(url: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"refusing to load {url}: it is not DCP checkpoint metadata ({why}); loading it could "
        "run code written into the checkpoint: load a checkpoint from a source you trust"
    )


class _SafeMetadata:
    """`read_metadata` in place of DCP's ``pickle.load`` (mixed into DCP's readers). Read once
    per reader: `load_shards_state` checks it before ``dcp.load`` asks again (one GET, not two,
    on an object store). `read_data` reads one shard file at a time, so a file that does not
    parse (or a store that stops answering) is an error naming that file, and counts in
    `bytes_read` what it read: DCP reads each saved chunk a load plan names whole (one at a
    time) and keeps the part that overlaps this rank's tensor, so this is how much of the
    checkpoint a rank read while loading (a mesh load reports it: checkpoint/on_mesh.py)."""

    _metadata: dcp_metadata.Metadata | None = None
    bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._metadata is None:
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = read_metadata(f.read(), str(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = dcp_metadata.StorageMeta()
            self._metadata = metadata
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for relative_path, items in per_file.items():
            self.bytes_read += sum(self.storage_data[item.storage_index].length for item in items)
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except (CheckpointError, AssertionError):  # (DCP's check that a tensor fits)
                raise
            except Exception as err:  # noqa: BLE001 - bytes the manifest vouches for, unparsed
                url = str(self.fs.concat_path(self.path, relative_path))
                raise _unparsed(url, err) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _unparsed(url: str, err: Exception) -> CheckpointError:
    if storage.is_unreachable(err) and not storage.is_local(url):
        return CheckpointError(
            f"cannot read the shard {url} ({describe(err)}); {storage.UNREACHABLE_FIX}"
        )
    return CheckpointError(
        f"cannot read the shard {url}: {describe(err)}; the file matches its checkpoint's "
        "manifest but is not a DCP shard: it was damaged before it was hashed, or written by "
        "another program; load an earlier checkpoint"
    )


class SafeFileSystemReader(_SafeMetadata, dcp.FileSystemReader):
    """DCP's local reader with `read_metadata`."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """DCP's fsspec reader with `read_metadata`."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner reading non-tensor values as tensors and plain containers."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(
                f"refusing to load {read_item.dest_index.fqn!r} of a DCP checkpoint: it holds "
                f"objects that loading refuses to unpickle ({(str(err).splitlines() or [''])[0]}"
                "); load a checkpoint from a source you trust"
            ) from None
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, with what was read
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def shard_reader(folder: str) -> dcp.StorageReader:
    """A DCP reader of the shards in `folder` (a local path or an fsspec URL); remote ones open
    their filesystem with the storage settings (`storage.options_for`), as every remote read."""
    if storage.is_local(folder):
        return SafeFileSystemReader(storage.local_path(folder))
    return SafeFsspecReader(folder, **storage.options_for(folder))


def load_shards_state(
    state: dict[str, Any],
    folder: str,
    no_dist: bool = False,
    reader: dcp.StorageReader | None = None,
) -> None:
    """``dcp.load`` of `state` from the shards in `folder` (through `reader`, when the caller
    already made one), never unpickling objects; its metadata is read and checked first, so a
    refused file is a one-line error."""
    reader = reader or shard_reader(folder)
    reader.read_metadata()
    try:
        with warnings.catch_warnings():
            if no_dist:  # asked for: torch's "assuming ... a single process" tells the user nothing
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as err:
        for failure in err.failures.values():
            cause = failure[0]  # (exception, traceback)
            if isinstance(cause, CheckpointError):
                raise CheckpointError(str(cause)) from None
        raise
