"""Convert between Qwen3MoeForCausalLM and transformers' `Qwen3MoeForCausalLM` (in memory or a
folder).

The two compute the same function: Qwen3's attention (an RMSNorm over each query and key head
before RoPE, RoPE pairing dimension i with i + head_dim / 2 as transformers' rotate_half does)
and the same routing (softmax over the experts in float32, top_k, renormalised when
norm_topk_prob). The tensors differ in name and in how the experts are stacked
(`llmfoundry.models.hf_moe`).

`to_hf_config` and `from_hf_config` map the configs. A transformers config that would make its
model compute something ours does not is refused with the field named: dense layers among the
MoE ones (`mlp_only_layers`, `decoder_sparse_step` other than 1: every block of ours is an MoE),
attention biases, a sliding window, another activation, a RoPE variant. transformers'
`intermediate_size` is the width of those dense layers, so an import (which has none) ignores
it and an export writes expert_hidden * top_k, the dense width of the same active FFN (what
Qwen's releases state: 30B-A3B's 6144 = 768 * 8). Not carried, as they do not change what the
weights compute: dropout, token ids, and our `z_loss_weight` (transformers' Qwen3-MoE has no
z-loss; an export drops it). The aux loss weight is carried both ways (`router_aux_loss_coef`);
`output_router_logits`, transformers' switch for adding it to its own training loss (false in
the released configs, an inference default), is not: our training always adds aux_loss_weight
times the load-balancing loss (model.aux_loss_weight=0 for none).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from llmfoundry.models import hf_decoder, hf_moe
from llmfoundry.models.hf_config import read_config_json
from llmfoundry.models.hf_folder import load_hf_weights, read_hf_config, save_hf_folder
from llmfoundry.models.hf_lib import transformers
from llmfoundry.models.qwen3_moe.config import Qwen3MoeConfig
from llmfoundry.models.qwen3_moe.model import Qwen3MoeForCausalLM

# The config.json sizes an import divides by or allocates from (checked positive first), and
# the expert count: "num_experts" in Qwen's releases, "num_local_experts" as transformers 5
# writes it (its attribute_map), either read as num_experts.
HF_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "moe_intermediate_size",
    "num_experts_per_tok",
    "vocab_size",
    "max_position_embeddings",
)
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "decoder_sparse_step")
BLOCK = {**hf_moe.BLOCK, **hf_decoder.QK_NORMS}


def to_hf_config(cfg: Qwen3MoeConfig) -> transformers.Qwen3MoeConfig:
    """The transformers config for `cfg` (every Qwen3MoeConfig is representable)."""
    return transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.expert_hidden * cfg.top_k,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        attention_bias=False,
        use_sliding_window=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        moe_intermediate_size=cfg.expert_hidden,
        num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.norm_topk_prob,
        router_aux_loss_coef=cfg.aux_loss_weight,
        bos_token_id=None,
        eos_token_id=None,
    )


def from_hf_config(hf: transformers.PretrainedConfig) -> Qwen3MoeConfig:
    """Our config for a transformers Qwen3-MoE config; UserError (a ValueError) naming what we
    cannot represent."""
    unsupported = []
    if (model_type := getattr(hf, "model_type", None)) != "qwen3_moe":
        unsupported.append(f"model_type={model_type!r} (only 'qwen3_moe')")
    checks = [
        ("hidden_act", hf.hidden_act, "silu"),
        ("attention_bias", hf.attention_bias, False),
        ("sliding_window", hf.sliding_window, None),
        ("decoder_sparse_step", hf.decoder_sparse_step, 1),
        ("mlp_only_layers", list(hf.mlp_only_layers or []), []),
    ]
    unsupported += hf_decoder.mismatches(checks)
    theta = hf_decoder.rope_theta(hf, unsupported, default=None)
    hf_decoder.refuse("Qwen3-MoE", unsupported)
    return Qwen3MoeConfig(
        d_model=hf.hidden_size,
        n_heads=hf.num_attention_heads,
        n_layers=hf.num_hidden_layers,
        n_kv_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None),
        n_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        expert_hidden=hf.moe_intermediate_size,
        norm_topk_prob=bool(hf.norm_topk_prob),
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=theta,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        aux_loss_weight=hf.router_aux_loss_coef,
        init_std=hf.initializer_range,
    )


def to_hf_model(model: Qwen3MoeForCausalLM, dtype: torch.dtype | None = None):
    """A transformers Qwen3MoeForCausalLM with `model`'s weights (`hf_moe.to_hf_model`)."""
    return hf_moe.to_hf_model(
        model, transformers.Qwen3MoeForCausalLM, to_hf_config(model.config), BLOCK, dtype
    )


def from_hf_model(hf_model) -> Qwen3MoeForCausalLM:
    """Our model holding the weights of a transformers Qwen3MoeForCausalLM."""
    config = from_hf_config(hf_model.config)
    return hf_moe.from_hf_model(hf_model, config, Qwen3MoeForCausalLM, BLOCK)


def export_to_hf(
    model: Qwen3MoeForCausalLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
    eos_token: str | None = None,
) -> Path:
    """Write `model` (and `tokenizer`) as a transformers Qwen3MoeForCausalLM folder
    (safetensors, the per-expert tensors of Qwen's release). `dtype` casts the exported copy;
    `eos_token` (a token of `tokenizer`) becomes the tokenizer's and the model's EOS."""
    return save_hf_folder(to_hf_model(model, dtype), out_dir, tokenizer, eos_token)


def from_hf(hf_dir: str | Path) -> Qwen3MoeForCausalLM:
    """The transformers Qwen3-MoE folder `hf_dir` (config.json + weights) as our model, float32."""
    experts = (
        "num_local_experts" if "num_local_experts" in read_config_json(hf_dir) else "num_experts"
    )
    hf_config = read_hf_config(hf_dir, (*HF_SIZES, experts), optional_sizes=OPTIONAL_SIZES)
    from_hf_config(hf_config)  # refuse what we cannot represent before reading any weight
    hf_model = load_hf_weights(transformers.Qwen3MoeForCausalLM, hf_dir, hf_config)
    return from_hf_model(hf_model).eval()
