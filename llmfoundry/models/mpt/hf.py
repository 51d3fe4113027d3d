"""Convert between MPTForCausalLM and a Hugging Face transformers `MptForCausalLM` folder.

Our parameter names equal transformers', so both directions are a state dict copy plus a config
(`export_to_hf`, `from_hf`; the commands are scripts/export_hf.py and scripts/import_hf.py).
What transformers' MPT can represent is narrower than what we train, and a checkpoint it would
silently misread is worse than none, so `to_hf_config` refuses every feature it lacks:
- ALiBi only: it has no position table, and it builds ALiBi with alibi_bias_max=8 whatever its
  config says;
- no biases anywhere (its Linear and LayerNorm layers have none);
- MLP width fixed at 4 * d_model;
- no qk_ln, no grouped key/value heads (kv_n_heads), no sliding window, no infini-attention;
- no RoPE, no RMSNorm, no gated MLP or other activation than GELU, no untied output head.
`from_hf_config` likewise refuses a transformers config whose fields its model ignores or we lack.

Dropout rates are not exported (the folder gets transformers' defaults, 0): transformers' MPT
applies attn_pdrop to its MLP and residual too and ignores resid_pdrop and emb_pdrop, so copying
them would change what they mean, and its config types attn_pdrop as an int.

llm-foundry's own folders (its `convert_composer_to_hf.py` output, the mosaicml/mpt-* downloads:
``MPTForCausalLM`` with `auto_map` remote code) are `model_type: mpt` too, but their model is
llm-foundry's, which transformers runs only as that remote code, and their config's values make
transformers' MptConfig fail. `from_foundry_folder` reads them without either: config.json as
JSON through `mpt_config_from_foundry` (llm-foundry's keys, learned positions as well as ALiBi),
the weights from safetensors or weights-only pickles.

`export_to_hf` writes that layout too (`layout="foundry"`, `export_foundry_folder`) for the
models transformers' class cannot hold (biases, learned positions, RoPE, GQA, RMSNorm, GLU, an
untied head, qk_ln, sliding windows), and by default (`layout="auto"`) whenever
`to_hf_config` refuses: config.json with llm-foundry's MPTConfig keys
(`mpt_config_to_foundry`), `architectures: ["MPTForCausalLM"]`, our weights under their names
(the same as ours), generation_config.json and the tokenizer. No `auto_map`: we never ship
llm-foundry's code, so transformers needs it from llm-foundry to load the folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from llmfoundry.models.hf_config import CONFIG_FILE, check_sizes, read_config_json
from llmfoundry.models.hf_folder import (
    load_hf_weights,
    load_state,
    read_hf_config,
    read_hf_weights,
    save_hf_folder,
)
from llmfoundry.models.hf_lib import transformers
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.foundry import mpt_config_from_foundry, mpt_config_to_foundry
from llmfoundry.models.mpt.model import MPTForCausalLM
from llmfoundry.models.norms import LAYER_NORM_EPS
from llmfoundry.utils.errors import UserError

# The config.json sizes an import divides by or allocates from (checked positive first).
HF_SIZES = ("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len")
# Export layouts: transformers' MptForCausalLM, llm-foundry's MPTForCausalLM, or the first of
# the two that holds the model.
LAYOUTS = ("auto", "transformers", "foundry")
FOUNDRY_ARCHITECTURE = "MPTForCausalLM"
LAYOUT_NOTES = {
    "foundry": "llm-foundry's MPT layout (no remote code in it): transformers loads it only "
    "with llm-foundry's code (trust_remote_code with llm-foundry's modeling files added, or "
    "llmfoundry.models.mpt.MPTForCausalLM.from_pretrained with llm-foundry installed); our "
    "import_hf.py, generate.py and serve.py read it as it is"
}


def to_hf_config(cfg: MPTConfig) -> transformers.MptConfig:
    """The transformers config for `cfg`; UserError (a ValueError) naming any field it cannot represent."""
    unsupported = []
    if not cfg.alibi:
        unsupported.append("alibi=false (transformers' MPT always uses ALiBi; set alibi=true)")
    if cfg.alibi_bias_max != 8:
        unsupported.append(f"alibi_bias_max={cfg.alibi_bias_max} (transformers' MPT always uses 8)")
    if not cfg.no_bias:
        unsupported.append("no_bias=false (transformers' MPT has no biases; set no_bias=true)")
    if cfg.expansion_ratio != 4:
        unsupported.append(
            f"expansion_ratio={cfg.expansion_ratio} (transformers' MPT hard-codes 4)"
        )
    if cfg.qk_ln:
        unsupported.append("qk_ln=true (transformers' MPT has no q/k LayerNorm)")
    if cfg.kv_n_heads != cfg.n_heads:
        unsupported.append(
            f"kv_n_heads={cfg.kv_n_heads} (transformers' MPT has one key/value head per query head)"
        )
    if cfg.sliding_window is not None:
        unsupported.append(
            f"sliding_window={cfg.sliding_window} (transformers' MPT attends to every earlier token)"
        )
    if cfg.infini is not None:
        unsupported.append("infini (transformers' MPT has no infini-attention memory)")
    if cfg.rope:
        unsupported.append("rope=true (transformers' MPT has no rotary positions)")
    if cfg.norm_type != "layernorm":
        unsupported.append(f"norm_type={cfg.norm_type} (transformers' MPT uses LayerNorm)")
    if cfg.ffn_type != "mlp" or cfg.ffn_act != "gelu":
        unsupported.append(
            f"ffn_type={cfg.ffn_type}, ffn_act={cfg.ffn_act} (transformers' MPT has a GELU MLP)"
        )
    if not cfg.tie_word_embeddings:
        unsupported.append(
            "tie_word_embeddings=false (transformers' MPT ties its head to the embedding)"
        )
    if unsupported:
        raise UserError(
            "cannot export to transformers' MptForCausalLM, which does not support: "
            + "; ".join(unsupported)
        )
    return transformers.MptConfig(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        expansion_ratio=cfg.expansion_ratio,
        max_seq_len=cfg.max_seq_len,
        vocab_size=cfg.vocab_size,
        layer_norm_epsilon=LAYER_NORM_EPS,
        learned_pos_emb=False,
        no_bias=True,
        attn_config={
            "attn_impl": "torch",
            "clip_qkv": cfg.clip_qkv,
            "softmax_scale": cfg.softmax_scale,
            "qk_ln": False,
            "alibi": True,
            "alibi_bias_max": 8,
        },
        tie_word_embeddings=True,
    )


def export_layout(cfg: MPTConfig, layout: str = "auto") -> str:
    """The layout ("transformers" or "foundry") an export of `cfg` writes for `layout`; refuses
    (UserError, naming the fields) a layout that cannot hold the model, before any work."""
    if layout not in LAYOUTS:
        raise UserError(f"layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    if layout != "foundry":
        try:
            to_hf_config(cfg)
            return "transformers"
        except UserError as err:
            if layout == "transformers":
                raise UserError(f"{err}; --layout foundry (llm-foundry's MPT) holds it") from None
    mpt_config_to_foundry(cfg)  # refuses what llm-foundry's MPT lacks too
    return "foundry"


def _export_state(model: MPTForCausalLM, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`model`'s weights on the CPU as `dtype` (None: as they are), refusing a meta model."""
    state = model.state_dict()
    if any(t.is_meta for t in state.values()):
        raise ValueError(
            "the model is on the meta device; materialise it (to_empty + init_weights, or load "
            "a checkpoint) before exporting"
        )
    return {k: t.detach().to(device="cpu", dtype=dtype or t.dtype) for k, t in state.items()}


def export_to_hf(
    model: MPTForCausalLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
    eos_token: str | None = None,
    layout: str = "auto",
) -> Path:
    """Write `model` (and `tokenizer`, if given) as a transformers MptForCausalLM folder, or in
    llm-foundry's layout (`export_layout` picks; `export_foundry_folder`).

    The weights go to safetensors; `transformers.AutoModelForCausalLM.from_pretrained(out_dir)`
    loads transformers' layout. `dtype` casts the exported copy (e.g. torch.bfloat16), leaving
    `model` untouched. `eos_token` (a token of `tokenizer`) becomes the tokenizer's and the
    model's EOS, so `generate` stops there.
    """
    if export_layout(model.config, layout) == "foundry":
        return export_foundry_folder(model, out_dir, tokenizer, dtype, eos_token)
    hf_config = to_hf_config(model.config)
    state = _export_state(model, dtype)
    state["lm_head.weight"] = state["transformer.wte.weight"]
    with torch.device("meta"):
        hf_model = transformers.MptForCausalLM(hf_config)
    hf_model.load_state_dict(state, strict=True, assign=True)
    hf_model.tie_weights()
    return save_hf_folder(hf_model, out_dir, tokenizer, eos_token)


def export_foundry_folder(
    model: MPTForCausalLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
    eos_token: str | None = None,
) -> Path:
    """Write `model` as llm-foundry's `convert_composer_to_hf.py` / `hf_checkpointer` lay out an
    MPT (config.json of its MPTConfig keys, model.safetensors under the same parameter names,
    generation_config.json, tokenizer files), less their `auto_map` and code (module docstring)."""
    config = mpt_config_to_foundry(model.config)
    state = _export_state(model, dtype)
    if isinstance(tokenizer, Tokenizer):
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, eos_token=eos_token
        )
    eos_id = None if tokenizer is None else tokenizer.eos_token_id
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype_name = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config_json = {
        **config,
        "architectures": [FOUNDRY_ARCHITECTURE],
        "model_type": "mpt",
        "torch_dtype": dtype_name,
        "transformers_version": transformers.__version__,
    }
    if eos_id is not None:
        config_json["eos_token_id"] = eos_id
    (out_dir / CONFIG_FILE).write_text(json.dumps(config_json, indent=2, sort_keys=True) + "\n")
    transformers.GenerationConfig(eos_token_id=eos_id).save_pretrained(out_dir)
    save_file(
        {k: t.contiguous() for k, t in state.items()},
        out_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def from_hf_config(hf: transformers.MptConfig) -> MPTConfig:
    """Our config for a transformers MPT config; UserError (a ValueError) naming what we cannot represent.

    Fields that transformers' model ignores (it always uses ALiBi with alibi_bias_max=8, an MLP
    of 4 * d_model, no biases, tied embeddings) are refused unless they say what it does, since
    the weights were then trained for something else. Dropout rates are not imported.
    """
    attn = hf.attn_config
    unsupported = []
    if getattr(hf, "model_type", None) != "mpt":
        unsupported.append(f"model_type={getattr(hf, 'model_type', None)!r} (only 'mpt')")
    checks = [
        ("attn_config.alibi", attn.alibi, True),
        ("attn_config.alibi_bias_max", attn.alibi_bias_max, 8),
        ("attn_config.qk_ln", attn.qk_ln, False),
        ("attn_config.prefix_lm", attn.prefix_lm, False),
        ("attn_config.attn_type", attn.attn_type, "multihead_attention"),
        ("no_bias", hf.no_bias, True),
        ("expansion_ratio", hf.expansion_ratio, 4),
        ("layer_norm_epsilon", hf.layer_norm_epsilon, LAYER_NORM_EPS),
        ("logit_scale", hf.logit_scale, None),
        ("tie_word_embeddings", hf.tie_word_embeddings, True),
    ]
    for name, value, supported in checks:
        if value != supported:
            unsupported.append(f"{name}={value!r} (supported: {supported!r})")
    if unsupported:
        raise UserError(
            "cannot import this transformers MPT config, which sets: " + "; ".join(unsupported)
        )
    return MPTConfig(
        d_model=hf.d_model,
        n_heads=hf.n_heads,
        n_layers=hf.n_layers,
        expansion_ratio=4,
        max_seq_len=hf.max_seq_len,
        vocab_size=hf.vocab_size,
        alibi=True,
        alibi_bias_max=8,
        no_bias=True,
        clip_qkv=attn.clip_qkv,
        softmax_scale=attn.softmax_scale,
    )


def is_foundry_folder(raw: dict) -> bool:
    """Whether config.json `raw` is llm-foundry's (its MPTForCausalLM, remote code), not
    transformers' MptForCausalLM."""
    return "auto_map" in raw or "MPTForCausalLM" in (raw.get("architectures") or ())


def from_foundry_folder(hf_dir: str | Path) -> MPTForCausalLM:
    """llm-foundry's MPT folder `hf_dir` as our model, in float32, running none of its code."""
    raw = read_config_json(hf_dir)
    check_sizes(hf_dir, raw, HF_SIZES)
    where = str(Path(hf_dir, CONFIG_FILE))
    fields = mpt_config_from_foundry(raw, where=where, weights_loaded=True)
    config = MPTConfig(**{k: v for k, v in fields.items() if k != "_target_"})
    state = read_hf_weights(hf_dir)
    head = None
    if config.tie_word_embeddings:  # if written at all, the embedding again
        head = state.pop("lm_head.weight", None)
    embedding = state.get("transformer.wte.weight")
    if head is not None and (embedding is None or not torch.equal(head, embedding)):
        raise UserError(
            f"{hf_dir}: lm_head.weight differs from the token embedding, though {where} ties "
            "them (tie_word_embeddings); export the folder again"
        )
    model = MPTForCausalLM(dataclasses.replace(config, init_device="meta"))
    load_state(model, {k: v.float() for k, v in state.items()}, f"{hf_dir}")
    model.config = config  # built on meta only to skip the init; the weights are real now
    return model.eval()


def reference_model(hf_dir: str | Path) -> MPTForCausalLM | None:
    """llm-foundry's folders: the model read from the folder (transformers could run theirs
    only as the folder's own code, which is never run); transformers' folders: None (its
    MptForCausalLM)."""
    return from_foundry_folder(hf_dir) if is_foundry_folder(read_config_json(hf_dir)) else None


def from_hf(hf_dir: str | Path) -> MPTForCausalLM:
    """The transformers MPT folder `hf_dir` (config.json + weights) as our model, in float32;
    llm-foundry's own layout through `from_foundry_folder`."""
    hf_dir = Path(hf_dir)
    if is_foundry_folder(read_config_json(hf_dir)):
        return from_foundry_folder(hf_dir)
    hf_config = read_hf_config(hf_dir, HF_SIZES)
    config = from_hf_config(hf_config)
    hf_model = load_hf_weights(transformers.MptForCausalLM, hf_dir, hf_config)
    state = {k: v for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    model = MPTForCausalLM(dataclasses.replace(config, init_device="meta"))
    model.load_state_dict(state, strict=True, assign=True)
    model.config = config  # built on meta only to skip the init; the weights are real now
    return model.eval()
