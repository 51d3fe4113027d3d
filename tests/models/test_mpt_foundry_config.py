"""llm-foundry's MPT config dict as ours (llmfoundry/models/mpt/foundry.py): every key mapped,
accepted for a reason, or refused in one line naming it.

data/foundry_mpt_config_full.json is what the real llm-foundry 0.22.0 (transformers 4.51.3)
gives for ``MPTConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=100,
attn_config={'attn_impl': 'torch'}).to_dict()``: every key its config has, at its defaults, as a
Composer checkpoint carries it. HUB_MPT_7B is mosaicml/mpt-7b's config.json (older keys:
prefix_lm, verbose, tokenizer_name), shrunk to a tiny size.
"""

import copy
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from llmfoundry.models.families import config_from_foundry, config_from_record
from llmfoundry.models.mpt import MPTConfig
from llmfoundry.models.mpt.foundry import mpt_config_from_foundry
from llmfoundry.utils.errors import UserError

FULL = json.loads((Path(__file__).parent / "data" / "foundry_mpt_config_full.json").read_text())
HUB_MPT_7B = {
    "architectures": ["MPTForCausalLM"],
    "attn_config": {
        "alibi": True,
        "alibi_bias_max": 8,
        "attn_impl": "torch",
        "attn_pdrop": 0,
        "attn_type": "multihead_attention",
        "attn_uses_sequence_id": False,
        "clip_qkv": None,
        "prefix_lm": False,
        "qk_ln": False,
        "softmax_scale": None,
    },
    "auto_map": {
        "AutoConfig": "configuration_mpt.MPTConfig",
        "AutoModelForCausalLM": "modeling_mpt.MPTForCausalLM",
    },
    "d_model": 64,
    "emb_pdrop": 0,
    "embedding_fraction": 1.0,
    "expansion_ratio": 4,
    "init_config": {
        "emb_init_std": None,
        "emb_init_uniform_lim": None,
        "fan_mode": "fan_in",
        "init_div_is_residual": True,
        "init_gain": 0,
        "init_nonlinearity": "relu",
        "init_std": 0.02,
        "name": "kaiming_normal_",
        "verbose": 0,
    },
    "init_device": "cpu",
    "learned_pos_emb": True,
    "logit_scale": None,
    "max_seq_len": 128,
    "model_type": "mpt",
    "n_heads": 4,
    "n_layers": 2,
    "no_bias": True,
    "norm_type": "low_precision_layernorm",
    "resid_pdrop": 0,
    "tokenizer_name": "EleutherAI/gpt-neox-20b",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.28.1",
    "use_cache": False,
    "verbose": 0,
    "vocab_size": 256,
}
TINY = {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 32, "vocab_size": 100}


def with_key(base: dict, path: str, value) -> dict:
    """`base` with `path` (dotted: attn_config.rope) set to `value`."""
    cfg = copy.deepcopy(base)
    *parents, key = path.split(".")
    node = cfg
    for parent in parents:
        node = node.setdefault(parent, {})
    node[key] = value
    return cfg


def test_every_key_of_llm_foundrys_config_maps_to_what_it_computes():
    fields = mpt_config_from_foundry(FULL)
    # llm-foundry's defaults, not ours: learned positions, biases, low-precision LayerNorm.
    assert fields == {
        "_target_": "llmfoundry.models.mpt.MPTConfig",
        **TINY,
        "expansion_ratio": 4,
        "kv_n_heads": 4,
        "attn_impl": "sdpa",
        "alibi": False,
        "alibi_bias_max": 8,
        "learned_pos_emb": True,
        "no_bias": False,
        "low_precision_layernorm": True,
        "qk_ln": False,
        "clip_qkv": None,
        "softmax_scale": None,
        "sliding_window": None,
        "attn_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "emb_pdrop": 0.0,
        "init_std": None,
    }
    model = config_from_record(fields)  # what a checkpoint's recorded config builds
    assert isinstance(model, MPTConfig) and model.learned_pos_emb and not model.alibi


def test_absent_keys_take_llm_foundrys_defaults():
    fields = mpt_config_from_foundry(TINY)
    assert fields == mpt_config_from_foundry(FULL)


def test_hub_mpt_7b_layout():
    fields = mpt_config_from_foundry(HUB_MPT_7B, where="config.json")
    # ALiBi turns llm-foundry's learned positions off, though the file says true.
    assert fields["alibi"] and not fields["learned_pos_emb"]
    assert fields["no_bias"] and fields["init_std"] is None  # kaiming reads no init_std


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("attn_config.attn_type", "multiquery_attention", {"kv_n_heads": 1}),
        ("attn_config.kv_n_heads", 4, {"kv_n_heads": 4}),
        ("attn_config.sliding_window_size", 3, {"sliding_window": 4}),
        ("attn_config.qk_ln", True, {"qk_ln": True}),
        ("attn_config.clip_qkv", 6.0, {"clip_qkv": 6.0}),
        ("attn_config.softmax_scale", 0.5, {"softmax_scale": 0.5}),
        ("attn_config.alibi_bias_max", 16, {"alibi_bias_max": 16}),
        ("attn_config.attn_impl", "flash", {"attn_impl": "sdpa"}),
        ("attn_config.attn_pdrop", 0.1, {"attn_pdrop": 0.1}),
        ("norm_type", "layernorm", {"low_precision_layernorm": False}),
        ("no_bias", True, {"no_bias": True}),
        ("ffn_config.ffn_hidden_size", 128, {"expansion_ratio": 2}),
        ("expansion_ratio", 3, {"expansion_ratio": 3}),
        ("init_config", {"name": "baseline_", "init_std": 0.02}, {"init_std": 0.02}),
        ("init_device", "meta", {}),
        ("init_device", "mixed", {}),
        ("use_pad_tok_in_ffn", False, {}),
        ("attn_config.attn_uses_sequence_id", True, {}),
        ("attn_config.rope_theta", 500000, {}),
        ("loss_fn", "torch_crossentropy", {}),
        ("name", "mpt_causal_lm", {}),
        ("pad_token_id", 0, {}),
    ],
)
def test_mapped(path, value, expected):
    # attention_bias: what llm-foundry derived from no_bias=false; absent, it follows no_bias.
    base = {key: value for key, value in FULL.items() if key != "attention_bias"}
    fields = mpt_config_from_foundry(with_key(base, path, value))
    assert {key: fields[key] for key in expected} == expected


def test_grouped_query_attention():
    cfg = with_key(FULL, "attn_config.attn_type", "grouped_query_attention")
    assert mpt_config_from_foundry(with_key(cfg, "attn_config.kv_n_heads", 2))["kv_n_heads"] == 2


@pytest.mark.parametrize(
    ("path", "value", "instead"),
    [
        ("ffn_config.ffn_type", "te_ln_mlp", "ffn_type=mptmlp"),
        ("ffn_config.ffn_type", "mb_moe", "DBRX's MoE is not supported"),
        ("ffn_config.ffn_type", "mb_dmoe", "DBRX's MoE is not supported"),
        ("ffn_config.ffn_type", "mptglu", "not gated"),
        ("ffn_config.ffn_act_fn", {"name": "silu"}, "exact GELU"),
        ("ffn_config.ffn_hidden_size", 100, "whole multiple of d_model"),
        ("expansion_ratio", 1.5, "whole multiple of d_model"),
        ("fc_type", "te", "fc_type=torch"),
        ("attn_config.rope", True, "no rotary positions"),
        ("attn_config.qk_gn", True, "qk_ln"),
        ("attn_config.fused_qkv", False, "fused Wqkv"),
        ("attn_config.attn_type", "cross_attention", "grouped_query_attention"),
        ("attn_config.kv_n_heads", 2, "grouped_query_attention"),
        ("attn_config.attn_logit_softcapping", 30.0, "soft-cap"),
        ("attn_config.prefix_lm", True, "causally"),
        ("attn_config.attn_temperature_tuning", {"attn_scale": 0.1}, "attn_scale: 0"),
        ("norm_type", "rmsnorm", "layernorm"),
        ("norm_eps", 1e-6, "eps=1e-05"),
        ("embedding_fraction", 0.1, "full gradient"),
        ("logit_scale", "inv_sqrt_d_model", "does not scale"),
        ("tie_word_embeddings", False, "is the token embedding"),
        ("attention_bias", False, "no_bias=false"),
        ("head_dim", 8, "d_model // n_heads"),
        ("block_overrides", {"order": []}, "all alike"),
        ("final_logit_softcapping", 30.0, "soft-cap"),
        ("init_config.name", "xavier_normal_", "kaiming_normal_"),
        ("init_config.emb_init_std", 0.01, "embedding"),
        ("init_config.init_div_is_residual", False, "sqrt(2 * n_layers)"),
        ("init_config.init_div_is_residual", 1, "sqrt(2 * n_layers)"),  # divides by 1
        ("name", "hf_causal_lm", "MPT configs"),
        ("model_type", "llama", "MPT configs"),
        ("learnd_pos_emb", True, "not a key of llm-foundry's MPT config"),
        ("attn_config.alibi_bias", 8, "not a key of llm-foundry's MPT config"),
    ],
)
def test_refused_in_one_line_naming_the_key(path, value, instead):
    with pytest.raises(UserError) as err:
        mpt_config_from_foundry(with_key(FULL, path, value), where="run.yaml:model")
    message = str(err.value)
    assert f"run.yaml:model.{path}=" in message and instead in message
    assert "\n" not in message


def test_an_init_we_lack_is_accepted_when_the_weights_come_from_a_checkpoint():
    cfg = with_key(FULL, "init_config.name", "xavier_normal_")
    assert mpt_config_from_foundry(cfg, weights_loaded=True)["init_std"] is None


def test_a_yaml_model_block():
    block = OmegaConf.create(
        {"name": "mpt_causal_lm", **TINY, "attn_config": {"attn_impl": "flash", "alibi": True}}
    )
    fields = mpt_config_from_foundry(block)
    assert fields["alibi"] and fields["attn_impl"] == "sdpa"


def test_no_position_information_is_refused():
    cfg = with_key(FULL, "learned_pos_emb", False)
    with pytest.raises(UserError, match="no position information"):
        mpt_config_from_foundry(cfg)


def test_the_registry_gives_it_to_code_outside_the_family():
    """Code outside models/mpt reaches it through the registry (test_families checks imports)."""
    assert config_from_foundry(HUB_MPT_7B, where="x") == mpt_config_from_foundry(HUB_MPT_7B)


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        ({"d_model": "64"}, "run.yaml:model.d_model='64' is not supported: give a positive"),
        ({"expansion_ratio": None}, "run.yaml:model.expansion_ratio=None"),
        ({**TINY, "n_heads": 3}, "run.yaml:model: MPTConfig.d_model (64) must be divisible"),
        ({**TINY, "vocab_size": 0}, "run.yaml:model: MPTConfig.vocab_size must be a positive"),
    ],
)
def test_bad_sizes_are_one_line(cfg, expected):
    with pytest.raises(UserError) as err:
        mpt_config_from_foundry(cfg, where="run.yaml:model")
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
