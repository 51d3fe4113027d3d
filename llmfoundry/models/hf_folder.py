"""A transformers model folder, for any family: writing one (the step every family's HF export
ends with), and how closely it computes what our model does (import and export check it)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer
from torch import nn

__all__ = ["logits_relative_error", "save_hf_folder"]


def save_hf_folder(
    hf_model: transformers.PreTrainedModel,
    out_dir: str | Path,
    tokenizer: Tokenizer | transformers.PreTrainedTokenizerBase | None = None,
    eos_token: str | None = None,
) -> Path:
    """Save `hf_model` (safetensors) and `tokenizer` to `out_dir`; the tokenizer's EOS (a raw
    `tokenizers.Tokenizer` gets `eos_token`) becomes the model's and its generation config's,
    so transformers' `generate` stops where ours does."""
    if isinstance(tokenizer, Tokenizer):
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, eos_token=eos_token
        )
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        hf_model.config.eos_token_id = tokenizer.eos_token_id
        hf_model.generation_config.eos_token_id = tokenizer.eos_token_id
    out_dir = Path(out_dir)
    hf_model.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def logits_relative_error(model: nn.Module, hf_dir: str | Path) -> float:
    """How exactly the transformers folder `hf_dir` computes what `model` does, in float32:
    max |ours - theirs| / max |theirs| over the logits of two rows of seeded random tokens."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    seq_len = min(64, model.config.max_seq_len)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, seq_len), generator=generator)
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    return float((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1e-30))
