"""llm-foundry's `mpt_causal_lm` model keys as our MPT config's fields.

Their defaults (llmfoundry/models/mpt/configuration_mpt.py and utils/config_defaults.py) are
filled in first: learned positions, biases, no ALiBi, kaiming-normal init, fused QKV, LayerNorm
in low precision. A key whose value we cannot build is refused naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmfoundry.config.foundry.common import check_known, only, refuse

_SAME = ("d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size", "resid_pdrop", "emb_pdrop")
_ATTN_KEYS = {
    "attn_type",
    "attn_pdrop",
    "attn_impl",
    "qk_ln",
    "qk_gn",
    "fused_qkv",
    "clip_qkv",
    "softmax_scale",
    "attn_uses_sequence_id",
    "sliding_window_size",
    "attn_logit_softcapping",
    "alibi",
    "alibi_bias_max",
    "rope",
    "nope",
    "kv_n_heads",
    "kv_dim",
}
_INIT_DEFAULTS = {
    "name": "kaiming_normal_",
    "fan_mode": "fan_in",
    "init_nonlinearity": "relu",
    "init_div_is_residual": True,
    "emb_init_std": None,
    "emb_init_uniform_lim": None,
    "init_std": None,
    "init_gain": 0.0,
}
_MODEL_KEYS = {
    *_SAME,
    "expansion_ratio",
    "head_dim",
    "learned_pos_emb",
    "attn_config",
    "ffn_config",
    "init_device",
    "logit_scale",
    "no_bias",
    "attention_bias",
    "embedding_fraction",
    "norm_type",
    "norm_eps",
    "use_cache",
    "init_config",
    "fc_type",
    "tie_word_embeddings",
    "use_pad_tok_in_ffn",
    "block_overrides",
    "final_logit_softcapping",
    "loss_fn",
}


def mpt_fields(node: Mapping[str, Any], where: str = "model") -> dict[str, Any]:
    """Our MPT config's fields (conf/model_base/mpt.yaml) for llm-foundry model `node`."""
    node = dict(node)
    check_known(where, node, _MODEL_KEYS)
    fields: dict[str, Any] = {
        "d_model": 2048,
        "n_heads": 16,
        "n_layers": 24,
        "max_seq_len": 2048,
        "vocab_size": 50368,
        "resid_pdrop": 0.0,
        "emb_pdrop": 0.0,
    }
    fields.update({k: node[k] for k in _SAME if k in node})
    ratio = node.get("expansion_ratio", 4)
    if ratio != int(ratio):
        raise refuse(f"{where}.expansion_ratio", f"{ratio}: a whole number here")
    fields["expansion_ratio"] = int(ratio)
    if node.get("head_dim") not in (None, fields["d_model"] // fields["n_heads"]):
        raise refuse(f"{where}.head_dim", "heads are d_model / n_heads wide here; remove it")
    fields["learned_pos_emb"] = bool(node.get("learned_pos_emb", True))
    fields["no_bias"] = bool(node.get("no_bias", False))
    only(f"{where}.attention_bias", node.get("attention_bias"), None, "use no_bias")
    fields["low_precision_layernorm"] = _norm(where, node)
    init = node.get("init_device", "cpu")
    if init not in ("cpu", "meta", "mixed"):
        raise refuse(f"{where}.init_device", f"{init!r}: use cpu or meta")
    fields["init_device"] = "cpu" if init == "cpu" else "meta"
    fields.update(_attention(f"{where}.attn_config", dict(node.get("attn_config") or {}), fields))
    _ffn(f"{where}.ffn_config", dict(node.get("ffn_config") or {}))
    fields["init_std"] = _init(f"{where}.init_config", dict(node.get("init_config") or {}))
    for key, accepted in (
        ("logit_scale", None),
        ("embedding_fraction", 1.0),
        ("fc_type", "torch"),
        ("tie_word_embeddings", True),
        ("block_overrides", None),
        ("final_logit_softcapping", None),
    ):
        only(f"{where}.{key}", node.get(key, accepted), accepted, "the only MPT built here")
    return fields


def _norm(where: str, node: Mapping[str, Any]) -> bool:
    kind = node.get("norm_type", "low_precision_layernorm")
    if kind not in ("low_precision_layernorm", "layernorm"):
        raise refuse(f"{where}.norm_type", f"{kind!r}: MPT here uses LayerNorm")
    only(f"{where}.norm_eps", node.get("norm_eps", 1e-5), 1e-5, "LayerNorm eps is 1e-5 here")
    return kind == "low_precision_layernorm"


def _attention(where: str, attn: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    check_known(where, attn, _ATTN_KEYS)
    kind = attn.get("attn_type", "multihead_attention")
    kv_heads = {"multihead_attention": None, "multiquery_attention": 1}.get(kind, "gqa")
    if kind not in ("multihead_attention", "multiquery_attention", "grouped_query_attention"):
        raise refuse(f"{where}.attn_type", f"{kind!r}: multihead, multiquery or grouped_query")
    if kv_heads == "gqa":
        kv_heads = attn.get("kv_n_heads", fields["n_heads"])
    if attn.get("rope") or attn.get("nope"):
        key = "rope" if attn.get("rope") else "nope"
        raise refuse(f"{where}.{key}", "MPT here has ALiBi or learned positions; RoPE: our Llama")
    for key, accepted in (
        ("qk_gn", False),
        ("fused_qkv", True),
        ("attn_logit_softcapping", None),
        ("kv_dim", None),
    ):
        only(f"{where}.{key}", attn.get(key, accepted), accepted, "the only attention here")
    window = attn.get("sliding_window_size", -1)
    impl = attn.get("attn_impl", "flash")
    return {
        "attn_impl": "torch" if impl == "torch" else "sdpa",
        "attn_pdrop": attn.get("attn_pdrop", 0.0),
        "qk_ln": bool(attn.get("qk_ln", False)),
        "clip_qkv": attn.get("clip_qkv"),
        "softmax_scale": attn.get("softmax_scale"),
        "alibi": bool(attn.get("alibi", False)),
        "alibi_bias_max": attn.get("alibi_bias_max", 8),
        "kv_n_heads": kv_heads,
        # Theirs: a token sees itself and sliding_window_size tokens before it (-1: all).
        "sliding_window": None if window == -1 else int(window) + 1,
    }


def _ffn(where: str, ffn: dict[str, Any]) -> None:
    kind = ffn.get("ffn_type", "mptmlp")
    if kind in ("mb_moe", "mb_dmoe"):
        raise refuse(f"{where}.ffn_type", f"{kind!r}: mixture-of-experts (DBRX) is not supported")
    only(f"{where}.ffn_type", kind, "mptmlp", "MPT's MLP is the only FFN here")
    check_known(where, ffn, {"ffn_type", "ffn_act_fn"})
    act = ffn.get("ffn_act_fn") or {"name": "gelu", "approximate": "none"}
    only(f"{where}.ffn_act_fn", dict(act), {"name": "gelu", "approximate": "none"}, "GELU here")


def _init(where: str, init: dict[str, Any]) -> float | None:
    """Our init_std: null for MPT's kaiming-normal default, else the std of a normal init."""
    check_known(where, init, _INIT_DEFAULTS)
    values = {**_INIT_DEFAULTS, **init}
    std = None
    if values["name"] == "normal_":
        std = values["init_std"]
        if std is None:
            raise refuse(f"{where}.init_std", "name: normal_ needs init_std")
        values.update(name="kaiming_normal_", init_std=None)
    for key, default in _INIT_DEFAULTS.items():
        only(f"{where}.{key}", values[key], default, "MPT's default init or normal_ with init_std")
    return std
