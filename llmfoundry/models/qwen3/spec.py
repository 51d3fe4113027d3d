"""The Qwen3 and Qwen2 families' specs (see llmfoundry/models/family.py): the shared decoder's
plan (models/decoder_plan.py), one transformers adapter (hf.py) for both model types."""

from __future__ import annotations

from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.family import ModelFamily
from llmfoundry.models.qwen3.config import Qwen2Config, Qwen3Config, QwenConfig
from llmfoundry.models.qwen3.model import Qwen2ForCausalLM, Qwen3ForCausalLM


def activation_bytes(config: QwenConfig, precision: str) -> int:
    """Bytes autograd keeps per token per block, counted as Llama's (models/llama/spec.py) with
    d = d_model, q = n_heads * head_dim (Qwen3's heads need not span d_model), kv = n_kv_heads
    * head_dim, f = ffn_hidden_size. float32: block input and norm_1's output (8d); the
    rotated queries and keys and the values, SDPA's inputs (4q + 8kv); the attention output
    and its head-merged copy (8q); the residual and norm_2's output (8d); SwiGLU's four (16f);
    Qwen3's q/k norms keep their inputs and normalised outputs (8q + 8kv). Mixed precision:
    the residual stream stays float32 (8d), every other saved tensor is a 2-byte copy.
    Planned / measured peak of two fp32 steps (tests/planning/peak_worker.py; d_model 256,
    head_dim 128, 4 layers, 8 x 256 tokens): 1.05, as Llama's 1.04."""
    d, f = config.d_model, config.ffn_hidden_size
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    qk_norm = isinstance(config, Qwen3Config)
    if precision == "fp32":
        return 16 * d + 12 * q + 8 * kv + 16 * f + qk_norm * (8 * q + 8 * kv)
    return 12 * d + 6 * q + 4 * kv + 8 * f + qk_norm * (4 * q + 4 * kv)


_ARCHITECTURE = (
    "d_model",
    "n_heads",
    "n_kv_heads",
    "n_layers",
    "ffn_hidden_size",
    "vocab_size",
    "tie_word_embeddings",
    "rope_theta",
)

QWEN3 = ModelFamily(
    name="qwen3",
    config_target="llmfoundry.models.qwen3.Qwen3Config",
    config_class=Qwen3Config,
    model_class=Qwen3ForCausalLM,
    parallelize=decoder_plan,
    hf_model_type="qwen3",
    hf_adapter="llmfoundry.models.qwen3.hf",
    architecture=(*_ARCHITECTURE, "head_dim"),
    activation_bytes=activation_bytes,
)

QWEN2 = ModelFamily(
    name="qwen2",
    config_target="llmfoundry.models.qwen3.Qwen2Config",
    config_class=Qwen2Config,
    model_class=Qwen2ForCausalLM,
    parallelize=decoder_plan,
    hf_model_type="qwen2",
    hf_adapter="llmfoundry.models.qwen3.hf",
    architecture=_ARCHITECTURE,
    activation_bytes=activation_bytes,
)
