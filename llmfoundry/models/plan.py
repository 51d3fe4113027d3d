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
    the root."""

    blocks: list[nn.Module]
