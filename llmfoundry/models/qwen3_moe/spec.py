"""The Qwen3-MoE family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.qwen3_moe.config import Qwen3MoeConfig
from llmfoundry.models.qwen3_moe.model import Qwen3MoeForCausalLM


def activation_bytes(config: Qwen3MoeConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block outside its mixture of experts (counted as
    Llama's, models/llama/spec.py; the MoE layer's own the planner counts from its MoESpec,
    `planning.moe_activation_bytes`), with d = d_model, q = n_heads * head_dim, kv =
    n_kv_heads * head_dim. float32: the block input, norm_1's output, the residual and norm_2's
    output (16d); the queries before their norm, rotated, the attention output and its
    head-merged copy (16q); the keys before their norm, rotated, and the values (12kv). Mixed
    precision: the residual stream float32 (8d), every other saved tensor a 2-byte copy:
    12d + 8q + 6kv."""
    d, q = config.d_model, config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    if precision == "fp32":
        return 16 * d + 16 * q + 12 * kv
    return 12 * d + 8 * q + 6 * kv


QWEN3_MOE = ModelFamily(
    name="qwen3_moe",
    config_target="llmfoundry.models.qwen3_moe.Qwen3MoeConfig",
    config_class=Qwen3MoeConfig,
    model_class=Qwen3MoeForCausalLM,
    parallelize=decoder_plan,
    hf_model_type="qwen3_moe",
    hf_adapter="llmfoundry.models.qwen3_moe.hf",
    architecture=(
        "d_model",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "n_layers",
        "n_experts",
        "top_k",
        "expert_hidden",
        "norm_topk_prob",
        "vocab_size",
        "tie_word_embeddings",
        "rope_theta",
    ),
    activation_bytes=activation_bytes,
)
