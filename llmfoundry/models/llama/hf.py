"""Convert between LlamaForCausalLM and transformers' `LlamaForCausalLM` (in memory or a folder).

The two compute the same function with the same tensors: our RoPE pairs dimension i with
i + head_dim / 2 as transformers' rotate_half does, so q_proj and k_proj copy without the
permutation that Meta's original (interleaved-pair) checkpoints need. Only the names differ
(`to_hf_name`), and a tied head is one tensor here but two keys there.

`to_hf_config` and `from_hf_config` map the configs. A transformers config that would make its
model compute something ours does not (biases, another activation or head dimension, a RoPE
type other than plain and Llama 3.1's "llama3") is refused with the field named: a checkpoint
silently misread is worse than none. Dropout rates and token ids are not carried: they do not
change what the weights compute, and the tokenizer (`export_to_hf`) says which ids it uses.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from tokenizers import Tokenizer

from llmfoundry.models.hf_folder import load_hf_weights, read_hf_config, save_hf_folder
from llmfoundry.models.hf_lib import transformers
from llmfoundry.models.llama.config import LlamaConfig, RopeScaling
from llmfoundry.models.llama.model import LlamaForCausalLM
from llmfoundry.utils.errors import UserError

# The config.json sizes an import divides by or allocates from (checked positive first).
HF_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
_TOP = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.norm_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK = {
    "norm_1.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "norm_2.weight": "post_attention_layernorm.weight",
    "ffn.gate_proj.weight": "mlp.gate_proj.weight",
    "ffn.up_proj.weight": "mlp.up_proj.weight",
    "ffn.down_proj.weight": "mlp.down_proj.weight",
}
_TOP_BACK = {hf: ours for ours, hf in _TOP.items()}
_BLOCK_BACK = {hf: ours for ours, hf in _BLOCK.items()}


def to_hf_name(name: str) -> str:
    """transformers' name for our parameter `name`; ValueError for one it does not have."""
    if name in _TOP:
        return _TOP[name]
    match = re.fullmatch(r"transformer\.blocks\.(\d+)\.(.+)", name)
    if match and match[2] in _BLOCK:
        return f"model.layers.{match[1]}.{_BLOCK[match[2]]}"
    raise ValueError(f"{name!r} is not a parameter of our LlamaForCausalLM")


def from_hf_name(name: str) -> str:
    """Our name for transformers' Llama parameter `name`; UserError (a ValueError) for one we do not have."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match and match[2] in _BLOCK_BACK:
        return f"transformer.blocks.{match[1]}.{_BLOCK_BACK[match[2]]}"
    raise UserError(
        f"{name!r} is not a parameter of a transformers LlamaForCausalLM that we can import "
        "(biases, or another architecture?)"
    )


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], cfg: LlamaConfig
) -> dict[str, torch.Tensor]:
    """Our state dict with transformers' names (the tensors themselves, not copies)."""
    out = {to_hf_name(name): tensor for name, tensor in state.items()}
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], cfg: LlamaConfig
) -> dict[str, torch.Tensor]:
    """A transformers Llama state dict with our names (the tensors themselves).

    With a tied head, transformers' `lm_head.weight` is the embedding again and is dropped;
    an untied model needs it.
    """
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise UserError(
            "the transformers state dict has no lm_head.weight but its config is untied "
            "(tie_word_embeddings=false)"
        )
    return {from_hf_name(name): tensor for name, tensor in state.items()}


def _rope_parameters(cfg: LlamaConfig) -> dict:
    params = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        params.update(
            rope_type="llama3",
            factor=float(s.factor),
            low_freq_factor=float(s.low_freq_factor),
            high_freq_factor=float(s.high_freq_factor),
            original_max_position_embeddings=s.original_max_seq_len,
        )
    return params


def to_hf_config(cfg: LlamaConfig) -> transformers.LlamaConfig:
    """The transformers config for `cfg` (every LlamaConfig is representable)."""
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=_rope_parameters(cfg),
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
    )


def from_hf_config(hf: transformers.PretrainedConfig) -> LlamaConfig:
    """Our config for a transformers Llama config; UserError (a ValueError) naming what we cannot represent."""
    unsupported = []
    if getattr(hf, "model_type", None) != "llama":
        unsupported.append(f"model_type={getattr(hf, 'model_type', None)!r} (only 'llama')")
    head_dim = hf.hidden_size // hf.num_attention_heads
    rope = dict(hf.rope_parameters or {})
    checks = [
        ("hidden_act", hf.hidden_act, "silu"),
        ("attention_bias", hf.attention_bias, False),
        ("mlp_bias", hf.mlp_bias, False),
        ("head_dim", getattr(hf, "head_dim", None) or head_dim, head_dim),
        ("rope_parameters.partial_rotary_factor", rope.get("partial_rotary_factor", 1.0), 1.0),
    ]
    for name, value, supported in checks:
        if value != supported:
            unsupported.append(f"{name}={value!r} (supported: {supported!r})")
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope_parameters.rope_type={rope_type!r} (supported: default, llama3)")
    if unsupported:
        raise UserError(
            "cannot import this transformers Llama config, which sets: " + "; ".join(unsupported)
        )
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_seq_len=rope["original_max_position_embeddings"],
        )
    return LlamaConfig(
        d_model=hf.hidden_size,
        n_heads=hf.num_attention_heads,
        n_layers=hf.num_hidden_layers,
        n_kv_heads=hf.num_key_value_heads,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        init_std=hf.initializer_range,
    )


def to_hf_model(model: LlamaForCausalLM, dtype: torch.dtype | None = None):
    """A transformers LlamaForCausalLM with `model`'s weights: its CPU tensors themselves (no
    second copy of a large model), cast copies when `dtype` differs."""
    state = model.state_dict()
    if any(t.is_meta for t in state.values()):
        raise ValueError(
            "the model is on the meta device; materialise it (to_empty + init_weights, or load "
            "a checkpoint) before exporting"
        )
    state = {k: t.detach().to(device="cpu", dtype=dtype or t.dtype) for k, t in state.items()}
    with torch.device("meta"):
        hf_model = transformers.LlamaForCausalLM(to_hf_config(model.config))
    hf_model.load_state_dict(to_hf_state_dict(state, model.config), strict=True, assign=True)
    if model.config.tie_word_embeddings:
        hf_model.tie_weights()
    # Its rotary frequencies are a non-persistent buffer, which the load leaves on meta.
    hf_model.model.rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(
        hf_model.config
    )
    return hf_model.eval()


def from_hf_model(hf_model) -> LlamaForCausalLM:
    """Our model holding (not copying) the weights of a transformers LlamaForCausalLM."""
    config = from_hf_config(hf_model.config)
    model = LlamaForCausalLM(dataclasses.replace(config, init_device="meta"))
    model.load_state_dict(
        from_hf_state_dict(hf_model.state_dict(), config), strict=True, assign=True
    )
    model.config = config  # built on meta only to skip the init; the weights are real now
    return model


def export_to_hf(
    model: LlamaForCausalLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
    eos_token: str | None = None,
) -> Path:
    """Write `model` (and `tokenizer`) as a transformers LlamaForCausalLM folder (safetensors).

    `dtype` casts the exported copy; `eos_token` (a token of `tokenizer`) becomes the
    tokenizer's and the model's EOS (`llmfoundry.models.hf_folder.save_hf_folder`).
    """
    hf_model = to_hf_model(model, dtype)
    return save_hf_folder(hf_model, out_dir, tokenizer, eos_token)


def from_hf(hf_dir: str | Path) -> LlamaForCausalLM:
    """The transformers Llama folder `hf_dir` (config.json + weights) as our model, in float32."""
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir, HF_SIZES, optional_sizes=("num_key_value_heads", "head_dim"))
    from_hf_config(hf_config)  # refuse what we cannot represent before reading any weight
    hf_model = load_hf_weights(transformers.LlamaForCausalLM, hf_dir, hf_config)
    return from_hf_model(hf_model).eval()
