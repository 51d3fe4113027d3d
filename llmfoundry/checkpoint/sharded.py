"""Sharded checkpoints: each rank writes and reads its own shard of the model and optimizer.

Strategies that shard the model (``Strategy.sharded_checkpoints``) save model and optimizer
state into a ``sharded/`` folder of the checkpoint (`save_shards`: FSDP through
torch.distributed.checkpoint (DCP), DeepSpeed through its engine's own checkpoint, deepspeed.py) instead of rank 0
gathering whole tensors into ``model.safetensors``; the rest of the checkpoint (``state.pt``, the
RNG files) and the atomic `latest` pointer are io.py's, as for full checkpoints. DCP records
each tensor's global shape and which slice each file holds, so a DCP checkpoint loads into any
layout: FSDP on another number of ranks, DDP, or one process (each rank reads the slices it now
holds). `scripts/convert_checkpoint.py` merges one into a single safetensors file, and
`scripts/export_hf.py` exports one directly. Shards are read in place wherever the checkpoint is
(`shard_reader`): a local folder, or an object store through fsspec with the process's storage
settings (llmfoundry/utils/storage.py), so an endpoint configured there applies. Shards are read
without unpickling objects (dcp_reader.py).

State of algorithms, callbacks and loggers that is laid out like the parameters (EMA's averages:
DTensor shards under FSDP) goes into the shards too, under ``objects``, with `IN_SHARDS` in its
place in state.pt (`split_shards`); on load DCP fills the loading objects' own tensors at those
places (`shard_targets`), so it reshards like the model. Whole tensors in a full checkpoint are
sliced into the loading objects' DTensors (`fit_layout`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from llmfoundry.checkpoint import deepspeed
from llmfoundry.checkpoint.catalogue import SHARDED_DIR
from llmfoundry.checkpoint.dcp_reader import load_shards_state, shard_reader
from llmfoundry.checkpoint.finite import refuse_non_finite
from llmfoundry.checkpoint.reader import read_checkpoint
from llmfoundry.checkpoint.writer import write_tensors
from llmfoundry.distributed import Strategy
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import FileWriter, join_url

# What a sharded checkpoint's shards hold (the rest is in state.pt, but see `split_shards`).
SHARDED_KEYS = ("model", "optimizer")
# What state.pt holds where an object's state had a DTensor (saved in the shards instead).
IN_SHARDS = "<in sharded/>"
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a shards folder


def write_shards(
    strategy: Strategy,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Any],
) -> FileWriter:
    """A writer of this rank's shards (`save_shards`); every rank writes the same path."""
    return lambda path: save_shards(strategy, path, model, optimizer, objects)


def save_shards(
    strategy: Strategy,
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Any] | None = None,
) -> Future | None:
    """Write this rank's shards of model and optimizer into the folder `path` (a collective:
    every rank calls it with the same path); torch.distributed.checkpoint, or DeepSpeed's
    engine. `objects`: other state laid out like the parameters (nested dicts of DTensors, e.g.
    EMA's averages), saved with them under the key ``objects`` (always empty with DeepSpeed:
    its parameters are not DTensors, state.pt has all). With ``strategy.async_save`` it
    returns, once the state is copied, a Future of the write going on in the background (over
    ``strategy.save_group``)."""
    if strategy.saves_own_checkpoints:
        deepspeed.save_shards(strategy, path)
        return None
    state = _dcp_state(model, optimizer, objects)
    if strategy.async_save:
        return dcp.async_save(state, checkpoint_id=str(path), process_group=strategy.save_group)
    dcp.save(state, checkpoint_id=str(path))
    return None


def load_shards(
    strategy: Strategy,
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    keys: Collection[str] = SHARDED_KEYS,
    objects: Mapping[str, Any] | None = None,
) -> None:
    """Load `keys` of the shards `save_shards` wrote (on any number of ranks, by any
    strategy whose state DCP can reshard), onto this rank's current layout; `path` is a
    local folder or an fsspec URL (read without unpickling objects: `load_shards_state`).
    `objects` (as for `save_shards`, this run's tensors in its own layout) are filled in
    place."""
    by_deepspeed = written_by_deepspeed(path)
    if by_deepspeed and not strategy.saves_own_checkpoints:
        raise UserError(
            f"{path} holds DeepSpeed's shards (saved with strategy=deepspeed), which only "
            "strategy=deepspeed reads: resume with it, at the ZeRO stage that saved them"
        )
    if strategy.saves_own_checkpoints and not by_deepspeed:
        raise UserError(
            f"{path} holds torch.distributed.checkpoint shards, which strategy=deepspeed does "
            "not read: resume with the strategy that saved them (fsdp, ddp, single), or write "
            "their whole weights with scripts/convert_checkpoint.py and load those with "
            "load_ignore_keys=[optimizer]"
        )
    if by_deepspeed:
        deepspeed.load_shards(strategy, path, keys)
        return
    reader = shard_reader(path)
    by_name = saved_by_name(reader.read_metadata())
    state = _dcp_state(model, optimizer, objects, keys, by_name)
    if state:
        load_shards_state(state, path, reader=reader)
        load_sharded_state(model, optimizer, state, by_name)


def load_model_shards(folder: str, model: torch.nn.Module) -> tuple[int, int]:
    """Load the model weights alone from the DCP shards in `folder` (not DeepSpeed's) onto
    `model` as this rank holds it (a collective): its DTensor shards, a pipeline stage's part.
    No optimizer is needed (an evaluation has none); DCP reads only the saved chunks that
    overlap what this rank holds. Returns the bytes this rank read from the shard files, and
    the bytes of the model weights in all of them."""
    reader = shard_reader(folder)
    total = sum(
        stored.length
        for index, stored in reader.read_metadata().storage_data.items()
        if index.fqn.startswith("model.")
    )
    state = {"model": get_model_state_dict(model)}
    load_shards_state(state, folder, reader=reader)
    set_model_state_dict(model, state["model"])
    return reader.bytes_read, total


def written_by_deepspeed(folder: str) -> bool:
    """Whether the shards folder `folder` holds DeepSpeed's engine files (deepspeed.py) rather
    than torch.distributed.checkpoint's (its `.metadata`): the two formats of our shards."""
    fs, root = storage.url_to_fs(folder)
    if fs.exists(join_url(root, DCP_METADATA)):
        return False
    return bool(fs.glob(join_url(root, "*_model_states.pt")))


def _dcp_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Any] | None,
    keys: Collection[str] = SHARDED_KEYS,
    by_name: bool = True,
) -> dict[str, Any]:
    state = {k: v for k, v in sharded_state(model, optimizer, by_name).items() if k in keys}
    return {**state, "objects": objects} if objects else state


def sharded_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, by_name: bool = True
) -> dict[str, Any]:
    """Model and optimizer state as this rank holds it, for torch.distributed.checkpoint:
    shards (DTensors) for sharded models, whole tensors otherwise. Loading such a dict
    in place through DCP reshards whatever was saved onto this layout.

    The optimizer's parameter groups are saved by parameter name (`by_name`, torch's flattened
    layout: ``param_groups.<name>.lr``), as its state is. Saved by index (``param_groups.0.lr``,
    the layout before, `by_name=False` to read it), each pipeline stage's groups had the same
    keys and DCP kept one stage's (it writes a key that several ranks hold once): the other
    stages resumed without their groups' hyperparameters (issue 32). A group's
    ``param_names`` (build_param_groups) are not saved: they name this run's own parameters,
    and under a flattened layout every parameter would carry its whole group's list.
    """
    options = StateDictOptions(flatten_optimizer_state_dict=by_name)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    return {
        "model": get_model_state_dict(model),
        "optimizer": {k: v for k, v in optimizer_state.items() if not _is_param_names(k)}
        if by_name
        else optimizer_state,
    }


def _is_param_names(key: str) -> bool:
    return key.startswith("param_groups.") and key.endswith(".param_names")


def saved_by_name(metadata: Metadata) -> bool:
    """Whether shards saved their optimizer's parameter groups by parameter name (today's
    layout, `sharded_state`) rather than by index (checkpoints saved before issue 32)."""
    return "optimizer.param_groups.0.params" not in metadata.state_dict_metadata


def load_sharded_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    by_name: bool = True,
) -> None:
    """Apply what `sharded_state` returned after DCP filled it (either key may be absent)."""
    if "model" in state:
        set_model_state_dict(model, state["model"])
    if "optimizer" not in state:
        return
    options = StateDictOptions(flatten_optimizer_state_dict=by_name)
    loaded = state["optimizer"]
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if by_name:  # this run's own parameter names, which were not saved
        current = get_optimizer_state_dict(model, optimizer, options=options)
        loaded = {**loaded, **{k: v for k, v in current.items() if _is_param_names(k)}}
    set_optimizer_state_dict(model, optimizer, loaded, options=options)
    if not by_name:  # a pipeline stage's groups that a checkpoint by index lost: this run's
        for group, values in zip(optimizer.param_groups, fresh, strict=True):
            for key, value in values.items():
                group.setdefault(key, value)


def split_shards(tree: Any) -> tuple[Any, dict[str, Any]]:
    """`tree` (nested dicts) with each DTensor replaced by `IN_SHARDS`, and those DTensors alone,
    nested alike (empty when there are none): state.pt cannot hold a rank's shard of a tensor."""
    if not isinstance(tree, Mapping):
        return tree, {}
    rest, shards = {}, {}
    for key, value in tree.items():
        if isinstance(value, DTensor):
            rest[key], shards[key] = IN_SHARDS, value
        else:
            rest[key], inner = split_shards(value)
            if inner:
                shards[key] = inner
    return rest, shards


def shard_targets(saved: Any, current: Any) -> dict[str, Any]:
    """The tensors of `current` (the loading objects' state) where `saved` holds `IN_SHARDS`,
    nested alike: what DCP fills in place, in the loading run's layout (DTensor shards or whole
    tensors). Places the loading objects lack are left out."""
    if not (isinstance(saved, Mapping) and isinstance(current, Mapping)):
        return {}
    targets = {}
    for key, value in saved.items():
        if key not in current:
            continue
        if isinstance(value, str) and value == IN_SHARDS:
            if isinstance(current[key], torch.Tensor):
                targets[key] = current[key]
        elif inner := shard_targets(value, current[key]):
            targets[key] = inner
    return targets


def fit_layout(saved: Any, current: Any, loaded: Mapping[str, Any]) -> Any:
    """`saved` (an object's state from state.pt) ready for its `load_state_dict`: each
    `IN_SHARDS` replaced by what DCP loaded there (`loaded`, nested alike), and each whole
    tensor where `current` holds a DTensor sliced into that DTensor's layout (a full checkpoint
    loading into FSDP; every rank holds the whole tensor, so no communication)."""
    if isinstance(saved, str) and saved == IN_SHARDS:
        if not isinstance(loaded, torch.Tensor):
            raise UserError(
                "the checkpoint keeps a tensor of an algorithm's or callback's state in its shards "
                "that this run's has no tensor for (another model config?); add 'algorithms' or "
                "'callbacks' to load_ignore_keys to start that state afresh"
            )
        return loaded
    if isinstance(current, DTensor) and isinstance(saved, torch.Tensor):
        whole = saved.to(device=current.device, dtype=current.dtype)
        return distribute_tensor(whole, current.device_mesh, current.placements, src_data_rank=None)
    if not (isinstance(saved, Mapping) and isinstance(current, Mapping)):
        return saved
    return {
        key: fit_layout(value, current.get(key), loaded.get(key, {}))
        for key, value in saved.items()
    }


def full_model_state(folder: str) -> dict[str, torch.Tensor]:
    """The whole model weights of a sharded checkpoint's `folder` of shards (local or remote),
    in one process (no process group).

    Tensors are allocated from the shapes DCP recorded, then filled from every shard."""
    if written_by_deepspeed(folder):
        raise UserError(
            f"{folder} holds DeepSpeed's shards (saved with strategy=deepspeed), which only "
            "DeepSpeed's engine reads: write its whole weights with DeepSpeed's zero_to_fp32.py, "
            "or continue its run with strategy=deepspeed"
        )
    reader = shard_reader(folder)
    metadata = reader.read_metadata()
    model = {
        key.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    if not model:
        raise UserError(f"{folder!r} holds no model weights (was it saved by llmfoundry?)")
    load_shards_state({"model": model}, folder, no_dist=True, reader=reader)
    return model


def convert_to_safetensors(checkpoint: str, output: str | Path) -> Path:
    """Write the whole model weights of a checkpoint (sharded or full) to one safetensors file."""
    found = read_checkpoint(checkpoint, rank=0)
    weights = found.model
    if weights is None:
        weights = full_model_state(join_url(found.path, SHARDED_DIR))
    refuse_non_finite(
        str(output), weights, cause="its run diverged", fix=f"convert one saved before {found.path}"
    )
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_tensors(weights)(output)
    return output
