"""Bodies of the four-process tests of expert parallelism (test_expert_parallel.py). One spawn
runs every case in a row, a fresh process group each: the MoE layer's dispatch and combine at
ep4 and at ep2 x efsdp2 against the one-process layer (outputs, input and weight gradients),
then the trainings.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from llmfoundry.distributed import FSDP
from llmfoundry.distributed.expert import apply_ep
from llmfoundry.models.layers.moe import MoE, MoESpec

from .spawn import join_env

WORLD = 4
D_MODEL, ROWS = 16, 6
# Eight experts, two per token: at ep4 each rank holds two, at ep2 four.
LAYER = MoESpec(n_experts=8, top_k=2, expert_hidden=8)
LAYER_EP = (4, 2)


def moe_layer() -> MoE:
    """The MoE layer every rank and the one process build alike."""
    torch.manual_seed(0)
    return MoE(D_MODEL, LAYER)


def layer_inputs(world: int = WORLD) -> list[torch.Tensor]:
    """Each rank's [1, ROWS, d] tokens: 12 copies over 8 experts, so the splits differ between
    ranks and some experts get none from a rank."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(1, ROWS, D_MODEL, generator=generator) for _ in range(world)]


def layer_run(layer: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward `x`, backward of the outputs' summed squares (a sum over tokens, so the ranks'
    parts add up to the whole's): the output, the input's and the weights' gradients (the
    experts' as this rank holds them)."""
    x = x.clone().requires_grad_()
    out = layer(x)
    out.square().sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in grads.items()}
    return {"out": out.detach(), "x_grad": x.grad, **{f"grad.{k}": v for k, v in local.items()}}


def layer_case(rank: int, ep: int) -> dict[str, torch.Tensor]:
    """This rank's run of the layer with its experts split over `ep` ranks (FSDP's mesh laid
    out for them, ep borrowed from the four dp_shard ranks)."""
    strategy = FSDP("cpu", timeout_s=60, parallelism={"ep": ep})
    strategy.setup()
    try:
        layer = moe_layer()
        apply_ep(layer.experts, strategy.mesh.ep_mesh)
        return layer_run(layer, layer_inputs()[rank])
    finally:
        strategy.teardown()


def rank_main(rank: int, world: int, ports: list[int], out: str) -> None:
    ports = iter(ports)
    result: dict[str, dict] = {}
    for ep in LAYER_EP:
        join_env(rank, world, next(ports))
        result[f"layer_ep{ep}"] = layer_case(rank, ep)
    assert not dist.is_initialized()
    torch.save(result, Path(out) / f"rank{rank}.pt")
