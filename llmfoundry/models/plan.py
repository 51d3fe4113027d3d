"""Parallelization plans: which parts of a model a strategy shards and recomputes.

As torchtitan keeps one per model, each model family has its own plan beside its code
(`llmfoundry/models/mpt/parallelize.py`), and the model itself stays ignorant of it: strategies
(llmfoundry/distributed) read the plan and apply FSDP and activation checkpointing from outside.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ParallelPlan:
    """`blocks`: the repeated layers, input to output. Each is sharded as one unit (gathered
    just before its forward and backward and freed after), and is what activation
    checkpointing recomputes; the rest of the model (embeddings, final norm) is sharded with
    the root.

    `compile`: whether the model's config asks for its blocks to be compiled (torch.compile,
    per block), which the strategy applies after activation checkpointing and before
    sharding (llmfoundry/distributed/parallelize.py)."""

    blocks: list[nn.Module]
    compile: bool = False
