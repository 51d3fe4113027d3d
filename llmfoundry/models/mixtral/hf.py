"""Convert between MixtralForCausalLM and transformers' `MixtralForCausalLM` (in memory or a
folder).

The two compute the same function: Llama's attention (our RoPE pairs dimension i with
i + head_dim / 2 as transformers' rotate_half does) and the same routing (softmax over the
experts in float32, top_k, renormalised). The tensors differ in name and in how the experts are
stacked (`llmfoundry.models.hf_moe`).

`to_hf_config` and `from_hf_config` map the configs. A transformers config that would make its
model compute something ours does not (another activation or head width, a RoPE variant) is
refused with the field named. Not carried, as they do not change what the
weights compute: dropout, `router_jitter_noise` (noise on the router's input in training; an
imported model trains without it), token ids (the tokenizer says which ids it uses) and our
`z_loss_weight` (transformers' Mixtral has no z-loss; an export drops it). The aux loss weight
is carried both ways (`router_aux_loss_coef`); `output_router_logits`, transformers' switch for
adding it to its own training loss (false in the released configs, an inference default), is
not: our training always adds aux_loss_weight times the load-balancing loss
(model.aux_loss_weight=0 for none).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from llmfoundry.models import hf_decoder, hf_moe
from llmfoundry.models.hf_folder import load_hf_weights, read_hf_config, save_hf_folder
from llmfoundry.models.hf_lib import transformers
from llmfoundry.models.mixtral.config import MixtralConfig
from llmfoundry.models.mixtral.model import MixtralForCausalLM

# The config.json sizes an import divides by or allocates from (checked positive first).
HF_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "num_local_experts",
    "num_experts_per_tok",
    "vocab_size",
    "max_position_embeddings",
)
BLOCK = hf_moe.BLOCK


def to_hf_config(cfg: MixtralConfig) -> transformers.MixtralConfig:
    """The transformers config for `cfg` (every MixtralConfig is representable)."""
    return transformers.MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.expert_hidden,
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
        sliding_window=cfg.sliding_window,
        num_local_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        router_aux_loss_coef=cfg.aux_loss_weight,
        router_jitter_noise=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )


def from_hf_config(hf: transformers.PretrainedConfig) -> MixtralConfig:
    """Our config for a transformers Mixtral config; UserError (a ValueError) naming what we
    cannot represent."""
    unsupported = []
    if (model_type := getattr(hf, "model_type", None)) != "mixtral":
        unsupported.append(f"model_type={model_type!r} (only 'mixtral')")
    head_dim = hf.hidden_size // hf.num_attention_heads
    checks = [
        ("hidden_act", hf.hidden_act, "silu"),
        ("head_dim", getattr(hf, "head_dim", None) or head_dim, head_dim),
    ]
    unsupported += hf_decoder.mismatches(checks)
    theta = hf_decoder.rope_theta(hf, unsupported, default=None)
    hf_decoder.refuse("Mixtral", unsupported)
    return MixtralConfig(
        d_model=hf.hidden_size,
        n_heads=hf.num_attention_heads,
        n_layers=hf.num_hidden_layers,
        n_kv_heads=hf.num_key_value_heads,
        n_experts=hf.num_local_experts,
        top_k=hf.num_experts_per_tok,
        expert_hidden=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=theta,
        rms_norm_eps=hf.rms_norm_eps,
        sliding_window=hf.sliding_window,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        aux_loss_weight=hf.router_aux_loss_coef,
        init_std=hf.initializer_range,
    )


def to_hf_model(model: MixtralForCausalLM, dtype: torch.dtype | None = None):
    """A transformers MixtralForCausalLM with `model`'s weights (`hf_moe.to_hf_model`)."""
    return hf_moe.to_hf_model(
        model, transformers.MixtralForCausalLM, to_hf_config(model.config), BLOCK, dtype
    )


def from_hf_model(hf_model) -> MixtralForCausalLM:
    """Our model holding the weights of a transformers MixtralForCausalLM."""
    config = from_hf_config(hf_model.config)
    return hf_moe.from_hf_model(hf_model, config, MixtralForCausalLM, BLOCK)


def export_to_hf(
    model: MixtralForCausalLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
    eos_token: str | None = None,
) -> Path:
    """Write `model` (and `tokenizer`) as a transformers MixtralForCausalLM folder
    (safetensors, the per-expert tensors of Mistral's release). `dtype` casts the exported
    copy; `eos_token` (a token of `tokenizer`) becomes the tokenizer's and the model's EOS."""
    return save_hf_folder(to_hf_model(model, dtype), out_dir, tokenizer, eos_token)


def from_hf(hf_dir: str | Path) -> MixtralForCausalLM:
    """The transformers Mixtral folder `hf_dir` (config.json + weights) as our model, float32."""
    optional = ("num_key_value_heads", "head_dim", "sliding_window")
    hf_config = read_hf_config(hf_dir, HF_SIZES, optional_sizes=optional)
    from_hf_config(hf_config)  # refuse what we cannot represent before reading any weight
    hf_model = load_hf_weights(transformers.MixtralForCausalLM, hf_dir, hf_config)
    return from_hf_model(hf_model).eval()
