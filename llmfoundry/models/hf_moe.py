"""transformers' layout of a mixture-of-experts decoder (MixtralForCausalLM, Qwen3MoeForCausalLM),
shared by those families' HF adapters: the names of its tensors, its fused expert weights, and
the copy of a model into transformers' class and back.

transformers 5 holds the experts of a block as two stacked tensors, `mlp.experts.gate_up_proj`
[E, 2 * hidden, d] (the gate rows first: its forward chunks the product into gate, up) and
`mlp.experts.down_proj` [E, d, hidden]; ours are three (`ffn.experts.w_gate`, `w_up` [E, hidden,
d], `w_down` [E, d, hidden]), so gate_up is split and joined here, the rest only renamed. The
router is `mlp.gate.weight` [E, d] there, `ffn.router.gate.weight` here. A saved folder holds
the per-expert tensors of the released checkpoints (`experts.N.w1`..., Qwen's
`experts.N.gate_proj`...): transformers converts them on load and back on save, so our import
and export go through its model class and never read those names.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from llmfoundry.models.hf_lib import transformers
from llmfoundry.utils.errors import UserError

_TOP = {
    "transformer.wte.weight": "model.embed_tokens.weight",
    "transformer.norm_f.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Block tensors that only change name, ours -> transformers' (within `layers.N.`).
BLOCK = {
    "norm_1.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.out_proj.weight": "self_attn.o_proj.weight",
    "norm_2.weight": "post_attention_layernorm.weight",
    "ffn.router.gate.weight": "mlp.gate.weight",
    "ffn.experts.w_down": "mlp.experts.down_proj",
}
# Qwen3's per-head query and key norms.
QK_NORMS = {
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
}
_GATE, _UP, _GATE_UP = "ffn.experts.w_gate", "ffn.experts.w_up", "mlp.experts.gate_up_proj"
_OURS = re.compile(r"transformer\.blocks\.(\d+)\.(.+)")
_THEIRS = re.compile(r"model\.layers\.(\d+)\.(.+)")


def to_hf_state_dict(
    state: Mapping[str, torch.Tensor], block: Mapping[str, str], tied: bool
) -> dict[str, torch.Tensor]:
    """Our state dict with transformers' names and fused experts (`block`: the renamed block
    tensors, `BLOCK` and the family's own). Renamed tensors are the same tensors; gate_up is a
    new one."""
    out: dict[str, torch.Tensor] = {}
    gates: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in _TOP:
            out[_TOP[name]] = tensor
            continue
        match = _OURS.fullmatch(name)
        if match is None or match[2] not in (*block, _GATE, _UP):
            raise ValueError(f"{name!r} has no place in transformers' MoE decoder layout")
        if match[2] in block:
            out[f"model.layers.{match[1]}.{block[match[2]]}"] = tensor
        else:
            gates[name] = tensor
    for name in [n for n in gates if n.endswith(_GATE)]:
        index = _OURS.fullmatch(name)[1]
        up = gates[name.removesuffix(_GATE) + _UP]
        out[f"model.layers.{index}.{_GATE_UP}"] = torch.cat([gates[name], up], dim=1)
    if tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def from_hf_state_dict(
    state: Mapping[str, torch.Tensor], block: Mapping[str, str], tied: bool, what: str
) -> dict[str, torch.Tensor]:
    """A transformers MoE decoder's state dict (`what`: its class, for the message) with our
    names, gate_up split into contiguous gate and up. With a tied head transformers'
    `lm_head.weight` is the embedding again and is dropped; an untied model needs it."""
    back = {theirs: ours for ours, theirs in (*_TOP.items(), *block.items())}
    state = dict(state)
    if tied:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise UserError(
            f"the transformers {what} state dict has no lm_head.weight but its config is "
            "untied (tie_word_embeddings=false)"
        )
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _THEIRS.fullmatch(name)
        if name in back:
            out[back[name]] = tensor
        elif match and match[2] in back:
            out[f"transformer.blocks.{match[1]}.{back[match[2]]}"] = tensor
        elif match and match[2] == _GATE_UP:
            gate, up = tensor.chunk(2, dim=1)
            out[f"transformer.blocks.{match[1]}.{_GATE}"] = gate.contiguous()
            out[f"transformer.blocks.{match[1]}.{_UP}"] = up.contiguous()
        else:
            raise UserError(
                f"{name!r} is not a tensor of a transformers {what} that we can import "
                "(biases, a dense layer, a shared expert, or another architecture?)"
            )
    return out


def to_hf_model(
    model: nn.Module,
    hf_class: type[transformers.PreTrainedModel],
    hf_config: transformers.PretrainedConfig,
    block: Mapping[str, str],
    dtype: torch.dtype | None = None,
) -> transformers.PreTrainedModel:
    """`hf_class` with `model`'s weights: its CPU tensors themselves where they only change
    name (no second copy of a large model), cast copies when `dtype` differs."""
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
    hf_model.load_state_dict(to_hf_state_dict(state, block, tied), strict=True, assign=True)
    if tied:
        hf_model.tie_weights()
    # Its rotary frequencies are a non-persistent buffer, which the load leaves on meta.
    hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(hf_model.config)
    return hf_model.eval()


def from_hf_model(
    hf_model: transformers.PreTrainedModel,
    config: Any,
    model_class: type[nn.Module],
    block: Mapping[str, str],
) -> nn.Module:
    """`model_class` of `config` (our config of `hf_model`'s) holding the weights of the
    transformers model `hf_model` (renamed tensors themselves, the split experts copies)."""
    model = model_class(dataclasses.replace(config, init_device="meta"))
    state = from_hf_state_dict(
        hf_model.state_dict(), block, config.tie_word_embeddings, type(hf_model).__name__
    )
    model.load_state_dict(state, strict=True, assign=True)
    model.config = config  # built on meta only to skip the init; the weights are real now
    return model


def rope_theta(hf: transformers.PretrainedConfig, unsupported: list[str]) -> float | None:
    """The RoPE base of `hf`, appending to `unsupported` any RoPE variant ours does not compute
    (scaled frequencies, a partial rotation)."""
    rope = dict(hf.rope_parameters or {})
    if (kind := rope.get("rope_type", "default")) != "default":
        unsupported.append(f"rope_parameters.rope_type={kind!r} (supported: 'default')")
    if (partial := rope.get("partial_rotary_factor", 1.0)) != 1.0:
        unsupported.append(f"rope_parameters.partial_rotary_factor={partial!r} (supported: 1.0)")
    return rope.get("rope_theta")


def refuse(what: str, unsupported: list[str]) -> None:
    """The one-line refusal of a transformers config ours would misread."""
    if unsupported:
        raise UserError(
            f"cannot import this transformers {what} config, which sets: " + "; ".join(unsupported)
        )
