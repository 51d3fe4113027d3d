"""Convert between LlamaForCausalLM and transformers' `LlamaForCausalLM` (in memory or a folder).

The two compute the same function with the same tensors: our RoPE pairs dimension i with
i + head_dim / 2 as transformers' rotate_half does, so q_proj and k_proj copy without the
permutation that Meta's original (interleaved-pair) checkpoints need. Only the names differ,
and a tied head is one tensor here but two keys there: the shared decoder's
(`llmfoundry.models.hf_decoder`), as for Qwen; what is here is the config mapping each way.

`to_hf_config` and `from_hf_config` map the configs. A transformers config that would make its
model compute something ours does not (biases, another activation or head dimension, a RoPE
type other than plain and Llama 3.1's "llama3") is refused with the field named: a checkpoint
silently misread is worse than none. Dropout rates and token ids are not carried: they do not
change what the weights compute, and the tokenizer (`export_to_hf`) says which ids it uses.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from llmfoundry.models import hf_decoder
from llmfoundry.models.hf_folder import load_hf_weights, read_hf_config, save_hf_folder
from llmfoundry.models.hf_lib import transformers
from llmfoundry.models.llama.config import LlamaConfig, RopeScaling
from llmfoundry.models.llama.model import LlamaForCausalLM


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
    if (model_type := getattr(hf, "model_type", None)) != "llama":
        unsupported.append(f"model_type={model_type!r} (only 'llama')")
    head_dim = hf.hidden_size // hf.num_attention_heads
    checks = [
        ("hidden_act", hf.hidden_act, "silu"),
        ("attention_bias", hf.attention_bias, False),
        ("mlp_bias", hf.mlp_bias, False),
        ("head_dim", getattr(hf, "head_dim", None) or head_dim, head_dim),
    ]
    unsupported += hf_decoder.mismatches(checks)
    theta = hf_decoder.rope_theta(hf, unsupported, rope_types=("default", "llama3"))
    hf_decoder.refuse("Llama", unsupported)
    rope = dict(hf.rope_parameters or {})
    scaling = None
    if rope.get("rope_type") == "llama3":
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
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        init_std=hf.initializer_range,
    )


def to_hf_model(model: LlamaForCausalLM, dtype: torch.dtype | None = None):
    """A transformers LlamaForCausalLM holding `model`'s weights (`hf_decoder.to_hf_model`)."""
    return hf_decoder.to_hf_model(
        model, transformers.LlamaForCausalLM, to_hf_config(model.config), dtype
    )


def from_hf_model(hf_model) -> LlamaForCausalLM:
    """Our model holding (not copying) the weights of a transformers LlamaForCausalLM."""
    return hf_decoder.from_hf_model(hf_model, from_hf_config(hf_model.config), LlamaForCausalLM)


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
    return save_hf_folder(to_hf_model(model, dtype), out_dir, tokenizer, eos_token)


def from_hf(hf_dir: str | Path) -> LlamaForCausalLM:
    """The transformers Llama folder `hf_dir` (config.json + weights) as our model, in float32."""
    hf_dir = Path(hf_dir)
    hf_config = read_hf_config(hf_dir, hf_decoder.HF_SIZES, optional_sizes=hf_decoder.HF_OPTIONAL)
    from_hf_config(hf_config)  # refuse what we cannot represent before reading any weight
    hf_model = load_hf_weights(transformers.LlamaForCausalLM, hf_dir, hf_config)
    return from_hf_model(hf_model).eval()
