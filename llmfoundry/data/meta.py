"""What data prep records beside the tokens it wrote: a token file's ``.json`` sidecar and an
MDS dataset's ``meta.json`` (dtype, vocab_size, eos_id, the tokenizer written beside them)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmfoundry.utils.storage import open_url

if TYPE_CHECKING:
    from llmfoundry.data.streaming.node import NodeShare

__all__ = ["META_LIMIT", "bytes_per_token", "made_without_tokenizer", "read_meta"]

META_LIMIT = 1 << 20  # bytes of a dataset's meta.json read to tell its format


def made_without_tokenizer(meta: Mapping[str, Any] | None) -> bool:
    """Whether the data says it has no tokenizer: token files made elsewhere (nanoGPT's
    ``train.bin``, adopted or read bare) and MDS converted from them record ``tokenizer: null``.
    Unknown (no record, or data not from data prep) is not "without"."""
    return meta is not None and "tokenizer" in meta and meta["tokenizer"] is None


def read_meta(
    url: str | None, storage_options: Mapping[str, Any] | None, node: NodeShare | None
) -> dict | None:
    """The JSON at ``url``, or None when there is none (data not from data_prep); fetched by
    the machine's local rank 0 when ``node`` is given (streaming/node.py)."""
    if url is None:
        return None

    def fetch() -> bytes:
        with open_url(url, "rb", **(storage_options or {})) as f:
            return f.read()

    try:
        return json.loads(node.get("meta.json", fetch, url) if node is not None else fetch())
    except FileNotFoundError:
        return None


def bytes_per_token(meta: Mapping[str, Any], split: str) -> float | None:
    """Text bytes per token of ``split`` in a meta.json, or None where it is not recorded.

    Bits per byte = loss / ln 2 / bytes_per_token (a loss in nats per token). None for a split
    the dataset lacks, a tokenizer that is not byte-level, or meta.json written before this was
    recorded (rerun tokens_to_mds.py with --overwrite to add it).
    """
    info = (meta.get("splits") or {}).get(split) or {}
    tokens, text_bytes = info.get("tokens"), info.get("text_bytes")
    if not tokens or not text_bytes:
        return None
    return text_bytes / tokens
