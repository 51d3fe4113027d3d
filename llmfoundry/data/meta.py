"""What data prep records beside the tokens it wrote: a token file's ``.json`` sidecar and an
MDS dataset's ``meta.json`` (dtype, vocab_size, eos_id, the tokenizer written beside them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["made_without_tokenizer"]


def made_without_tokenizer(meta: Mapping[str, Any] | None) -> bool:
    """Whether the data says it has no tokenizer: token files made elsewhere (nanoGPT's
    ``train.bin``, adopted or read bare) and MDS converted from them record ``tokenizer: null``.
    Unknown (no record, or data not from data prep) is not "without"."""
    return meta is not None and "tokenizer" in meta and meta["tokenizer"] is None
