"""MPT's parallelization plan (see llmfoundry/models/plan.py): its transformer blocks, compiled
when its config says `compile`, and how the model splits into pipeline stages.

Each block holds 12 d_model^2 weights of a layer's 12 n_layers d_model^2, so sharding per block
keeps one layer's weights gathered at a time. The token embedding, which is also the output
head, stays with the root: it is used at both ends of the forward. Split into pipeline stages,
the first stage embeds and the last applies the final norm and the head, so both hold the
token embedding (`tied`).

No tensor-parallel layout yet: the fused Wqkv would need one whose column split keeps each
rank's q, k and v heads together (and ALiBi slopes per local head). DTensor's
`_StridedShard(0, split_factor=3)` is that layout (rank r holds [q_r; k_r; v_r], and a linear
keeps it), but with torch 2.13 FSDP2 sharding over it gathers a wrong whole tensor and DCP
refuses its chunks as overlapping (probed on 2 x 2 gloo processes). Separate q, k, v
projections, fused only in the HF export, would take Llama's layout instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmfoundry.models.layers.attention import compute_dtype
from llmfoundry.models.layers.position import positions_in_document
from llmfoundry.models.mpt.model import MPTForCausalLM
from llmfoundry.models.plan import ParallelPlan, PipelineSplit


def pipeline_stage_forward(
    model: MPTForCausalLM,
    inputs: torch.Tensor,
    sequence_id: torch.Tensor | None = None,
    *,
    seq_len: int,
    first: bool,
    last: bool,
) -> torch.Tensor:
    """`MPTModel.forward` and the head, for one stage (`PipelineSplit.forward`); the blocks the
    stage does not hold pass their input through."""
    transformer = model.transformer
    x = inputs
    if first:
        x = transformer.wte(inputs)
        if transformer.learned_pos_emb:
            if sequence_id is None:
                pos = torch.arange(seq_len, device=inputs.device)
            else:
                pos = positions_in_document(sequence_id)
            x = x + transformer.wpe(pos)
        x = transformer.emb_drop(x)
    mask = transformer.masks(sequence_id, x.device, compute_dtype(x))
    for block in transformer.blocks:
        x = block(x, mask)
    if not last:
        return x
    return F.linear(transformer.norm_f(x), transformer.wte.weight)


_PIPELINE = PipelineSplit(
    first=("transformer.wpe", "transformer.emb_drop"),
    last=("transformer.norm_f",),
    tied=("transformer.wte",),
    forward=pipeline_stage_forward,
)

_NO_TENSOR_PARALLEL = (
    "MPT has no tensor-parallel plan (its fused Wqkv is not split by head yet): use a Llama "
    "model (model=llama-...) for strategy.tp>1, or strategy.tp=1"
)


def parallelize_plan(model: MPTForCausalLM) -> ParallelPlan:
    return ParallelPlan(
        blocks=list(model.transformer.blocks),
        compile=model.config.compile,
        pipeline=_PIPELINE,
        tensor_parallel_refusal=_NO_TENSOR_PARALLEL,
    )
