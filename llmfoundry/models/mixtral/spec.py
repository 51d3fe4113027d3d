"""The Mixtral family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.mixtral.config import MixtralConfig
from llmfoundry.models.mixtral.model import MixtralForCausalLM


def activation_bytes(config: MixtralConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block (counted as Llama's, models/llama/spec.py),
    with d = d_model, kv = n_kv_heads * head_dim, E experts, k = top_k, h = expert_hidden.
    float32: Llama's attention half (28d + 8kv, the residual and norm_2's output included);
    the router's softmax probabilities (4E) and the top-k weights before and after their
    renormalisation (8k); per token copy (k of them) its gathered input and the experts'
    output before weighting (8kd), the gate and up outputs, silu(gate) and the product fed to
    w_down (16kh): 28d + 8kv + 4E + 8k + 8kd + 16kh. Mixed precision: the residual stream
    float32, the router's softmax float32 (as it runs), every other saved tensor a 2-byte
    copy: 18d + 4kv + 4E + 8k + 4kd + 8kh."""
    d, kv = config.d_model, config.n_kv_heads * config.head_dim
    experts, k, h = config.n_experts, config.top_k, config.expert_hidden
    if precision == "fp32":
        return 28 * d + 8 * kv + 4 * experts + 8 * k + 8 * k * d + 16 * k * h
    return 18 * d + 4 * kv + 4 * experts + 8 * k + 4 * k * d + 8 * k * h


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
