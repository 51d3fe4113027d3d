"""Export an MPTForCausalLM to a Hugging Face transformers `MptForCausalLM` folder.

Our parameter names equal transformers', so the export is a state dict copy plus a config. What
transformers' MPT can represent is narrower than what we train, and a checkpoint it would silently
misread is worse than none, so `to_hf_config` refuses every feature it lacks:
- ALiBi only: it has no position table, and it builds ALiBi with alibi_bias_max=8 whatever its
  config says;
- no biases anywhere (its Linear and LayerNorm layers have none);
- MLP width fixed at 4 * d_model;
- no qk_ln.
Dropout rates are not exported (the folder gets transformers' defaults, 0): transformers' MPT
applies attn_pdrop to its MLP and residual too and ignores resid_pdrop and emb_pdrop, so copying
them would change what they mean, and its config types attn_pdrop as an int.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.model import LAYER_NORM_EPS, MPTForCausalLM


def to_hf_config(cfg: MPTConfig) -> transformers.MptConfig:
    """The transformers config for `cfg`; ValueError naming any field it cannot represent."""
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
    if unsupported:
        raise ValueError(
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
            "qk_ln": False,
            "alibi": True,
            "alibi_bias_max": 8,
        },
        tie_word_embeddings=True,
    )


def export_to_hf(
    model: MPTForCausalLM,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `model` (and `tokenizer`, if given) as a transformers MptForCausalLM folder.

    The weights go to safetensors; `transformers.MptForCausalLM.from_pretrained(out_dir)` loads
    them. `dtype` casts the exported copy (e.g. torch.bfloat16), leaving `model` untouched.
    """
    hf_config = to_hf_config(model.config)
    state = model.state_dict()
    if any(t.is_meta for t in state.values()):
        raise ValueError(
            "the model is on the meta device; materialise it (to_empty + init_weights, or load "
            "a checkpoint) before exporting"
        )
    state = {k: t.detach().to(device="cpu", dtype=dtype or t.dtype) for k, t in state.items()}
    state["lm_head.weight"] = state["transformer.wte.weight"]
    with torch.device("meta"):
        hf_model = transformers.MptForCausalLM(hf_config)
    hf_model.load_state_dict(state, strict=True, assign=True)
    hf_model.tie_weights()
    out_dir = Path(out_dir)
    hf_model.save_pretrained(out_dir, safe_serialization=True)
    if isinstance(tokenizer, Tokenizer):
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
