"""Writing a transformers model folder: the one step every family's HF export ends with."""

from __future__ import annotations

from pathlib import Path

import transformers
from tokenizers import Tokenizer

__all__ = ["save_hf_folder"]


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
