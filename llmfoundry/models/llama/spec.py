"""The Llama family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmfoundry.models.family import ModelFamily
from llmfoundry.models.layers.attention import positions_in_document
from llmfoundry.models.llama.config import LlamaConfig
from llmfoundry.models.llama.model import LlamaForCausalLM
from llmfoundry.models.mpt.model import compute_dtype
from llmfoundry.models.plan import ParallelPlan, PipelineSplit


def pipeline_stage_forward(
    model: LlamaForCausalLM,
    inputs: torch.Tensor,
    sequence_id: torch.Tensor | None = None,
    *,
    first: bool,
    last: bool,
) -> torch.Tensor:
    """`LlamaModel.forward` and the head, for one pipeline stage (`PipelineSplit.forward`);
    every stage computes the rotations and the mask, the blocks it does not hold pass through."""
    transformer = model.transformer
    x = transformer.wte(inputs) if first else inputs
    seq_len = x.shape[1]
    if sequence_id is None:
        positions = torch.arange(seq_len, device=x.device)[None]
    else:
        positions = positions_in_document(sequence_id)
    rope = transformer.rope(positions)
    mask = transformer.masks(sequence_id, x.device, compute_dtype(x))
    for block in transformer.blocks:
        x = block(x, mask, rope)
    if not last:
        return x
    return F.linear(transformer.norm_f(x), model.output_embedding())


def parallelize_plan(model: LlamaForCausalLM) -> ParallelPlan:
    """Its blocks, as MPT's: one layer's weights gathered at a time; the embedding, the final
    norm and an untied lm_head stay with the root. As pipeline stages, the first embeds and the
    last holds the final norm and the head (a tied one: the embedding, held by both)."""
    tied = model.config.tie_word_embeddings
    pipeline = PipelineSplit(
        first=() if tied else ("transformer.wte",),
        last=("transformer.norm_f",) if tied else ("transformer.norm_f", "lm_head"),
        tied=("transformer.wte",) if tied else (),
        forward=pipeline_stage_forward,
    )
    return ParallelPlan(blocks=list(model.transformer.blocks), pipeline=pipeline)


def activation_bytes(config: LlamaConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block (counted as MPT's, models/mpt/spec.py), with d
    = d_model, kv = n_kv_heads * head_dim, f = ffn_hidden_size. float32: block input and
    attn_norm's output (4d + 4d); the rotated queries and keys and the values, SDPA's inputs
    (4d + 8kv; RoPE's backward needs only cos/sin); the attention output and its head-merged
    copy (4d + 4d); the residual and mlp_norm's output (4d + 4d); SwiGLU's gate and up outputs,
    silu(gate) and the product fed to down_proj (16f): 28d + 8kv + 16f. Mixed precision: the
    residual stream stays float32 (4d + 4d), every other saved tensor is a 2-byte copy:
    18d + 4kv + 8f."""
    d, f = config.d_model, config.ffn_hidden_size
    kv = config.n_kv_heads * config.head_dim
    if precision == "fp32":
        return 28 * d + 8 * kv + 16 * f
    return 18 * d + 4 * kv + 8 * f


LLAMA = ModelFamily(
    name="llama",
    config_target="llmfoundry.models.llama.LlamaConfig",
    config_class=LlamaConfig,
    model_class=LlamaForCausalLM,
    parallelize=parallelize_plan,
    hf_model_type="llama",
    hf_adapter="llmfoundry.models.llama.hf",
    architecture=(
        "d_model",
        "n_heads",
        "n_kv_heads",
        "n_layers",
        "ffn_hidden_size",
        "vocab_size",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
    ),
    activation_bytes=activation_bytes,
)
