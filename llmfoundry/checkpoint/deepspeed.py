"""DeepSpeed's checkpoints: its engine's own files for the ``sharded/`` folder, and whole weights
loaded into its engine (llmfoundry/distributed/deepspeed.py is the strategy).

DeepSpeed writes each rank's partitions into the checkpoint's ``sharded/`` folder; with our
trainer state (state.pt) they resume with the same stage on the same number of ranks. Full
(safetensors) checkpoints load model weights into any stage, but not optimizer state (ZeRO's
partitions are the engine's).

DeepSpeed reads its files with ``torch.load(weights_only=False)`` (its TorchCheckpointEngine,
zero_to_fp32), which would run code pickled into a checkpoint. `load_shards` reads them with
``weights_only=True`` instead (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` overrides the argument
for every load in `weights_only_loads`), admitting besides tensors and plain containers only
the few DeepSpeed classes its files hold (`CHECKPOINT_CLASSES`: the loss scaler, the ZeRO
stage, fragment addresses), so a DeepSpeed checkpoint is as safe to load as ours: a file that
needs anything else is refused with a `CheckpointError` naming it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import torch

from llmfoundry.checkpoint.manifest import CheckpointError, describe
from llmfoundry.distributed import DeepSpeed
from llmfoundry.utils.errors import UserError

# torch.load reads with weights_only=True while this is set, whatever its caller passes.
FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
# What DeepSpeed's checkpoint files hold besides tensors and plain containers (0.19, ZeRO 1-3):
# module path -> class names. Unpickling one only sets its attributes (or, for the enum, looks
# up a member); nothing of it runs code.
CHECKPOINT_CLASSES = {
    "deepspeed.runtime.fp16.loss_scaler": ("LossScaler", "DynamicLossScaler"),
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
}


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every ``torch.load`` of this process within the block reads with ``weights_only=True``,
    admitting `CHECKPOINT_CLASSES` too (see the module docstring)."""
    classes = [
        getattr(importlib.import_module(module), name)
        for module, names in CHECKPOINT_CLASSES.items()
        for name in names
    ]
    previous = os.environ.get(FORCE_WEIGHTS_ONLY)
    os.environ[FORCE_WEIGHTS_ONLY] = "1"
    try:
        with torch.serialization.safe_globals(classes):
            yield
    finally:
        if previous is None:
            os.environ.pop(FORCE_WEIGHTS_ONLY, None)
        else:
            os.environ[FORCE_WEIGHTS_ONLY] = previous


def _refused_file(folder: Path) -> Path | None:
    """The first file of a DeepSpeed checkpoint `folder` that weights-only loading refuses."""
    with weights_only_loads():
        for path in sorted(folder.glob("*.pt")):
            try:
                torch.load(path, map_location="cpu", mmap=True)
            except pickle.UnpicklingError:
                return path
    return None


def local_weights(strategy: DeepSpeed) -> dict[str, torch.Tensor]:
    """ZeRO-3 keeps each parameter's partition of this rank in ``ds_tensor`` (the parameter
    itself is an empty placeholder outside a gather); stages 1-2 hold whole parameters."""
    module = strategy.engine.module
    return {
        **{name: param.ds_tensor for name, param in module.named_parameters()},
        **dict(module.named_buffers()),
    }


def save_shards(strategy: DeepSpeed, path: Path) -> None:
    """The engine's own checkpoint of this rank's partitions, into the folder `path`."""
    strategy.engine.save_checkpoint(str(path.parent), tag=path.name, save_latest=False)


def load_shards(strategy: DeepSpeed, path: str, keys: Collection[str]) -> None:
    """Load what `save_shards` wrote (model, and optimizer when in `keys`), reading its files
    weights-only (see the module docstring)."""
    if "model" not in keys:
        raise UserError(
            f"strategy={strategy.name} loads a DeepSpeed checkpoint's model and optimizer "
            "together; to start the optimizer afresh, convert the checkpoint to weights "
            "first (scripts/convert_checkpoint.py does not read DeepSpeed's format; use "
            "DeepSpeed's zero_to_fp32.py)"
        )
    folder = Path(path)
    try:
        with weights_only_loads():
            loaded, _ = strategy.engine.load_checkpoint(
                str(folder.parent),
                tag=folder.name,
                load_optimizer_states="optimizer" in keys,
                load_lr_scheduler_states=False,
                load_module_only="optimizer" not in keys,
            )
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"refusing to load {_refused_file(folder) or folder}: it holds objects that "
            f"loading refuses to unpickle ({describe(err)}); loading it could run code "
            "written into the checkpoint: load a checkpoint from a source you trust"
        ) from None
    if loaded is None:
        raise UserError(f"{path!r} is not a DeepSpeed checkpoint of this ZeRO stage")


def load_model_state_dict(strategy: DeepSpeed, state: dict[str, Any]) -> None:
    """Whole weights into the engine: gathered for ZeRO-3, then copied to the optimizer's
    fp32 partitions, which are what the next step updates."""
    module = strategy.engine.module
    params = list(module.parameters())
    with strategy.deepspeed.zero.GatheredParameters(
        params, modifier_rank=0, enabled=strategy.stage == 3
    ):
        module.load_state_dict(state)
    strategy.engine.optimizer.refresh_fp32_params()


def refuse_full_optimizer_state(strategy: DeepSpeed) -> None:
    """A full checkpoint's optimizer state cannot go into ZeRO's partitions."""
    raise UserError(
        f"strategy={strategy.name} cannot load a full checkpoint's optimizer state into ZeRO's "
        "partitions; add 'optimizer' to load_ignore_keys to start it afresh"
    )
