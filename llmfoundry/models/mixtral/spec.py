"""The Mixtral family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.mixtral.config import MixtralConfig
from llmfoundry.models.mixtral.model import MixtralForCausalLM


def activation_bytes(config: MixtralConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block outside its mixture of experts (the MoE
    layer's own the planner counts from its MoESpec, `planning.moe_activation_bytes`), with
    d = d_model, kv = n_kv_heads * head_dim: Llama's attention half (models/llama/spec.py),
    the residual and norm_2's output included: float32 28d + 8kv, mixed precision 18d + 4kv."""
    d, kv = config.d_model, config.n_kv_heads * config.head_dim
    if precision == "fp32":
        return 28 * d + 8 * kv
    return 18 * d + 4 * kv


MIXTRAL = ModelFamily(
    name="mixtral",
    config_target="llmfoundry.models.mixtral.MixtralConfig",
    config_class=MixtralConfig,
    model_class=MixtralForCausalLM,
    parallelize=decoder_plan,
    hf_model_type="mixtral",
    hf_adapter="llmfoundry.models.mixtral.hf",
    architecture=(
        "d_model",
        "n_heads",
        "n_kv_heads",
        "n_layers",
        "n_experts",
        "top_k",
        "expert_hidden",
        "vocab_size",
        "tie_word_embeddings",
        "rope_theta",
    ),
    activation_bytes=activation_bytes,
)
