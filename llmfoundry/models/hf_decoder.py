"""Our shared decoder (models/layers/decoder.py, separate q/k/v) as transformers' Llama-style
causal LMs hold it, for any family whose transformers class names its tensors as Llama's does
(Llama, Qwen2, Qwen3; hf_moe.py adds the MoE families' experts on this): the names both ways,
the state dicts both ways, and the models both ways (`to_hf_model`, `from_hf_model`, each
holding the other's tensors, not copies). A family's
hf.py adds what is its own: its transformers class and the config mapping, which refuses what
our model would compute differently.

The tensors need no reshaping: our RoPE pairs dimension i with i + head_dim / 2 as
transformers' rotate_half does, and our q/k norms are per head over head_dim as Qwen3's. A tied
head is one tensor here and two keys there.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from llmfoundry.models.hf_lib import transformers
from llmfoundry.utils.errors import UserError

# The config.json sizes a dense import divides by or allocates from (checked positive first,
# the optional ones where given: `hf_folder.read_hf_config`).
HF_SIZES = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
HF_OPTIONAL = ("num_key_value_heads", "head_dim")
TOP = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.norm_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Block tensors (within `transformer.blocks.N.` / `model.layers.N.`), ours -> transformers',
# by part: every decoder's attention and norms, then what some families add.
ATTENTION = {
    "norm_1.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "norm_2.weight": "post_attention_layernorm.weight",
}
QKV_BIAS = {f"attn.{p}.bias": f"self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")}
QK_NORMS = {
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
GLU = {f"ffn.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
# A dense decoder's: what a config does not have (biases, q/k norms) its model does not hold.
BLOCK = {**ATTENTION, **QKV_BIAS, **QK_NORMS, **GLU}
StateMap = Callable[[Mapping[str, torch.Tensor], bool], dict[str, torch.Tensor]]
_TOP_BACK = {hf: ours for ours, hf in TOP.items()}
_BLOCK_BACK = {hf: ours for ours, hf in BLOCK.items()}


def to_hf_name(name: str) -> str:
    """transformers' name for our parameter `name`; ValueError for one it does not have."""
    if name in TOP:
        return TOP[name]
    match = re.fullmatch(r"transformer\.blocks\.(\d+)\.(.+)", name)
    if match and match[2] in BLOCK:
        return f"model.layers.{match[1]}.{BLOCK[match[2]]}"
    raise ValueError(f"{name!r} is not a parameter of a separate-qkv decoder")


def from_hf_name(name: str, what: str) -> str:
    """Our name for the parameter `name` of transformers' `what` (its class name); UserError
    for one our decoder does not have."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match and match[2] in _BLOCK_BACK:
        return f"transformer.blocks.{match[1]}.{_BLOCK_BACK[match[2]]}"
    raise UserError(f"{name!r} is not a parameter of a transformers {what} that we can import")


def to_hf_state_dict(state: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Our state dict with transformers' names (the tensors themselves, not copies); a `tied`
    head is the embedding again under lm_head.weight."""
    out = {to_hf_name(name): tensor for name, tensor in state.items()}
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def untie_head(state: Mapping[str, torch.Tensor], tied: bool, what: str) -> dict[str, torch.Tensor]:
    """transformers' `what` state dict without what our model does not hold: the rotary
    frequencies, and with a `tied` head lm_head.weight (the embedding again); an untied model
    needs it."""
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if tied:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise UserError(
            f"the transformers {what} state dict has no lm_head.weight but its config is "
            "untied (tie_word_embeddings=false)"
        )
    return state


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], tied: bool, what: str
) -> dict[str, torch.Tensor]:
    """transformers' `what` state dict with our names (the tensors themselves), its head as
    `untie_head` leaves it."""
    return {from_hf_name(name, what): t for name, t in untie_head(state, tied, what).items()}


def to_hf_model(
    model: nn.Module,
    hf_class: type,
    hf_config: Any,
    dtype: torch.dtype | None = None,
    to_hf_state: StateMap = to_hf_state_dict,
) -> Any:
    """A transformers `hf_class` of `hf_config` with `model`'s weights: its CPU tensors
    themselves (no second copy of a large model), cast copies when `dtype` differs.
    `to_hf_state(state, tied)` names them as `hf_class` does (a dense decoder's by default)."""
    state = model.state_dict()
    if any(t.is_meta for t in state.values()):
        raise UserError(
            "the model is on the meta device; materialise it (to_empty + init_weights, or load "
            "a checkpoint) before exporting"
        )
    state = {k: t.detach().to(device="cpu", dtype=dtype or t.dtype) for k, t in state.items()}
    tied = model.config.tie_word_embeddings
    with torch.device("meta"):
        hf_model = hf_class(hf_config)
    hf_model.load_state_dict(to_hf_state(state, tied), strict=True, assign=True)
    if tied:
        hf_model.tie_weights()
    # Its rotary frequencies are a non-persistent buffer, which the load leaves on meta.
    hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(hf_model.config)
    return hf_model.eval()


def from_hf_model(
    hf_model: Any,
    config: Any,
    model_class: type[nn.Module],
    from_hf_state: Callable[..., dict[str, torch.Tensor]] = from_hf_state_dict,
) -> nn.Module:
    """Our `model_class` of `config` (read from `hf_model.config`) holding, not copying, the
    weights of the transformers model `hf_model`; `from_hf_state(state, tied, what)` gives
    them our names (a dense decoder's by default)."""
    model = model_class(dataclasses.replace(config, init_device="meta"))
    state = from_hf_state(
        hf_model.state_dict(), config.tie_word_embeddings, type(hf_model).__name__
    )
    model.load_state_dict(state, strict=True, assign=True)
    model.config = config  # built on meta only to skip the init; the weights are real now
    return model


def rope_theta(
    hf: transformers.PretrainedConfig,
    unsupported: list[str],
    default: float | None = 10000.0,
    rope_types: tuple[str, ...] = ("default",),
) -> float | None:
    """The RoPE theta of transformers config `hf` (`default` where it states none); a RoPE type
    other than `rope_types` or a partial rotation, which our decoder would compute
    differently, is added to `unsupported`."""
    rope = dict(hf.rope_parameters or {})
    if (rope_type := rope.get("rope_type", "default")) not in rope_types:
        allowed = ", ".join(map(repr, rope_types))
        unsupported.append(f"rope_parameters.rope_type={rope_type!r} (supported: {allowed})")
    if (partial := rope.get("partial_rotary_factor", 1.0)) != 1.0:
        unsupported.append(f"rope_parameters.partial_rotary_factor={partial!r} (supported: 1.0)")
    return rope.get("rope_theta", default)


def mismatches(checks: Iterable[tuple[str, Any, Any]]) -> list[str]:
    """ "name=value (supported: ...)" for each (name, value, supported) of a transformers
    config whose value is not the one our decoder computes."""
    return [f"{name}={value!r} (supported: {ok!r})" for name, value, ok in checks if value != ok]


def refuse(what: str, unsupported: list[str]) -> None:
    """The one-line refusal of a transformers `what` config ours would misread."""
    if unsupported:
        raise UserError(
            f"cannot import this transformers {what} config, which sets: " + "; ".join(unsupported)
        )
