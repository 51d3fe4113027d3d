"""Data parallelism: one process per device, each holding the whole model (torchrun launches them).

Every process trains on its own slice of the global batch; gradients are averaged across
processes, so all replicas take the same optimizer step and stay identical. On the mesh
(llmfoundry/distributed/mesh.py) every process is a replica: dp_replicate = world size. The
trainer already weights each microbatch by its share of the global batch's loss tokens times the
data-parallel size, which this averaging turns into the exact large-batch gradient.

Each gradient is summed on its own (`_reduce_each_gradient`), not as a slice of its bucket: a
collective sums each element of a flat buffer in an order that depends on where the element
sits in it (a ring starts each chunk at another rank), and DDP lays its buckets out anew after
the first step, in the order the gradients became ready. A run resumed from a checkpoint takes
its first step with the first layout, where the uninterrupted run had the second, so with three
or more ranks (two sum alike in any order) its weights differed in their last bits; summed one
by one, each gradient's order depends on its shape alone, and a resume is bitwise. The price:
one collective per gradient instead of one per bucket (all launched as the bucket is ready, so
they still overlap the backward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from llmfoundry.distributed.base import materialize
from llmfoundry.distributed.mesh import ParallelDims
from llmfoundry.distributed.parallelize import apply_ddp, apply_plan
from llmfoundry.distributed.process_group import ProcessGroupStrategy

# The deferred gradient average (`DDP.sync_gradients`) flattens gradients into buckets of about
# this many bytes, one all-reduce each: DDP's own bucket size (bucket_cap_mb=25). At most two
# buckets are alive at once (one reducing while the previous is copied back).
BUCKET_BYTES = 25 * 2**20


class DDP(ProcessGroupStrategy):
    """DistributedDataParallel over the processes `torchrun` started.

    `backend` defaults to nccl on CUDA and gloo on CPU. `timeout_s` bounds how long a collective
    waits for a missing rank before failing, instead of hanging a crashed job forever.
    `parallelism`: the mesh (mesh.py `parallel_dims`); only its data-parallel axes, every rank a
    replica (`dp_replicate` = the data-parallel size).
    """

    name = "ddp"

    def __init__(
        self,
        device: str = "auto",
        backend: str | None = None,
        timeout_s: float = 1800.0,
        find_unused_parameters: bool = False,
        parallelism: Mapping[str, Any] | ParallelDims | None = None,
    ) -> None:
        super().__init__(device, backend, timeout_s, parallelism)
        self.find_unused_parameters = find_unused_parameters
        self.dims = dataclasses.replace(self.dims, dp_replicate=self.dims.dp_size, dp_shard=1)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Materialize on this rank's device and replicate over the data-parallel group."""
        apply_plan(model)
        model = materialize(model, self.device)
        model = apply_ddp(model, self.dp_group, self.device, self.find_unused_parameters)
        model.register_comm_hook(self.dp_group, _reduce_each_gradient)
        return model

    def sync_context(self, model: torch.nn.Module, sync: bool) -> AbstractContextManager:
        if sync or not isinstance(model, DistributedDataParallel):
            return nullcontext()
        return model.no_sync()

    @torch.no_grad()
    def sync_gradients(self, model: torch.nn.Module) -> None:
        """Average the gradients over the data-parallel ranks in buckets (`BUCKET_BYTES`): a
        collective per parameter would cost its latency hundreds of times per step."""
        # Every rank must reduce the same tensors in the same order, so a parameter that got no
        # gradient on this rank contributes zeros rather than being skipped.
        params = [p for p in model.parameters() if p.requires_grad]
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        pending = None
        for bucket in _buckets([p.grad for p in params], BUCKET_BYTES):
            flat = torch.cat([grad.reshape(-1) for grad in bucket])
            work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
            if pending is not None:
                self._unflatten_mean(*pending)
            pending = work, flat, bucket
        if pending is not None:
            self._unflatten_mean(*pending)

    def _unflatten_mean(self, work: dist.Work, flat: torch.Tensor, bucket: list) -> None:
        """Wait for a bucket's sum, and copy its mean back into the gradients it holds."""
        work.wait()
        flat.div_(self.dp_size)
        for grad, piece in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            grad.copy_(piece.view_as(grad))


# Unannotated: DDP compares a hook's annotations with the classes, and here they are strings.
def _reduce_each_gradient(group, bucket):  # (ProcessGroup | None, GradBucket) -> Future[Tensor]
    """DDP's communication hook: the bucket's mean over the ranks, as DDP's own (divided by the
    ranks, then summed), but one all-reduce per gradient, all in flight at once, so how the
    gradients are laid out in buckets does not change the sums (module docstring)."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    works = [dist.all_reduce(grad, group=group, async_op=True) for grad in bucket.gradients()]
    return torch.futures.collect_all([work.get_future() for work in works]).then(lambda _: buffer)


def _buckets(grads: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """`grads` in buckets of one dtype and device (a flat buffer holds one) of at most `limit`
    bytes each (a larger gradient alone), in the order given: every rank forms the same ones."""
    kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for grad in grads:
        kinds.setdefault((grad.dtype, grad.device), []).append(grad)
    for same_kind in kinds.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for grad in same_kind:
            nbytes = grad.numel() * grad.element_size()
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(grad)
            size += nbytes
        yield bucket
