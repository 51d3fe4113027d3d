"""The Mixtral family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.mixtral.config import MixtralConfig
from llmfoundry.models.mixtral.model import MixtralForCausalLM


def activation_bytes(config: MixtralConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block, as measured on the decoder and MoE layer
    (tests/models/test_moe_families.py), with d = d_model, q = n_heads * head_dim, kv =
    n_kv_heads * head_dim, E experts, k = top_k, h = expert_hidden.

    float32: each RMSNorm's input, normalised output and 1/rms (8d + 4, twice), and its
    weighted output, the attention's and the router's input (4d, twice); SDPA's rotated queries,
    keys, values, output and log-sum-exp per head (8q + 8kv + 4 n_heads); the router's softmax
    probabilities (4E), top-k indices and weights, the copies' sort order, token and weight
    (28k), the weights' renormalisation (their sum and the weights it divides: 4k + 4); per
    token copy its gathered input, the experts' output before and after weighting (12kd), and
    the gate output, silu(gate), the up output and their product fed to w_down (16kh). Mixed precision (autocast): the q/k/v projections' and the router's inputs
    are 2-byte copies (one per projection: 8d in all, as the weighted outputs' 8d), SDPA's
    tensors too (4q + 4kv); the norms and the router's softmax stay float32; the experts
    compute in 2 bytes as F.linear would (GroupedExperts casts for the grouped multiply): their
    gathered input and output 4kd (the weighted output stays float32: 4kd), the hidden 8kh."""
    d, q = config.d_model, config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    experts, k, h = config.n_experts, config.top_k, config.expert_hidden
    fp32 = precision == "fp32"
    attention = 24 * d + 8 + (8 if fp32 else 4) * (q + kv) + 4 * config.n_heads
    routing = 4 * experts + 28 * k + (4 * k + 4)  # Mixtral always renormalises
    return attention + routing + (12 if fp32 else 8) * k * d + (16 if fp32 else 8) * k * h


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
        "sliding_window",
    ),
    activation_bytes=activation_bytes,
    attention_window=lambda config: config.sliding_window,
)
