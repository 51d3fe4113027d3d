"""Parallelization plans: which parts of a model a strategy shards and recomputes.

As torchtitan keeps one per model, each model family has its own plan beside its code
(`llmfoundry/models/mpt/parallelize.py`), and the model itself stays ignorant of it: strategies
(llmfoundry/distributed) read the plan and apply tensor parallelism, FSDP and activation
checkpointing from outside. The plan is data (modules and torch's tensor-parallel styles), so
the family code needs nothing of llmfoundry.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(frozen=True)
class ParallelPlan:
    """`blocks`: the repeated layers, input to output. Each is sharded as one unit (gathered
    just before its forward and backward and freed after), and is what activation
    checkpointing recomputes; the rest of the model (embeddings, final norm) is sharded with
    the root.

    `compile`: whether the model's config asks for its blocks to be compiled (torch.compile,
    per block), which the strategy applies after activation checkpointing and before
    sharding (llmfoundry/distributed/parallelize.py).

    `tensor_parallel`: the tensor-parallel layout, submodule name (relative to the model, as
    `parallelize_module` takes it) -> torch's style (ColwiseParallel, RowwiseParallel,
    SequenceParallel, PrepareModuleInput, ...); None: the family has none, and `strategy.tp>1`
    is refused with `tensor_parallel_refusal`. `tp_divides`: the sizes the tensor-parallel
    degree must divide (head counts, widths), by config name, checked before it is applied."""

    blocks: list[nn.Module]
    compile: bool = False
    tensor_parallel: Mapping[str, ParallelStyle] | None = None
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    tensor_parallel_refusal: str = "this model family has no tensor-parallel plan"
