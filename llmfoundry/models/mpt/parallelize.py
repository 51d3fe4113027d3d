"""MPT's parallelization plan (see llmfoundry/models/plan.py): its transformer blocks, compiled
when its config says `compile`.

Each block holds 12 d_model^2 weights of a layer's 12 n_layers d_model^2, so sharding per block
keeps one layer's weights gathered at a time. The token embedding, which is also the output
head, stays with the root: it is used at both ends of the forward.

No tensor-parallel layout yet: the fused Wqkv would need one whose column split keeps each
rank's q, k and v heads together (and ALiBi slopes per local head).
"""

from __future__ import annotations

from llmfoundry.models.mpt.model import MPTForCausalLM
from llmfoundry.models.plan import ParallelPlan

_NO_TENSOR_PARALLEL = (
    "MPT has no tensor-parallel plan (its fused Wqkv is not split by head yet): use a Llama "
    "model (model=llama-...) for strategy.tp>1, or strategy.tp=1"
)


def parallelize_plan(model: MPTForCausalLM) -> ParallelPlan:
    return ParallelPlan(
        blocks=list(model.transformer.blocks),
        compile=model.config.compile,
        tensor_parallel_refusal=_NO_TENSOR_PARALLEL,
    )
