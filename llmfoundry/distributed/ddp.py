"""Data parallelism: one process per device, each holding the whole model (torchrun launches them).

Every process trains on its own slice of the global batch; gradients are averaged across
processes, so all replicas take the same optimizer step and stay identical. The trainer already
weights each microbatch by its share of the global batch's loss tokens times the world size,
which this averaging turns into the exact large-batch gradient.
"""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from llmfoundry.distributed.base import materialize
from llmfoundry.distributed.process_group import ProcessGroupStrategy

# No buffer sync inside forward (see DDP.prepare); newer torch names it forward_sync_buffers.
_NO_FORWARD_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


class DDP(ProcessGroupStrategy):
    """DistributedDataParallel over the processes `torchrun` started.

    `backend` defaults to nccl on CUDA and gloo on CPU. `timeout_s` bounds how long a collective
    waits for a missing rank before failing, instead of hanging a crashed job forever.
    """

    name = "ddp"

    def __init__(
        self,
        device: str = "auto",
        backend: str | None = None,
        timeout_s: float = 1800.0,
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__(device, backend, timeout_s)
        self.find_unused_parameters = find_unused_parameters

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
