"""Data parallelism: one process per device, each holding the whole model (torchrun launches them).

Every process trains on its own slice of the global batch; gradients are averaged across
processes, so all replicas take the same optimizer step and stay identical. The trainer already
weights each microbatch by its share of the global batch's loss tokens times the world size,
which this averaging turns into the exact large-batch gradient.
"""

from __future__ import annotations

import inspect
import os
import time
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from llmfoundry.distributed.single import Strategy, materialize, resolve_device
from llmfoundry.utils.errors import UserError

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Seconds given to gloo's worker threads around destroying the process group (see teardown).
_GLOO_DRAIN_S = 0.1
# No buffer sync inside forward (see DDP.prepare); newer torch names it forward_sync_buffers.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


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


class DDP(Strategy):
    """DistributedDataParallel over the processes `torchrun` started.

    `backend` defaults to nccl on CUDA and gloo on CPU. `timeout_s` bounds how long a collective
    waits for a missing rank before failing, instead of hanging a crashed job forever.
    """

    def __init__(
        self,
        device: str = "auto",
        backend: str | None = None,
        timeout_s: float = 1800.0,
        find_unused_parameters: bool = False,
    ) -> None:
        missing = [key for key in _ENV if key not in os.environ]
        if missing:
            raise UserError(
                f"strategy=ddp needs the torchrun environment, but {', '.join(missing)} "
                "is not set: launch with `torchrun --nproc_per_node=N scripts/train.py "
                "strategy=ddp ...`, or use strategy=single for one process"
            )
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        resolved = resolve_device(device)
        if resolved.type == "cuda" and resolved.index is None:
            resolved = torch.device("cuda", self.local_rank)
        self.device = resolved
        self.backend = backend or ("nccl" if resolved.type == "cuda" else "gloo")
        if timeout_s <= 0:
            raise ValueError(f"strategy.timeout_s must be positive, got {timeout_s}")
        self.timeout = timedelta(seconds=timeout_s)
        self.find_unused_parameters = find_unused_parameters
        self._owns_group = False

    def setup(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise RuntimeError(
                    f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) is "
                    f"already initialized, but the environment says rank {self.rank} of "
                    f"{self.world_size}"
                )
            return
        dist.init_process_group(
            backend=self.backend,
            init_method="env://",
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
        )
        self._owns_group = True

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Materialize on this rank's device and wrap; DDP copies rank 0's weights to all ranks.

        Buffers are not synced on every forward: the models here hold only constant buffers,
        and a forward with no collective inside means an out-of-memory error on one rank
        cannot leave another waiting mid-forward.
        """
        model = materialize(model, self.device)
        return DistributedDataParallel(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            **_NO_FORWARD_BUFFER_SYNC,
            find_unused_parameters=self.find_unused_parameters,
        )

    def sync_context(self, model: torch.nn.Module, sync: bool) -> AbstractContextManager:
        if sync or not isinstance(model, DistributedDataParallel):
            return nullcontext()
        return model.no_sync()

    @torch.no_grad()
    def sync_gradients(self, model: torch.nn.Module) -> None:
        # Every rank must reduce the same tensors in the same order, so a parameter that got no
        # gradient on this rank contributes zeros rather than being skipped.
        params = [p for p in model.parameters() if p.requires_grad]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        handles = [dist.all_reduce(p.grad, async_op=True) for p in params]
        for handle in handles:
            handle.wait()
        for param in params:
            param.grad.div_(self.world_size)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def teardown(self) -> None:
        """Destroy the process group this strategy created (gloo can abort at exit otherwise).

        Gloo's worker threads release a finished collective's tensors only after the caller has
        been woken, and that release needs the GIL; a process group destroyed in that window
        (its destructor holds the GIL and joins those threads) deadlocks (pytorch/pytorch#56297).
        Sleeping first hands them the GIL.
        """
        if self._owns_group and dist.is_initialized():
            time.sleep(_GLOO_DRAIN_S)
            dist.destroy_process_group()
            time.sleep(_GLOO_DRAIN_S)
        self._owns_group = False
