"""Parallelization plans: which parts of a model a strategy shards and recomputes.

As torchtitan keeps one per model, each model family has its own plan beside its code
(`llmfoundry/models/mpt/parallelize.py`), and the model itself stays ignorant of it: strategies
(llmfoundry/distributed) read the plan and apply tensor parallelism, FSDP and activation
checkpointing from outside. The plan is data (modules and torch's tensor-parallel styles), so
the family code needs nothing of llmfoundry.distributed. A style more than one family's layout
uses is here (`GatheredSequenceParallel`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

# A pipeline stage's forward: (model, inputs, sequence_id, seq_len=, first=, last=) -> output.
# The first stage's inputs are token ids, the others' the previous stage's hidden states (split
# by sequence position under tensor parallelism: `seq_len` is the whole sequence's length); the
# last stage returns logits, the others hidden states. Modules the stage does not hold pass
# inputs through.
StageForward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class PipelineSplit:
    """How the family's model runs as pipeline stages (llmfoundry/distributed/pipeline.py):
    each stage holds a contiguous run of the plan's blocks; `first` names the modules only the
    first stage holds (embeddings), `last` those only the last holds (final norm, an untied
    head), `tied` those both hold (an embedding that is also the output head: the last stage
    keeps a copy whose gradient is summed with the first's). `forward` is the stage's forward."""

    first: tuple[str, ...]
    last: tuple[str, ...]
    tied: tuple[str, ...]
    forward: StageForward


@dataclass(frozen=True)
class ParallelPlan:
    """`blocks`: the repeated layers, input to output. Each is sharded as one unit (gathered
    just before its forward and backward and freed after), and is what activation
    checkpointing recomputes; the rest of the model (embeddings, final norm) is sharded with
    the root.

    `compile`: whether the model's config asks for its blocks to be compiled (torch.compile,
    per block), which the strategy applies after activation checkpointing and before
    sharding (llmfoundry/distributed/parallelize.py).

    `pipeline`: how to split the model into pipeline stages; None: the family cannot be.

    `tensor_parallel`: the tensor-parallel layout, submodule name (relative to the model, as
    `parallelize_module` takes it) -> torch's style (ColwiseParallel, RowwiseParallel,
    SequenceParallel, PrepareModuleInput, ...); None: the family has none, and `parallelism.tp>1`
    is refused with `tensor_parallel_refusal`. `tp_divides`: the sizes the tensor-parallel
    degree must divide (head counts, widths), by config name, checked before it is applied.
    `tp_all_to_all`: the activations the layout exchanges in all-to-alls per block forward
    beyond torch's styles' collectives, in block inputs ([tokens, d_model]) before the 1/tp
    split (MPT's fused Wqkv; scripts/plan.py counts it).

    `context_parallel_refusal`: why the family cannot split a sequence over context-parallel
    ranks (llmfoundry/distributed/context.py), "" when it can. `pipeline_refusal`: why this
    model (not its family) cannot run as pipeline stages, "" when it can (an MoE whose router
    losses need every stage's routing at the loss)."""

    blocks: list[nn.Module]
    compile: bool = False
    pipeline: PipelineSplit | None = None
    tensor_parallel: Mapping[str, ParallelStyle] | None = None
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    tensor_parallel_refusal: str = "this model family has no tensor-parallel plan"
    tp_all_to_all: float = 0.0
    context_parallel_refusal: str = ""
    pipeline_refusal: str = ""


class GatheredSequenceParallel(SequenceParallel):
    """SequenceParallel for the final norm before a tied head (MPT's, a tied Llama's): the norm
    runs on this rank's sequence positions, then its output is gathered over the sequence
    (backward: its gradient reduce-scattered), as ColwiseParallel gathers an untied head's
    input. The head, `F.linear` by the row-split embedding, then gives vocabulary-sharded
    logits without any redistribution of its own. torch 2.11's DTensor cannot multiply a
    sequence-sharded input (it refuses to flatten batch and sequence with the sequence split),
    torch 2.13's chooses its own redistribution; this layout is the same on both."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        module.register_forward_hook(lambda _module, _args, output: _gathered(output))
        return module


def _gathered(output: DTensor) -> DTensor:
    return output.redistribute(output.device_mesh, [Replicate()])
