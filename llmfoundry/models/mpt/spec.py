"""The MPT family's spec (see llmfoundry/models/family.py)."""

from __future__ import annotations

from llmfoundry.models.family import ModelFamily
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.foundry import mpt_config_from_foundry
from llmfoundry.models.mpt.model import MPTForCausalLM
from llmfoundry.models.mpt.parallelize import parallelize_plan

# Bytes autograd keeps per token per block, in units of d_model, by precision. float32: block
# input x and norm_1's output (4 + 4), the fused qkv (12), the attention output and its
# head-merged copy (4 + 4), the residual x2 and norm_2's output (4 + 4), the MLP's up projection
# and GELU output (16 + 16): 68. amp_bf16/amp_fp16: the residual stream and norm inputs stay
# float32 (4 + 4), every matmul input is a 2-byte copy (norm outputs 2 + 2, attention 2 + 2,
# GELU 8), as are qkv (6) and the up projection (8): 38.
_ACTIVATION_BYTES = {"fp32": 68, "amp_bf16": 38, "amp_fp16": 38}


def _activation_bytes(config: MPTConfig, precision: str) -> int:
    return _ACTIVATION_BYTES[precision] * config.d_model


def _position_limit(config: MPTConfig) -> int | None:
    return config.max_seq_len if config.learned_pos_emb else None


def _attention_window(config: MPTConfig) -> int | None:
    if config.infini is not None:
        return config.infini.segment_len
    return config.sliding_window


MPT = ModelFamily(
    name="mpt",
    config_target="llmfoundry.models.mpt.MPTConfig",
    config_class=MPTConfig,
    model_class=MPTForCausalLM,
    parallelize=parallelize_plan,
    hf_model_type="mpt",
    hf_adapter="llmfoundry.models.mpt.hf",
    architecture=(
        "d_model",
        "n_heads",
        "kv_n_heads",
        "n_layers",
        "expansion_ratio",
        "vocab_size",
        "alibi",
        "learned_pos_emb",
        "no_bias",
        "qk_ln",
    ),
    activation_bytes=_activation_bytes,
    load_overrides={"compile": False},
    position_limit=_position_limit,
    recurrent_memory=lambda config: config.infini is not None,
    attention_window=_attention_window,
    foundry_config=mpt_config_from_foundry,
)
