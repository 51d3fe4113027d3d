"""The strategy interface, and the helpers every strategy shares.

A strategy owns the process group, the device, how a model built on the meta device is
materialized and wrapped, the training step's backward / optimizer step / zero_grad, and how
model and optimizer state is read and written. One-process, data-parallel and sharded strategies
implement the same interface, so neither the trainer nor checkpoints branch on which is in use.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from llmfoundry.checkpoint.dcp_reader import load_shards_state
from llmfoundry.core.precision import Precision
from llmfoundry.utils.errors import UserError

# Whole tensors on the CPU: what full (single-file) checkpoints hold. With a sharded model,
# torch gathers them on rank 0 only; the other ranks get an empty dict.
FULL_ON_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def resolve_device(device: str, setting: str = "strategy.device") -> torch.device:
    """'auto' picks CUDA when present, else CPU; anything else is passed to torch.device.

    A name torch does not know, or a CUDA device this machine lacks, is a UserError naming
    `setting` (the config key, or a script's flag).
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UserError(
            f"{setting}={device!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'auto'"
        ) from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"{setting}={device!r} but no CUDA device is available; use 'cpu' or 'auto'"
        )
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise UserError(
            f"{setting}={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return resolved


def materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Allocate a meta-device model on `device` and initialize it (its `init_weights`)."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        model.init_weights()
    return model.to(device)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside data-parallel (``.module``) or torch.compile (``._orig_mod``)
    wrappers, or the model itself.

    Code that names parameters (checkpoints, EMA, parameter groups) or calls the model's own
    methods (flops_per_token, generate) uses this, so it does not depend on the strategy
    ("transformer.wte.weight", never "module.transformer.wte.weight").
    """
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


class OutOfMemoryElsewhere(RuntimeError):
    """Another rank ran out of memory in this step; all ranks learned it from one collective
    (`Strategy.guard_collectives`), so this rank does not join the trainer's agreement."""


class Strategy:
    """How one training process relates to the others. Subclasses override what differs.

    `rank`/`world_size` place this process among all processes; `dp_rank`/`dp_size` say which
    part of the data it reads and among how many data-parallel readers: the same numbers for
    data parallelism and sharding, but not once a tensor- or pipeline-parallel dimension makes
    several processes read the same batch.

    `sharded_checkpoints`: whether checkpoints hold each rank's shard (torch.distributed.checkpoint)
    rather than one file of whole tensors written by rank 0. `async_save`: whether `save_shards`
    returns while its files are still being written (a Future the checkpoint waits for).
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device
    sharded_checkpoints: bool = False
    async_save: bool = False
    # The background saves' own process group, so their collectives never interleave with
    # training's (gloo: async DCP needs a CPU backend, also when training uses nccl).
    save_group: Any = None

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def dp_group(self) -> Any:
        """The processes this one reduces data-parallel counts and losses with (`all_reduce_sum`'s
        `group`); None: all of them."""
        return None

    def setup(self) -> None:
        """Join the process group (no-op for one process)."""

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Materialize a model built on the meta device, initialize it, and wrap it."""
        raise NotImplementedError

    def wrap_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Hand the prepared model and the optimizer built on its parameters to an engine that
        owns the optimizer step (DeepSpeed); returns what the loop trains and steps."""
        return model, optimizer

    # ------------------------------------------------------------------ the training step
    def sync_context(self, model: torch.nn.Module, sync: bool) -> AbstractContextManager:
        """Wrap one microbatch's forward and backward; with `sync=False` gradients stay local.

        Data-parallel strategies average gradients during the backward of the microbatch run
        with `sync=True` (the last one), overlapping communication with compute.
        """
        del model, sync
        return nullcontext()

    def sync_gradients(self, model: torch.nn.Module) -> None:
        """Average gradients over processes now, for steps whose microbatches all ran unsynced.

        Auto-microbatching defers the averaging until every rank has finished its backward
        without running out of memory, so no rank is left waiting in a collective.
        """
        del model

    def guard_collectives(self, model: torch.nn.Module) -> None:
        """Auto-microbatching is on: make collectives inside forward and backward safe from a
        rank that runs out of memory (none here: data parallelism defers its only collective,
        the gradient average, to `sync_gradients`)."""
        del model

    def backward(self, loss: torch.Tensor, precision: Precision) -> None:
        """Backward of one microbatch's (weighted) loss."""
        precision.backward(loss)

    def step(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        """The optimizer step, once per batch, after every microbatch's backward."""
        precision.step(optimizer)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop the gradients after a step."""
        optimizer.zero_grad(set_to_none=True)

    def abandon_step(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Discard an attempt that ran out of memory on some rank: its gradients and whatever
        the strategy holds for the step (gathered weights), so the retry starts clean."""
        del model
        self.zero_grad(optimizer)

    # ------------------------------------------------------------------ state for checkpoints
    def local_weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """This rank's part of every weight and buffer by name, where it lives (no copy, no
        communication): whole tensors, or this rank's shard of a sharded (DTensor) one; the
        same names in the same order on every rank. What a save checks for NaN on all ranks
        before anything is written (llmfoundry/checkpoint/finite.py)."""
        return {
            name: tensor.to_local() if isinstance(tensor, DTensor) else tensor
            for name, tensor in unwrap_model(model).state_dict().items()
        }

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Whole weights on the CPU by the model's own names (no wrapper prefixes); called on
        every rank, complete on rank 0."""
        return get_model_state_dict(model, options=FULL_ON_CPU)

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """Load whole weights (every rank passes them); sharded models keep their own shard."""
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    def optimizer_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, whole tensors on the CPU, so it loads
        into any strategy; called on every rank, complete on rank 0."""
        return get_optimizer_state_dict(model, optimizer, options=FULL_ON_CPU)

    def load_optimizer_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        # A stateless optimizer (SGD without momentum) has only hyperparameters, which torch
        # refuses to distribute as "full" state: they load as they are.
        full = bool(state.get("state"))
        set_optimizer_state_dict(
            model, optimizer, state, options=StateDictOptions(full_state_dict=full)
        )

    def save_shards(
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        objects: Mapping[str, Any] | None = None,
    ) -> Future | None:
        """Write this rank's shards of model and optimizer into the folder `path` (a collective:
        every rank calls it with the same path); torch.distributed.checkpoint by default.
        `objects`: other state laid out like the parameters (nested dicts of DTensors, e.g.
        EMA's averages), saved with them under the key ``objects``. With `async_save` it
        returns, once the state is copied, a Future of the write going on in the background."""
        state = self._dcp_state(model, optimizer, objects)
        if self.async_save:
            return dcp.async_save(state, checkpoint_id=str(path), process_group=self.save_group)
        dcp.save(state, checkpoint_id=str(path))
        return None

    def load_shards(
        self,
        path: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        keys: Collection[str] = ("model", "optimizer"),
        objects: Mapping[str, Any] | None = None,
    ) -> None:
        """Load `keys` of the shards `save_shards` wrote (on any number of ranks, by any
        strategy whose state DCP can reshard), onto this rank's current layout; `path` is a
        local folder or an fsspec URL (read without unpickling objects: `load_shards_state`).
        `objects` (as for `save_shards`, this run's tensors in its own layout) are filled in
        place."""
        state = self._dcp_state(model, optimizer, objects, keys)
        if state:
            load_shards_state(state, path)
            self.load_sharded_state(model, optimizer, state)

    def _dcp_state(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        objects: Mapping[str, Any] | None,
        keys: Collection[str] = ("model", "optimizer"),
    ) -> dict[str, Any]:
        state = {k: v for k, v in self.sharded_state(model, optimizer).items() if k in keys}
        return {**state, "objects": objects} if objects else state

    def sharded_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """Model and optimizer state as this rank holds it, for torch.distributed.checkpoint:
        shards (DTensors) for sharded models, whole tensors otherwise. Loading such a dict
        in place through DCP reshards whatever was saved onto this layout."""
        return {
            "model": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, optimizer),
        }

    def load_sharded_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Apply what `sharded_state` returned after DCP filled it (either key may be absent)."""
        if "model" in state:
            set_model_state_dict(model, state["model"])
        if "optimizer" in state:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])

    # ------------------------------------------------------------------ collectives
    def all_reduce_sum(self, tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Sum a tensor over the processes of `group` (None: all, e.g. to agree on a flag;
        `dp_group` for data-parallel totals), in place, and return it."""
        del group
        return tensor

    def barrier(self) -> None:
        """Wait for all processes."""

    def teardown(self) -> None:
        """Leave the process group cleanly."""
