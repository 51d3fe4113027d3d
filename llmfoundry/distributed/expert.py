"""Expert parallelism (`ep=P`): each MoE layer's experts split over the P ranks of an ep group,
every token copy sent to the rank that holds its expert and its output sent back.

As torchtitan's: an experts module (`GroupedExperts`: stacked weights [E, ...], and
``forward(x, counts)`` on token copies sorted by expert, `counts` [E] of them per expert) gets
its weights as DTensors `Shard(0)` over the ep mesh (rank r holds experts r E/P .. (r+1) E/P - 1,
`shard_experts`), and its forward is wrapped from outside (`apply_ep`): the MoE layer routes and
sorts its tokens as in one process, and the wrapper

1. exchanges the counts (an all-to-all of E / P numbers per rank pair), so each rank learns
   how many copies it will receive from each peer for each of its experts;
2. sends each copy to the rank holding its expert (an all-to-all of variable splits: the copies
   for rank r are contiguous, since they are sorted by expert);
3. reorders what arrived (peer-major: peer 0's copies for local experts 0, 1, ..., then peer
   1's) into local-expert order, runs the local experts on it with the local weights, and
   undoes the reorder;
4. sends the outputs back with the reverse all-to-all (combine), so the MoE layer receives
   [N, d] in its own order and weights and scatters them as in one process.

Both all-to-alls are differentiable: backward runs the reverse exchange of the gradients, so the
weight gradients of an expert sum the contributions of every token routed to it from any rank
of its group. The MoE layer and the model know nothing of any of it. The split sizes are read on
the host (one device-to-host copy of the counts per layer and forward), as torchtitan's.
torch's `all_to_all_single_autograd` is the differentiable exchange, with the same signature in
torch 2.11 (the floor) and 2.13, so no torch_compat shim stands between.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from llmfoundry.models.layers.moe import GroupedExperts
from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError


def experts_of(blocks: list[nn.Module]) -> list[nn.Module]:
    """The experts modules (`GroupedExperts`) inside `blocks`, in order."""
    return [m for block in blocks for m in block.modules() if isinstance(m, GroupedExperts)]


def check_expert_parallel(
    model: nn.Module, plan: ParallelPlan, ep: int, setting: str = "parallelism.ep"
) -> None:
    """Refuse (one line, every rank alike, before any collective) a model expert parallelism
    cannot split: one without experts, one whose expert count `ep` does not divide, or compiled
    blocks (the dispatch reads its split sizes on the host, and this is untested compiled)."""
    experts = experts_of([model])
    if not experts:
        raise UserError(
            f"{setting}={ep}: this model has no experts to split (no mixture-of-experts "
            f"layer); use an MoE model (a decoder with ffn: moe), or {setting}=1"
        )
    if plan.compile:
        raise UserError(
            f"{setting}={ep} with compiled blocks (model.compile=true) is not supported: the "
            "expert dispatch reads its split sizes on the host; set model.compile=false"
        )
    for module in experts:
        n_experts = module.w_gate.shape[0]
        if n_experts % ep:
            raise UserError(
                f"{setting}={ep} does not divide the model's {n_experts} experts: choose an "
                "ep that divides the expert count"
            )


def apply_ep(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Expert parallelism over `ep_mesh` on one experts module, from outside: its weights
    sharded over the experts (`shard_experts`), its forward wrapped in the dispatch and combine
    (`expert_parallel_forward`). Apply before FSDP, which shards the local experts again."""
    shard_experts(experts, ep_mesh)
    experts.forward = functools.partial(
        expert_parallel_forward, experts, experts.forward, ep_mesh.get_group()
    )


def shard_experts(experts: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Each of the module's own parameters ([E, ...]) as a DTensor `Shard(0)` over `ep_mesh`:
    this rank keeps its E / ep experts (as the checkpoint sees them: DCP reads and writes whole
    [E, ...] tensors, so a checkpoint moves between ep degrees)."""
    for name, param in list(experts.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, param.requires_grad))


@contextmanager
def _local_parameters(experts: nn.Module) -> Iterator[None]:
    """The module's parameters as this rank's plain tensors (its experts) while its own forward
    runs, differentiable back to the DTensors (FSDP's gathered ones inside a sharded unit);
    restored after. The experts' forward is plain tensor code (a grouped matmul over `counts`)
    that DTensor has no rule for, and which the local tensors are all it needs."""
    held = dict(experts._parameters)
    try:
        for name, param in held.items():
            if isinstance(param, DTensor):
                experts._parameters[name] = param.to_local()
        yield
    finally:
        experts._parameters.update(held)


def expert_parallel_forward(
    experts: nn.Module,
    local_forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup,
    x: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """The experts' forward under expert parallelism: `x` [N, d] this rank's token copies sorted
    by (global) expert, `counts` [E] of them per expert -> their outputs [N, d], in that order,
    computed by the ranks holding their experts (`local_forward`, the module's own forward, on
    this rank's, with its weights as local tensors)."""
    dispatch = Dispatch.of(counts, group)
    received = dispatch.send(x)
    with _local_parameters(experts):
        out = local_forward(received, dispatch.local_counts)
    return dispatch.combine(out)


class Dispatch:
    """One exchange of token copies within an ep group (see the module docstring): who sends
    whom how many (`send_splits`, `receive_splits`, host lists for the all-to-alls), the order
    that puts the received copies in local-expert order (`order`) and its inverse, and the
    copies per local expert (`local_counts`)."""

    def __init__(self, counts: torch.Tensor, received: torch.Tensor, group: dist.ProcessGroup):
        ep, local = received.shape  # received[s, j]: copies peer s sends for local expert j
        self.group = group
        self.send_splits = counts.view(ep, local).sum(1).tolist()
        self.receive_splits = received.sum(1).tolist()
        self.local_counts = received.sum(0)
        # Each arrived copy's (peer, local expert) segment, then sorted expert-major (stable:
        # within an expert, peer 0's copies first, each peer's in its own order).
        segment = torch.arange(ep * local, device=counts.device).repeat_interleave(
            received.flatten()
        )
        expert_major = (segment % local) * ep + segment // local
        self.order = torch.argsort(expert_major, stable=True)
        self.inverse = torch.argsort(self.order)

    @classmethod
    def of(cls, counts: torch.Tensor, group: dist.ProcessGroup) -> Dispatch:
        """Exchange `counts` [E] (this rank's copies per expert) over `group`: each rank
        receives, from every peer, the counts for its own E / ep experts."""
        ep = dist.get_world_size(group)
        if counts.numel() % ep:
            raise UserError(
                f"parallelism.ep={ep} does not divide this layer's {counts.numel()} experts"
            )
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=group)
        return cls(counts, received.view(ep, -1), group)

    def send(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's copies (sorted by expert) to the ranks holding their experts; returns
        the copies for this rank's experts, in local-expert order."""
        arrived = all_to_all_single_autograd(x, self.receive_splits, self.send_splits, self.group)
        return arrived.index_select(0, self.order)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """The reverse of `send`: the outputs of the copies this rank received, back to the
        ranks they came from, in their senders' order."""
        back = out.index_select(0, self.inverse)
        return all_to_all_single_autograd(back, self.send_splits, self.receive_splits, self.group)
