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

The manifest (checked by `read_checkpoint` before this) catches files cut short, missing or
changed after the save; what it cannot vouch for, files damaged before they were hashed or a
folder that lacks a rank's files, `check_files` finds before the engine reads anything, on
every rank alike: inside the engine, the rank whose file failed raised a traceback while the
others waited in its collectives until `timeout_s`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
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


# DeepSpeed's files of each data-parallel rank: its optimizer partition ("bf16_" in DeepSpeed's
# bf16 mode) and, ZeRO-3, its parameters; stages 1-2 keep the parameters in one shared file.
_RANK_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(optim|model)_states\.pt")
_SHARED_MODEL_FILE = "mp_rank_00_model_states.pt"


def check_files(strategy: DeepSpeed, folder: Path) -> None:
    """Refuse, in one line naming the file and on every rank alike, a checkpoint whose files
    the engine would fail to read: a file that does not parse or holds objects weights-only
    loading refuses (each is unpickled with its tensors memory-mapped, not read), or a folder
    without every rank's files."""
    paths = sorted(folder.glob("*.pt"))
    _check_ranks(strategy, folder, paths)
    with weights_only_loads():
        for path in paths:
            try:
                torch.load(path, map_location="cpu", mmap=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(
                    f"refusing to load {path}: it holds objects that loading refuses to "
                    f"unpickle ({describe(err)}); loading it could run code written into the "
                    "checkpoint: load a checkpoint from a source you trust"
                ) from None
            except Exception as err:  # noqa: BLE001 - a damaged file, whatever torch raises
                raise CheckpointError(
                    f"cannot read {path} ({describe(err)}): the checkpoint is damaged; load an "
                    "earlier checkpoint (or the save folder, which finds the newest complete one)"
                ) from None


def _check_ranks(strategy: DeepSpeed, folder: Path, paths: list[Path]) -> None:
    """Every rank of this run has its files in `folder`, and no other rank does: DeepSpeed's
    partitions resume on as many ranks as saved them, with the same ZeRO stage."""
    saved: dict[str, set[int]] = {"optim": set(), "model": set()}
    for path in paths:
        if match := _RANK_FILE.fullmatch(path.name):
            saved[match[2]].add(int(match[1]))
    world = strategy.world_size
    if saved["optim"] and (count := max(saved["optim"]) + 1) != world:
        raise CheckpointError(
            f"{folder} holds DeepSpeed partitions of {count} ranks, this run has {world}: "
            f"DeepSpeed's checkpoints resume on as many ranks as saved them; run {count} "
            "processes (or, if its files were lost, load an earlier checkpoint)"
        )
    ranks = range(world)
    missing = [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in ranks if r not in saved["optim"]
    ]
    if strategy.stage == 3:
        missing += [
            f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in ranks if r not in saved["model"]
        ]
    elif not (folder / _SHARED_MODEL_FILE).is_file():
        missing.append(_SHARED_MODEL_FILE)
    if missing:
        raise CheckpointError(
            f"{folder / missing[0]} is missing: the checkpoint is damaged, or another ZeRO stage "
            "saved it; load an earlier checkpoint, or resume with the stage that saved it"
        )


def local_weights(strategy: DeepSpeed) -> dict[str, torch.Tensor]:
    """ZeRO-3 keeps each parameter's partition of this rank in ``ds_tensor`` (the parameter
    itself is an empty placeholder outside a gather); stages 1-2 hold whole parameters."""
    module = strategy.engine.module
    if strategy.stage != 3:
        return module.state_dict()
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
    check_files(strategy, folder)
    with weights_only_loads():
        loaded, _ = strategy.engine.load_checkpoint(
            str(folder.parent),
            tag=folder.name,
            load_optimizer_states="optimizer" in keys,
            load_lr_scheduler_states=False,
            load_module_only="optimizer" not in keys,
        )
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
