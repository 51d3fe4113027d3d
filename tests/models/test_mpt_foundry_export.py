"""Exports in llm-foundry's MPT layout (what its convert_composer_to_hf.py and hf_checkpointer
write, less their remote code) for the MPTs transformers' MptForCausalLM cannot hold: the
config inverse (`mpt_config_to_foundry`) round trips exactly, and each llm-foundry fixture model
exports to the fixture's own folder (config keys and values, weight names and values) and reads
back with llm-foundry's logits. tests/fixtures/foundry/check_export.sh loads these exports with
the real llm-foundry (by hand)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmfoundry.checkpoint.pretrained import read_pretrained
from llmfoundry.models.hf_folder import hf_tokenizer
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.foundry import (
    RUNTIME_FIELDS,
    mpt_config_from_foundry,
    mpt_config_to_foundry,
)
from llmfoundry.models.mpt.hf import export_layout, export_to_hf, from_hf
from llmfoundry.utils.errors import UserError
from tests.utils.test_entry_points import main_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "foundry"
SHAPES = ("alibi", "learned-pos", "gqa-rope", "variants")
# config.json keys where our export may differ from llm-foundry's own folder, and why:
ALLOWED_DIFFERENCES = {
    "auto_map": "theirs names its flattened remote code; we ship none",
    "transformers_version": "the transformers that wrote it",
    "eos_token_id": "ours records the tokenizer's EOS (a transformers key the model never reads)",
}
# llm-foundry omits tie_word_embeddings at its default (true); we always write it.
THEIR_OMITTED_DEFAULTS = {"tie_word_embeddings": True}

POSITIONS = [
    dict(alibi=True),
    dict(alibi=True, alibi_bias_max=4),
    dict(alibi=False),  # learned positions
    dict(alibi=False, rope=True, rope_theta=500000.0),
    dict(alibi=False, rope=True, rope_linear_scaling=2.0),
]
ATTENTION = [
    dict(),
    dict(kv_n_heads=1),
    dict(kv_n_heads=2, qk_ln=True, clip_qkv=6.0, softmax_scale=0.3),
    dict(sliding_window=1, attn_pdrop=0.1),
    dict(sliding_window=5),
]
LAYERS = [
    dict(),
    dict(no_bias=False, low_precision_layernorm=True),
    dict(norm_type="rmsnorm", ffn_type="glu", ffn_act="silu", tie_word_embeddings=False),
    dict(norm_type="rmsnorm", low_precision_layernorm=True, ffn_act="gelu_tanh"),
    dict(ffn_type="glu", ffn_act="relu", expansion_ratio=3, init_std=0.02),
    dict(no_bias=False, resid_pdrop=0.1, emb_pdrop=0.05, init_std=0.5),
]


def configs() -> list[MPTConfig]:
    return [
        MPTConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=100, **a, **b, **c)
        for a, b, c in itertools.product(POSITIONS, ATTENTION, LAYERS)
    ]


def test_ours_to_theirs_to_ours_is_exact():
    for cfg in configs():  # 150 configs
        theirs = json.loads(json.dumps(mpt_config_to_foundry(cfg)))  # as config.json holds it
        back = mpt_config_from_foundry(theirs, where="config.json")
        expected = dataclasses.asdict(
            dataclasses.replace(cfg, **{f: getattr(MPTConfig, f) for f in RUNTIME_FIELDS})
        )
        assert back.pop("_target_") == "llmfoundry.models.mpt.MPTConfig"
        assert dataclasses.asdict(MPTConfig(**back)) == expected, cfg


def test_runtime_fields_are_not_the_models():
    cfg = MPTConfig(d_model=64, n_heads=4, n_layers=1, attn_impl="torch", compile=True)
    assert mpt_config_to_foundry(cfg) == mpt_config_to_foundry(
        dataclasses.replace(cfg, attn_impl="sdpa", compile=False, init_device="meta")
    )
    assert mpt_config_to_foundry(cfg)["attn_config"]["attn_impl"] == "torch"


def test_what_neither_layout_holds_is_refused():
    cfg = MPTConfig(d_model=64, n_heads=4, n_layers=1, infini=dict(segment_len=8))
    with pytest.raises(UserError, match=r"^model\.infini: neither llm-foundry's MPT"):
        export_layout(cfg)


def test_layout_choice():
    transformers_holds = MPTConfig(d_model=64, n_heads=4, n_layers=1)
    foundry_default = MPTConfig(d_model=64, n_heads=4, n_layers=1, alibi=False, no_bias=False)
    assert export_layout(transformers_holds) == "transformers"  # today's behaviour
    assert export_layout(transformers_holds, "foundry") == "foundry"
    assert export_layout(foundry_default) == "foundry"
    with pytest.raises(UserError, match=r"no_bias=false.*--layout foundry"):
        export_layout(foundry_default, "transformers")
    with pytest.raises(UserError, match=r"layout 'mpt': use one of auto, transformers, foundry"):
        export_layout(foundry_default, "mpt")


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("shape", SHAPES)
def test_fixture_models_export_as_llm_foundrys_own_folder(shape, tmp_path):
    """Each llm-foundry fixture model, read from its Composer checkpoint and exported (auto:
    none of them fits transformers' class), is the folder llm-foundry's hf_checkpointer wrote:
    the same config on every key (ALLOWED_DIFFERENCES aside), the same weights under the same
    names, and it reads back with llm-foundry's reference logits."""
    theirs_dir = FIXTURES / shape / "hf-ba4"
    loaded = read_pretrained(str(FIXTURES / shape / "ep0-ba4-rank0.pt"))
    tokenizer = hf_tokenizer(str(FIXTURES / "tokenizer"))
    out = export_to_hf(loaded.model, tmp_path / "hf", tokenizer=tokenizer)

    ours, theirs = _config(out), {**THEIR_OMITTED_DEFAULTS, **_config(theirs_dir)}
    assert "auto_map" not in ours
    assert (ours["architectures"], ours["model_type"]) == (["MPTForCausalLM"], "mpt")
    assert sorted(set(ours) ^ set(theirs)) == sorted({"auto_map", "eos_token_id"})
    differ = sorted(k for k in set(ours) & set(theirs) if ours[k] != theirs[k])
    assert differ == ["transformers_version"]
    assert set(ALLOWED_DIFFERENCES) == {*differ, "auto_map", "eos_token_id"}

    weights, their_weights = (
        load_file(out / "model.safetensors"),
        load_file(theirs_dir / "model.safetensors"),
    )
    assert sorted(weights) == sorted(their_weights)
    assert all(torch.equal(weights[k], their_weights[k]) for k in weights)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file()

    reference = load_file(FIXTURES / shape / "reference-logits-ba4.safetensors")
    with torch.no_grad():
        logits = from_hf(out)(reference["input_ids"])
    error = (logits - reference["logits"]).abs().max() / reference["logits"].abs().max()
    assert error <= 1e-5


def test_export_script_layout_option(tmp_path, capsys):
    """export_hf.py exports llm-foundry's default MPT (biases, learned positions) in its layout,
    saying how to load it; --layout transformers refuses it in one line, naming the fix."""
    export = main_of("scripts/export_hf.py")
    checkpoint, tokenizer = FIXTURES / "learned-pos" / "ep0-ba4-rank0.pt", FIXTURES / "tokenizer"
    argv = [str(checkpoint), str(tmp_path / "hf"), "--tokenizer", str(tokenizer)]
    assert export([*argv, "--layout", "foundry"]) == 0
    printed = capsys.readouterr().out
    assert "logits relative error 0.00e+00" in printed
    assert "transformers loads it only with llm-foundry's code" in printed
    assert _config(tmp_path / "hf")["learned_pos_emb"] is True
    with pytest.raises(SystemExit) as exited:
        export([*argv[:1], str(tmp_path / "t"), *argv[2:], "--layout", "transformers"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "no_bias=false" in err and "--layout foundry" in err
    assert not (tmp_path / "t").exists()
