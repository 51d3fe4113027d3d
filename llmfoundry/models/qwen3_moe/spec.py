"""The Qwen3-MoE family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.qwen3_moe.config import Qwen3MoeConfig
from llmfoundry.models.qwen3_moe.model import Qwen3MoeForCausalLM


def activation_bytes(config: Qwen3MoeConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block (counted as Llama's, models/llama/spec.py),
    with d = d_model, q = n_heads * head_dim, kv = n_kv_heads * head_dim, E experts, k = top_k,
    h = expert_hidden. float32: the block input, norm_1's output, the residual and norm_2's
    output (16d); the queries before their norm, rotated, the attention output and its
    head-merged copy (16q); the keys before their norm, rotated, and the values (12kv); the
    mixture of experts as Mixtral's (models/mixtral/spec.py): 4E + 8k + 8kd + 16kh. Mixed
    precision: the residual stream float32 (8d), the router's softmax float32, every other
    saved tensor a 2-byte copy: 12d + 8q + 6kv + 4E + 8k + 4kd + 8kh."""
    d, q = config.d_model, config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    experts, k, h = config.n_experts, config.top_k, config.expert_hidden
    if precision == "fp32":
        return 16 * d + 16 * q + 12 * kv + 4 * experts + 8 * k + 8 * k * d + 16 * k * h
    return 12 * d + 8 * q + 6 * kv + 4 * experts + 8 * k + 4 * k * d + 8 * k * h


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
