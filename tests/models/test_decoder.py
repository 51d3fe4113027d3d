"""The shared decoder (llmfoundry/models/layers/decoder.py): the state-dict keys every family
variant had before the families shared it (so old checkpoints and exports still map), its spec
checks, and the parameter groups of its norms."""

from __future__ import annotations

import pytest

from llmfoundry.models.layers.decoder import DecoderSpec
from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM, RopeScaling
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.optim.param_groups import NORM_BIAS_EMBEDDING, build_param_groups
from llmfoundry.utils.errors import UserError

MPT = dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=128, init_device="meta")
LLAMA = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, max_seq_len=32, vocab_size=128)

# Block 0's keys (block 1's are the same) between the embeddings and the final norm, as main's
# MPTModel and LlamaModel named them (b41fec2).
FUSED = ["attn.Wqkv.weight", "attn.out_proj.weight"]
SEPARATE = [f"attn.{p}_proj.weight" for p in ("q", "k", "v", "out")]
QK_LN = ["attn.q_ln.weight", "attn.k_ln.weight"]
MLP = ["ffn.up_proj.weight", "ffn.down_proj.weight"]
GLU = ["ffn.gate_proj.weight", *MLP]


def block(attn: list[str], ffn: list[str], norm_bias: bool = False) -> list[str]:
    norm = ["weight", "bias"] if norm_bias else ["weight"]
    return [
        *(f"norm_1.{p}" for p in norm), *attn, *(f"norm_2.{p}" for p in norm), *ffn,
    ]  # fmt: skip


WITH_BIAS_QK_LN = [
    "attn.Wqkv.weight", "attn.Wqkv.bias", "attn.q_ln.weight", "attn.q_ln.bias",
    "attn.k_ln.weight", "attn.k_ln.bias", "attn.out_proj.weight", "attn.out_proj.bias",
]  # fmt: skip
MLP_BIAS = ["ffn.up_proj.weight", "ffn.up_proj.bias", "ffn.down_proj.weight", "ffn.down_proj.bias"]

VARIANTS = {
    # name: (model, config overrides, embeddings, block 0, final norm and head)
    "mpt_alibi": (MPTForCausalLM, {}, ["wte"], block(FUSED, MLP), ["weight"]),
    "mpt_rope": (MPTForCausalLM, dict(alibi=False, rope=True), ["wte"], block(FUSED, MLP), ["weight"]),
    "mpt_learned": (MPTForCausalLM, dict(alibi=False), ["wte", "wpe"], block(FUSED, MLP), ["weight"]),
    "mpt_glu": (MPTForCausalLM, dict(ffn_type="glu"), ["wte"], block(FUSED, GLU), ["weight"]),
    "mpt_qk_ln": (
        MPTForCausalLM, dict(qk_ln=True, clip_qkv=1.0), ["wte"],
        block([FUSED[0], *QK_LN, FUSED[1]], MLP), ["weight"],
    ),
    "mpt_infini": (
        MPTForCausalLM, dict(infini=dict(segment_len=8)), ["wte"],
        block(["attn.gate", *FUSED], MLP), ["weight"],
    ),
    "mpt_untied_rmsnorm": (
        MPTForCausalLM, dict(tie_word_embeddings=False, norm_type="rmsnorm"), ["wte"],
        block(FUSED, MLP), ["weight", "lm_head"],
    ),
    "mpt_bias_qk_ln": (
        MPTForCausalLM, dict(no_bias=False, qk_ln=True), ["wte"],
        block(WITH_BIAS_QK_LN, MLP_BIAS, norm_bias=True), ["weight", "bias"],
    ),
    "llama_untied": (LlamaForCausalLM, {}, ["wte"], block(SEPARATE, GLU), ["weight", "lm_head"]),
    "llama_tied": (
        LlamaForCausalLM, dict(tie_word_embeddings=True), ["wte"], block(SEPARATE, GLU), ["weight"],
    ),
    "llama_rope_scaling": (
        LlamaForCausalLM, dict(rope_scaling=RopeScaling(factor=8.0)), ["wte"],
        block(SEPARATE, GLU), ["weight", "lm_head"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", VARIANTS)
def test_state_dict_keys_are_those_of_the_checkpoints_before_the_shared_decoder(name):
    model_class, overrides, embeddings, block_keys, tail = VARIANTS[name]
    if model_class is MPTForCausalLM:
        model = MPTForCausalLM(MPTConfig(**{**MPT, **overrides}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, **overrides}, init_device="meta"))
    head = ["lm_head.weight"] if "lm_head" in tail else []
    norm_f = [f"transformer.norm_f.{p}" for p in tail if p != "lm_head"]
    expected = [
        *(f"transformer.{e}.weight" for e in embeddings),
        *(f"transformer.blocks.{i}.{k}" for i in range(2) for k in block_keys),
        *norm_f,
        *head,
    ]
    assert list(model.state_dict()) == expected


def test_a_spec_refuses_an_unknown_choice_in_one_line():
    base = dict(
        d_model=8, n_layers=1, vocab_size=8, max_seq_len=8, n_heads=2, n_kv_heads=2, head_dim=4
    )
    with pytest.raises(UserError, match="DecoderSpec.positions must be one of"):
        DecoderSpec(**base, positions="sinusoidal")
    with pytest.raises(UserError, match="DecoderSpec.qk_norm must be one of"):
        DecoderSpec(**base, qk_norm="layer")


def test_every_norm_weight_is_in_the_group_without_weight_decay():
    """Llama's RMSNorm was its own module, which the parameter groups did not know as a norm:
    its weights were decayed. The shared decoder's norms are torch's norm classes."""
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    groups = build_param_groups(model)
    exempt = {id(p) for g in groups if g.get(NORM_BIAS_EMBEDDING) for p in g["params"]}
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(id(p) in exempt for p in norms)
