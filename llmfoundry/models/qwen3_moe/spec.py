"""The Qwen3-MoE family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.qwen3_moe.config import Qwen3MoeConfig
from llmfoundry.models.qwen3_moe.model import Qwen3MoeForCausalLM


def activation_bytes(config: Qwen3MoeConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block, as measured on the decoder and MoE layer
    (tests/models/test_moe_families.py): Mixtral's count (models/mixtral/spec.py, whose
    symbols these are) and the per-head q/k RMSNorms': their inputs, normalised outputs and
    1/rms per head, 8(q + kv) + 4(n_heads + n_kv_heads) in float32; under autocast their
    inputs are float32 copies of the 2-byte projections and their outputs 2-byte copies,
    6(q + kv) + 4(n_heads + n_kv_heads); and no renormalisation's 4k + 4 where norm_topk_prob
    is false."""
    d, q = config.d_model, config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    experts, k, h = config.n_experts, config.top_k, config.expert_hidden
    fp32 = precision == "fp32"
    attention = 24 * d + 8 + (8 if fp32 else 4) * (q + kv) + 4 * config.n_heads
    qk_norms = (8 if fp32 else 6) * (q + kv) + 4 * (config.n_heads + config.n_kv_heads)
    routing = 4 * experts + 28 * k + (4 * k + 4 if config.norm_topk_prob else 0)
    return (
        attention + qk_norms + routing + (12 if fp32 else 8) * k * d + (16 if fp32 else 8) * k * h
    )


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
