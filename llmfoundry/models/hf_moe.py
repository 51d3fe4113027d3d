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
and export go through its model class and never read those names. Everything else (the
attention's names, the tied head, the copy into transformers' class and back, the RoPE and
refusal checks) is the dense decoders' (`llmfoundry.models.hf_decoder`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from llmfoundry.models import hf_decoder
from llmfoundry.models.hf_lib import transformers
from llmfoundry.utils.errors import UserError

# Block tensors that only change name, ours -> transformers' (within `layers.N.`); a family
# adds its own (Qwen3-MoE: hf_decoder.QK_NORMS).
BLOCK = {
    **hf_decoder.ATTENTION,
    "ffn.router.gate.weight": "mlp.gate.weight",
    "ffn.experts.w_down": "mlp.experts.down_proj",
}
_TOP = hf_decoder.TOP
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
    names, gate_up split into contiguous gate and up, the head as `hf_decoder.untie_head`
    leaves it."""
    back = {theirs: ours for ours, theirs in (*_TOP.items(), *block.items())}
    state = hf_decoder.untie_head(state, tied, what)
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
    """`hf_class` with `model`'s weights (`hf_decoder.to_hf_model`): its CPU tensors themselves
    where they only change name, the fused gate_up a new tensor."""

    def to_hf_state(state: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
        return to_hf_state_dict(state, block, tied)

    return hf_decoder.to_hf_model(model, hf_class, hf_config, dtype, to_hf_state)


def from_hf_model(
    hf_model: transformers.PreTrainedModel,
    config: Any,
    model_class: type[nn.Module],
    block: Mapping[str, str],
) -> nn.Module:
    """`model_class` of `config` (our config of `hf_model`'s) holding the weights of the
    transformers model `hf_model` (renamed tensors themselves, the split experts copies)."""

    def from_hf_state(state: Mapping[str, torch.Tensor], tied: bool, what: str):
        return from_hf_state_dict(state, block, tied, what)

    return hf_decoder.from_hf_model(hf_model, config, model_class, from_hf_state)
