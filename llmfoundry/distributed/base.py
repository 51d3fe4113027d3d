"""The strategy interface, and the helpers every strategy shares.

A strategy owns the process group, the device, how a model built on the meta device is
materialized and wrapped, and the training step's backward / optimizer step / zero_grad.
One-process, data-parallel and sharded strategies implement the same interface, so the trainer
does not branch on which is in use. Checkpoints read and write model and optimizer state
themselves (llmfoundry/checkpoint/state.py, sharded.py), as the strategy's flags below say.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from llmfoundry.core.precision import Precision
from llmfoundry.utils.errors import UserError

if TYPE_CHECKING:
    from llmfoundry.distributed.context import ContextParallel
    from llmfoundry.distributed.pipeline import Pipeline


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
    rather than one file of whole tensors written by rank 0. `async_save`: whether a save of the
    shards returns while its files are still being written (a Future the checkpoint waits for;
    llmfoundry/checkpoint/sharded.py).

    `pipeline`: this process's pipeline stage and schedule (pipeline.py), which then runs the
    step's microbatches instead of the trainer's loop; None without pipeline parallelism.
    `tp`: how many processes split each block's matrices and each sequence (tensor and
    sequence parallelism; 1: none).
    `scales_loss`: whether the engine `wrap_optimizer` hands the optimizer to scales fp16 losses
    itself (DeepSpeed), so the trainer's `Precision` must not.
    `context`: this process's part of context parallelism (context.py: it takes its part of
    each sequence, `ContextParallel.shard`); None without it. `cp`: its degree (1: none).
    `loss_group`/`loss_size`: the processes whose losses cover different tokens (data-parallel
    x context-parallel ranks), over which the trainer sums losses and metrics and by whose
    count it weights each microbatch; the data-parallel ones without context parallelism.
    """

    rank: int = 0
    world_size: int = 1
    device: torch.device
    sharded_checkpoints: bool = False
    async_save: bool = False
    # The background saves' own process group, so their collectives never interleave with
    # training's (gloo: async DCP needs a CPU backend, also when training uses nccl).
    save_group: Any = None
    pipeline: Pipeline | None = None
    tp: int = 1
    cp: int = 1
    context: ContextParallel | None = None
    scales_loss: bool = False

    @property
    def dp_rank(self) -> int:
        return self.rank

    @property
    def dp_size(self) -> int:
        return self.world_size

    @property
    def dp_group(self) -> Any:
        """The processes this one reduces data-parallel counts with (`all_reduce_sum`'s
        `group`); None: all of them."""
        return None

    @property
    def loss_group(self) -> Any:
        """The processes this one sums losses and metric totals with (None: all of them)."""
        return self.dp_group

    @property
    def loss_size(self) -> int:
        """How many processes' losses cover different tokens of each global batch."""
        return self.dp_size

    def setup(self) -> None:
        """Join the process group (no-op for one process)."""

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Materialize a model built on the meta device, initialize it, and wrap it."""
        raise NotImplementedError

    def wrap_optimizer(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, precision: str
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Hand the prepared model and the optimizer built on its parameters to an engine that
        owns the optimizer step (DeepSpeed), configured for `precision` (the trainer's, e.g.
        "amp_bf16"); returns what the loop trains and steps."""
        del precision
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

    def guard_collectives(self, model: torch.nn.Module, guard: bool = True) -> None:
        """Auto-microbatching is on: while `guard` (the trainer is searching for a microbatch
        size), make collectives inside forward and backward safe from a rank that runs out of
        memory; `guard` False: the size has settled, and the guards may come off (none here:
        data parallelism defers its only collective, the gradient average, to
        `sync_gradients`)."""
        del model, guard

    @property
    def out_of_memory_retryable(self) -> bool:
        """Whether every rank can still agree on an out-of-memory error raised in this step's
        forward or backward (none is inside a collective the failed rank will not reach):
        always without collectives there, otherwise while they are guarded."""
        return True

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
