"""``meta.json``: what data prep records beside an MDS dataset it wrote (format, seq_len, dtype,
vocab_size, eos_id, the tokenizer copied beside it, each split's counts), and what training,
evaluation and the tools read back. This module is the one that knows the file's name and how
it is read and written; the writers (tokens_to_mds, instructions, passkey) say what is in it.

A meta.json is read from folders anyone may write (a shared disk, a bucket), so it is read with
a size bound and a malformed one is a one-line error naming it; it is written whole (a reader
sees the old file or the new one, never a part). A token file's ``.json`` sidecar is
text_to_tokens.py's (`sidecar_path`, `open_tokens`); the fields both carry are read here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import atomic_write, join_url

if TYPE_CHECKING:
    from llmfoundry.data.streaming.node import NodeShare

__all__ = [
    "META_FILE",
    "META_LIMIT",
    "bytes_per_token",
    "made_without_tokenizer",
    "meta_url",
    "read_meta",
    "remove_meta",
    "write_meta",
]

META_FILE = "meta.json"
META_LIMIT = 1 << 20  # bytes read at most: data prep writes a few hundred


def meta_url(folder: str) -> str:
    """Where the meta.json of the dataset at ``folder`` (a path or URL) is."""
    return join_url(folder, META_FILE)


def read_meta(
    folder: str | None,
    storage_options: Mapping[str, Any] | None = None,
    node: NodeShare | None = None,
) -> dict[str, Any] | None:
    """The meta.json of the dataset at ``folder``, or None when there is none (data not from
    data prep); fetched by the machine's local rank 0 when ``node`` is given (streaming/node.py).
    A file past `META_LIMIT` bytes, or not a JSON object, is a `UserError` naming it."""
    if folder is None:
        return None
    url = meta_url(folder)

    def fetch() -> bytes:
        return storage.read_small(url, META_LIMIT, **(storage_options or {}))

    try:
        data = node.get(META_FILE, fetch, url) if node is not None else fetch()
    except FileNotFoundError:
        return None
    try:
        meta = json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        meta = err
    if not isinstance(meta, dict):
        why = f"not JSON ({meta})" if isinstance(meta, Exception) else "not a JSON object"
        raise UserError(
            f"{url} is {why}: data prep writes it last, so the dataset is incomplete or the file "
            "was changed; rewrite the data with its data_prep script (--overwrite)"
        )
    return meta


def write_meta(folder: str, meta: Mapping[str, Any]) -> None:
    """Write the meta.json of the dataset at ``folder`` whole: on this machine through a
    temporary file renamed over it, on an object store as one upload (an object is replaced
    whole)."""
    text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
    url = meta_url(folder)
    if storage.is_local(url):
        atomic_write(storage.local_path(url), text)
    else:
        fs, path = storage.url_to_fs(url)
        fs.pipe_file(path, text.encode())


def remove_meta(folder: str) -> None:
    """Remove the dataset's meta.json, if any: before its splits are rewritten, so that no
    reader takes half-written splits for the ones it described."""
    fs, path = storage.url_to_fs(meta_url(folder))
    if fs.exists(path):
        fs.rm(path)


def made_without_tokenizer(meta: Mapping[str, Any] | None) -> bool:
    """Whether the data says it has no tokenizer: token files made elsewhere (nanoGPT's
    ``train.bin``, adopted or read bare) and MDS converted from them record ``tokenizer: null``.
    Unknown (no record, or data not from data prep) is not "without"."""
    return meta is not None and "tokenizer" in meta and meta["tokenizer"] is None


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
