"""The Mixtral family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.mixtral.config import MixtralConfig
from llmfoundry.models.mixtral.model import MixtralForCausalLM


def activation_bytes(config: MixtralConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block outside its mixture of experts (the MoE
    layer's own the planner counts from its MoESpec, `planning.moe_activation_bytes`), as
    measured on the decoder (tests/models/test_moe_families.py), with d = d_model, q = n_heads *
    head_dim, kv = n_kv_heads * head_dim. float32: each RMSNorm's input, normalised output and
    1/rms (8d + 4, twice), its weighted output, the attention's and the router's input (4d,
    twice); SDPA's rotated queries, keys, values, output and log-sum-exp per head (8q + 8kv +
    4 n_heads). Mixed precision (autocast): the q/k/v projections' inputs are 2-byte copies
    (6d; the router's the planner counts with the MoE layer), SDPA's tensors too (4q + 4kv);
    the norms stay float32."""
    d, q = config.d_model, config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    fp32 = precision == "fp32"
    return (24 if fp32 else 22) * d + 8 + (8 if fp32 else 4) * (q + kv) + 4 * config.n_heads


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
