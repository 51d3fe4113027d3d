"""The Llama family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.llama.config import LlamaConfig
from llmfoundry.models.llama.model import LlamaForCausalLM


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
    parallelize=decoder_plan,
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
