"""Folders in the layout llm-foundry's convert_composer_to_hf.py writes (and mosaicml/mpt-* on the
Hub have), made from one of our models, for tests that run without llm-foundry: config.json is
llm-foundry 0.22's full MPTConfig dict (data/foundry_mpt_config_full.json) with the model's
values, `architectures: [MPTForCausalLM]` and an `auto_map` naming remote code, the weights a
torch.save state dict (pytorch_model.bin) or safetensors. The remote code files it names record
it when they run, which they never may (`remote_code_ran`). The folders the real llm-foundry
wrote are under tests/fixtures/foundry/ (parity: test_mpt_foundry_folders.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from llmfoundry.models.hf_lib import transformers
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

FULL = json.loads((Path(__file__).parent / "data" / "foundry_mpt_config_full.json").read_text())
AUTO_MAP = {
    "AutoConfig": "configuration_mpt.MPTConfig",
    "AutoModelForCausalLM": "modeling_mpt.MPTForCausalLM",
}
REMOTE_CODE = ("configuration_mpt.py", "modeling_mpt.py")


def foundry_config(config: MPTConfig) -> dict:
    """llm-foundry's config.json for a model of our `config`."""
    attn = {
        **FULL["attn_config"],
        "attn_impl": "flash",
        "attn_pdrop": config.attn_pdrop,
        "alibi": config.alibi,
        "alibi_bias_max": config.alibi_bias_max,
        "qk_ln": config.qk_ln,
        "clip_qkv": config.clip_qkv,
        "softmax_scale": config.softmax_scale,
        "sliding_window_size": -1 if config.sliding_window is None else config.sliding_window - 1,
    }
    if config.kv_n_heads != config.n_heads:
        attn.update(attn_type="grouped_query_attention", kv_n_heads=config.kv_n_heads)
    return {
        **FULL,
        **{key: getattr(config, key) for key in ("d_model", "n_heads", "n_layers", "vocab_size")},
        **{key: getattr(config, key) for key in ("max_seq_len", "expansion_ratio", "no_bias")},
        "attention_bias": not config.no_bias,
        "learned_pos_emb": config.learned_pos_emb,
        "norm_type": "low_precision_layernorm" if config.low_precision_layernorm else "layernorm",
        "resid_pdrop": config.resid_pdrop,
        "emb_pdrop": config.emb_pdrop,
        "attn_config": attn,
        "architectures": ["MPTForCausalLM"],
        "auto_map": AUTO_MAP,
        "torch_dtype": "float32",
    }


def write_foundry_folder(
    model: MPTForCausalLM,
    out: Path,
    weights: str = "pytorch_model.bin",
    tokenizer: Tokenizer | None = None,
    eos_token: str | None = None,
) -> Path:
    """`model` as llm-foundry's HF folder `out`, with `tokenizer`'s files if given."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(foundry_config(model.config), indent=2))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if weights.endswith(".bin"):
        torch.save(state, out / weights)
    else:
        save_file(state, out / weights, metadata={"format": "pt"})
    if tokenizer is not None:
        wrapped = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, eos_token=eos_token
        )
        wrapped.save_pretrained(out)
    for name in REMOTE_CODE:
        (out / name).write_text(f"open({str(out / (name + '.ran'))!r}, 'w').close()\n")
    return out


def remote_code_ran(folder: Path) -> bool:
    return any((folder / f"{name}.ran").exists() for name in REMOTE_CODE)


def random_model(seed: int = 0, **fields) -> MPTForCausalLM:
    """A tiny MPT with `fields`, its biases and norms moved off their init (so a bias or norm
    read from the wrong place shows in the logits)."""
    torch.manual_seed(seed)
    sizes = dict(d_model=32, n_heads=2, n_layers=2, max_seq_len=32, vocab_size=64)
    model = MPTForCausalLM(MPTConfig(**{**sizes, **fields})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "_ln" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    return model
