"""Convert between our Qwen3 / Qwen2 models and transformers' `Qwen3ForCausalLM` /
`Qwen2ForCausalLM` (in memory or a folder).

The tensors and their names are the shared decoder's (`llmfoundry.models.hf_decoder`); what is
here is the config mapping each way. A transformers config that would make its model compute
something ours does not (another activation, biases Qwen3 does not have, a sliding window, a
RoPE type other than plain) is refused with the field named: a checkpoint silently misread is
worse than none. Dropout rates and token ids are not carried: they do not change what the
weights compute, and the tokenizer (`export_to_hf`) says which ids it uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import Tokenizer

from llmfoundry.models import hf_decoder
from llmfoundry.models.hf_config import read_config_json
from llmfoundry.models.hf_folder import load_hf_weights, read_hf_config, save_hf_folder
from llmfoundry.models.hf_lib import transformers
from llmfoundry.models.qwen3.config import Qwen2Config, Qwen3Config, QwenConfig
from llmfoundry.models.qwen3.model import Qwen2ForCausalLM, Qwen3ForCausalLM
from llmfoundry.utils.errors import UserError


class _Kind(NamedTuple):
    """Our classes of one transformers model_type, and the prefix of transformers' own."""

    config: type[QwenConfig]
    model: type[Qwen3ForCausalLM | Qwen2ForCausalLM]
    hf_prefix: str

    def hf_config_class(self) -> type:
        return getattr(transformers, f"{self.hf_prefix}Config")

    def hf_model_class(self) -> type:
        return getattr(transformers, f"{self.hf_prefix}ForCausalLM")


_KINDS = {
    "qwen3": _Kind(Qwen3Config, Qwen3ForCausalLM, "Qwen3"),
    "qwen2": _Kind(Qwen2Config, Qwen2ForCausalLM, "Qwen2"),
}


def _model_type(cfg: QwenConfig) -> str:
    return "qwen3" if isinstance(cfg, Qwen3Config) else "qwen2"


def to_hf_config(cfg: QwenConfig) -> transformers.PretrainedConfig:
    """The transformers config for `cfg` (every Qwen3Config and Qwen2Config is representable)."""
    own = {"head_dim": cfg.head_dim, "attention_bias": False} if _model_type(cfg) == "qwen3" else {}
    return _KINDS[_model_type(cfg)].hf_config_class()(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rope_theta)},
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=None,
        **own,
    )


def from_hf_config(hf: transformers.PretrainedConfig) -> QwenConfig:
    """Our config for a transformers Qwen3 or Qwen2 config; UserError (a ValueError) naming
    what we cannot represent."""
    model_type = getattr(hf, "model_type", None)
    if model_type not in _KINDS:
        raise UserError(f"model_type {model_type!r} is not a Qwen2 or Qwen3 config")
    unsupported = []
    checks = [
        ("hidden_act", hf.hidden_act, "silu"),
        ("use_sliding_window", hf.use_sliding_window, False),
    ]
    if model_type == "qwen3":
        checks.append(("attention_bias", hf.attention_bias, False))
    unsupported += hf_decoder.mismatches(checks)
    theta = hf_decoder.rope_theta(hf, unsupported)
    hf_decoder.refuse(model_type, unsupported)
    own = {"head_dim": hf.head_dim} if model_type == "qwen3" else {}
    return _KINDS[model_type].config(
        d_model=hf.hidden_size,
        n_heads=hf.num_attention_heads,
        n_layers=hf.num_hidden_layers,
        n_kv_heads=hf.num_key_value_heads,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        max_seq_len=hf.max_position_embeddings,
        rope_theta=theta,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        init_std=hf.initializer_range,
        **own,
    )


def to_hf_model(model: Qwen3ForCausalLM | Qwen2ForCausalLM, dtype: torch.dtype | None = None):
    """transformers' model of `model`'s type holding its weights (`hf_decoder.to_hf_model`)."""
    hf_class = _KINDS[_model_type(model.config)].hf_model_class()
    return hf_decoder.to_hf_model(model, hf_class, to_hf_config(model.config), dtype)


def from_hf_model(hf_model) -> Qwen3ForCausalLM | Qwen2ForCausalLM:
    """Our model holding (not copying) the weights of a transformers Qwen3 / Qwen2 model."""
    config = from_hf_config(hf_model.config)
    return hf_decoder.from_hf_model(hf_model, config, _KINDS[_model_type(config)].model)


def export_to_hf(
    model: Qwen3ForCausalLM | Qwen2ForCausalLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
    eos_token: str | None = None,
) -> Path:
    """Write `model` (and `tokenizer`) as a transformers Qwen3ForCausalLM / Qwen2ForCausalLM
    folder (safetensors). `dtype` casts the exported copy; `eos_token` (a token of
    `tokenizer`) becomes the tokenizer's and the model's EOS (`hf_folder.save_hf_folder`)."""
    return save_hf_folder(to_hf_model(model, dtype), out_dir, tokenizer, eos_token)


def from_hf(hf_dir: str | Path) -> Qwen3ForCausalLM | Qwen2ForCausalLM:
    """The transformers Qwen3 or Qwen2 folder `hf_dir` (config.json + weights) as our model,
    in float32."""
    hf_dir = Path(hf_dir)
    model_type = read_config_json(hf_dir).get("model_type")
    hf_config = read_hf_config(hf_dir, hf_decoder.HF_SIZES, optional_sizes=hf_decoder.HF_OPTIONAL)
    from_hf_config(hf_config)  # refuse what we cannot represent before reading any weight
    hf_model = load_hf_weights(_KINDS[model_type].hf_model_class(), hf_dir, hf_config)
    return from_hf_model(hf_model).eval()
