"""Token stream (memmap + sidecar) -> MDS rows of ``seq_len`` tokens, split train/val.

Layout of ``out`` (a local folder or fsspec URL)::

    out/train/index.json, out/train/shard.*.mds   rows [0, rows - val_rows)
    out/val/index.json,   out/val/shard.*.mds     the last val_rows rows (if any), or the rows
                                                  of a val token file of its own (val.bin)
    out/tokenizer.json                            copied from next to the token stream (or its
                                                  tokenizer.model / NAME.tiktoken)
    out/meta.json                                 seq_len, vocab_size, eos/bos ids, splits

Each row is column ``tokens`` encoded ``ndarray:uint16:L`` (or uint32 for large
vocabularies): fixed size, so a reader maps a whole shard as one ``[rows, L]`` array.
Validation rows are the stream's tail, contiguous, so no training row shares text with them
(apart from the one document that may straddle the boundary); a validation file of its own
(nanoGPT's ``val.bin``) is taken whole instead, and must share the main file's dtype,
vocabulary, EOS and tokenizer. meta.json is written last and
records the inputs, so a rerun with the same inputs is recognised and skipped. A token id the
tokenizer next to the stream does not have is refused before anything is written.

Each split in meta.json also records its ``tokens`` and the UTF-8 ``text_bytes`` they decode to
(special tokens such as EOS count nothing), so a loss per token converts to bits per byte, a
number that compares models with different tokenizers (:func:`llmfoundry.data.meta.bytes_per_token`). The bytes are
exact for a byte-level BPE (see ``tokenizer.token_byte_lengths``); for other tokenizers
``text_bytes`` is null.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.meta import write_meta
from llmfoundry.data.prep.adopt import check_token_ids, open_token_file
from llmfoundry.data.prep.reuse import previous_output, settings_fingerprint
from llmfoundry.data.prep.text_to_tokens import sidecar_path
from llmfoundry.tokenizers.tokenizer import prepare_tokenizer
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url

__all__ = ["MDS_META_FORMAT", "split_rows", "text_bytes", "tokens_to_mds"]

MDS_META_FORMAT = "llmfoundry.mds-tokens"
_CHUNK = 1 << 24  # tokens per pass over the stream: bounded memory for any stream length


def split_rows(rows: int, val_fraction: float = 0.0, val_rows: int | None = None) -> int:
    """Number of validation rows: ``val_rows`` if given, else ``val_fraction`` of ``rows``.

    A positive fraction always yields at least one row, and training always keeps one.
    """
    if val_rows is not None:
        if val_rows < 0:
            raise UserError(f"--val-rows must be >= 0, got {val_rows}")
        n_val = val_rows
    else:
        if not 0.0 <= val_fraction < 1.0:
            raise UserError(f"--val-fraction must be in [0, 1), got {val_fraction}")
        n_val = max(1, round(rows * val_fraction)) if val_fraction > 0 else 0
    if n_val >= rows:
        raise UserError(
            f"{n_val} validation rows leave no training rows out of {rows}; use fewer "
            "validation rows, a smaller --seq-len, or more text"
        )
    return n_val


class _Split(NamedTuple):
    """Rows ``[start, stop)`` of ``seq_len`` tokens of the token file at ``path``."""

    path: str | os.PathLike
    stream: np.ndarray
    source: dict[str, Any]
    start: int
    stop: int


def tokens_to_mds(
    tokens: str | os.PathLike,
    out: str,
    seq_len: int,
    *,
    val_tokens: str | os.PathLike | None = None,
    val_fraction: float = 0.0,
    val_rows: int | None = None,
    size_limit: int | str | None = 1 << 26,
    compression: str | None = None,
    hashes: tuple[str, ...] | list[str] = ("xxh64",),
    overwrite: bool = False,
    progress: bool = True,
    dtype: str | None = None,
    vocab_size: int | None = None,
    eos_id: int | None = None,
) -> dict[str, Any]:
    """Write the token stream at ``tokens`` as MDS under ``out``; return meta.json's content.

    The val split is the stream's tail (``val_fraction`` or ``val_rows``), or all of the token
    file ``val_tokens`` (nanoGPT's ``val.bin``), which must share the main file's dtype,
    vocabulary, EOS and tokenizer. Tokens after the last full row of each file are dropped
    (reported as ``dropped_tokens``). ``hashes`` default to xxh64 (fast): readers check
    downloads with it, and a cache can tell a rewritten dataset's shards from the ones it holds.
    A token file without a sidecar (made elsewhere) needs ``dtype`` and ``vocab_size``
    (adopt.py); without a tokenizer beside it, none is copied and ``text_bytes`` is null.
    """
    if seq_len < 1:
        raise UserError(f"--seq-len must be positive, got {seq_len}")
    facts = {"dtype": dtype, "vocab_size": vocab_size, "eos_id": eos_id}
    splits = _plan_splits(tokens, seq_len, val_tokens, val_fraction, val_rows, facts)
    stream, source, val = splits["train"].stream, splits["train"].source, splits["val"]
    out = str(out)
    settings = {
        "source": _source_id(tokens, source),
        "num_tokens": source["num_tokens"],
        "seq_len": seq_len,
        "val_rows": val.stop - val.start,
        "size_limit": size_limit,
        "compression": compression,
        "hashes": sorted(hashes),
        "version": 1,
    }
    if val_tokens is not None:  # absent otherwise: earlier outputs keep their fingerprint
        settings["val_source"] = _source_id(val_tokens, val.source)
    key = settings_fingerprint(settings)
    previous = previous_output(out, key, overwrite)
    if previous is not None:
        return {**previous, "reused": True}
    storage.probe_writable(
        str(out), "--out", "fix the storage credentials/endpoint or choose another --out"
    )
    fs, root = storage.url_to_fs(out)
    merged_index = join_url(root, "index.json")  # from mds_tools.py merge: stale once rewritten
    if overwrite and fs.exists(merged_index):
        fs.rm(merged_index)

    tok_src, tok_vocab, byte_lengths = None, None, None
    if source.get("tokenizer"):
        tok_src = Path(sidecar_path(tokens)).parent / source["tokenizer"]
        tokenizer = prepare_tokenizer(tok_src, require_eos=False)  # any kind text_to_tokens takes
        tok_vocab, byte_lengths = tokenizer.vocab_size, tokenizer.token_byte_lengths()
    for split in splits.values():
        _check_split_ids(split, seq_len, tok_vocab)
    written = _write_splits(
        splits, out, seq_len, byte_lengths, compression, hashes, size_limit, overwrite, progress
    )
    if "val" not in written and fs.exists(join_url(root, "val/index.json")):
        fs.rm(join_url(root, "val"), recursive=True)  # stale split from an earlier run

    if tok_src is not None:
        fs.put_file(str(tok_src), join_url(root, tok_src.name))
    elif fs.exists(join_url(root, "tokenizer.json")):
        fs.rm(join_url(root, "tokenizer.json"))  # an earlier run's, not this data's
    meta = {
        "format": MDS_META_FORMAT,
        "version": 1,
        "seq_len": seq_len,
        "dtype": stream.dtype.name,
        "column": "tokens",
        "encoding": _encoding(stream.dtype, seq_len),
        "vocab_size": source.get("vocab_size"),
        "eos_id": source.get("eos_id"),
        "bos_id": source.get("bos_id"),
        "tokenizer": tok_src.name if tok_src is not None else None,
        "splits": written,
        "dropped_tokens": sum(len(f.stream) % seq_len for f in _files(splits)),
        "source_tokens": str(tokens),
        "fingerprint": key,
    }
    write_meta(out, meta)
    return {**meta, "reused": False}


def _plan_splits(
    tokens: str | os.PathLike,
    seq_len: int,
    val_tokens: str | os.PathLike | None,
    val_fraction: float,
    val_rows: int | None,
    facts: Mapping[str, Any],
) -> dict[str, _Split]:
    """The train and val rows: the main file's head and tail, or all of the main file and all
    of ``val_tokens``. ``facts``: dtype, vocab_size, eos_id of files without a sidecar."""
    stream, source = open_token_file(tokens, **facts)
    rows = _full_rows(stream, seq_len, tokens)
    if val_tokens is None:
        n_val = split_rows(rows, val_fraction, val_rows)
        return {
            "train": _Split(tokens, stream, source, 0, rows - n_val),
            "val": _Split(tokens, stream, source, rows - n_val, rows),
        }
    if val_fraction or val_rows is not None:
        raise UserError(
            "--val-tokens is the validation split: leave out --val-fraction and --val-rows"
        )
    val_stream, val_source = open_token_file(val_tokens, **facts)
    _check_same_tokens(tokens, source, val_tokens, val_source)
    return {
        "train": _Split(tokens, stream, source, 0, rows),
        "val": _Split(
            val_tokens, val_stream, val_source, 0, _full_rows(val_stream, seq_len, val_tokens)
        ),
    }


def _files(splits: Mapping[str, _Split]) -> list[_Split]:
    """One split per token file the splits read (train and val may share one)."""
    return list({str(split.path): split for split in splits.values()}.values())


def _write_splits(
    splits: Mapping[str, _Split],
    out: str,
    seq_len: int,
    byte_lengths: np.ndarray | None,
    compression: str | None,
    hashes: tuple[str, ...] | list[str],
    size_limit: int | str | None,
    overwrite: bool,
    progress: bool,
) -> dict[str, dict[str, Any]]:
    """Write each non-empty split as MDS under ``out/<name>``; return meta.json's split records
    (rows, shards, tokens, text_bytes, the token file they came from)."""
    total = sum(split.stop - split.start for split in splits.values())
    bar = tqdm(total=total, desc="writing MDS", unit="row", disable=not progress)
    written = {}
    for name, split in splits.items():
        if split.stop > split.start:
            rows = split.stream[split.start * seq_len : split.stop * seq_len].reshape(-1, seq_len)
            info = _write_split(
                rows, join_url(out, name), compression, hashes, size_limit, overwrite, bar
            )
            info["text_bytes"] = text_bytes(rows, byte_lengths)
            written[name] = {**info, "source_tokens": str(split.path), "folder": name}
    bar.close()
    return written


def _full_rows(stream: np.ndarray, seq_len: int, path: str | os.PathLike) -> int:
    """Rows of ``seq_len`` tokens in ``stream``: at least one, or a `UserError`."""
    rows = len(stream) // seq_len
    if rows < 1:
        raise UserError(
            f"{path} has {len(stream)} tokens, fewer than one row of --seq-len {seq_len}"
        )
    return rows


# What a val file must share with the main one: rows of both go to one model and one meta.json.
_SHARED_FACTS = ("dtype", "vocab_size", "eos_id", "bos_id", "tokenizer_sha256")


def _check_same_tokens(
    tokens: str | os.PathLike,
    source: Mapping[str, Any],
    val_tokens: str | os.PathLike,
    val_source: Mapping[str, Any],
) -> None:
    """Refuse a val file whose ids mean something else than the main file's (another dtype,
    vocabulary, EOS or tokenizer): its loss would be measured on the wrong tokens."""
    for fact in _SHARED_FACTS:
        if source.get(fact) != val_source.get(fact):
            raise UserError(
                f"--val-tokens {val_tokens} has {fact} {val_source.get(fact)!r} but {tokens} has "
                f"{source.get(fact)!r}: both must come from the same tokenizer (tokenize them "
                "with the same one, or fix a sidecar with data_prep/adopt_tokens.py --overwrite)"
            )


def _check_split_ids(split: _Split, seq_len: int, tokenizer_vocab: int | None) -> None:
    """Refuse ids past the vocabulary in the rows ``split`` writes, before any shard is written:
    the tokenizer's when there is one, else the sidecar's vocab_size (hand-written, or adopted
    before the file changed)."""
    used = split.stream[split.start * seq_len : split.stop * seq_len]
    if tokenizer_vocab is not None:
        _check_ids(used, tokenizer_vocab, split.path)
    elif isinstance(split.source.get("vocab_size"), int):  # no tokenizer beside the file
        check_token_ids(used, split.source["vocab_size"], Path(split.path))


def _source_id(tokens: str | os.PathLike, source: Mapping[str, Any]) -> str:
    """What the token file stands for in the fingerprint: its sidecar's fingerprint, or for a
    sidecar written by hand, `_identity`."""
    return source.get("fingerprint") or _identity(tokens, source)


def _identity(tokens: str | os.PathLike, source: Mapping[str, Any]) -> str:
    """What a sidecar without a fingerprint (written by hand) stands for: its content and the
    token file's size and time, so a changed file is never taken for the converted one."""
    stat = (Path(sidecar_path(tokens)).parent / source["tokens_file"]).stat()
    return settings_fingerprint({**source, "mtime_ns": stat.st_mtime_ns, "bytes": stat.st_size})


def _encoding(dtype: np.dtype, seq_len: int) -> str:
    return f"ndarray:{dtype.name}:{seq_len}"


def _write_split(
    rows: np.ndarray,
    url: str,
    compression: str | None,
    hashes: tuple[str, ...] | list[str],
    size_limit: int | str | None,
    overwrite: bool,
    bar: tqdm,
) -> dict[str, Any]:
    """Write ``rows`` ([n, seq_len] tokens) as one MDS dataset at ``url``; return its counts."""
    columns = {"tokens": _encoding(rows.dtype, rows.shape[1])}
    with MDSWriter(
        url,
        columns,
        compression=compression,
        hashes=hashes,
        size_limit=size_limit,
        exist_ok=overwrite,
    ) as writer:
        for row in rows:
            writer.write({"tokens": row})
            bar.update(1)
    return {"rows": len(rows), "shards": len(writer.shards), "tokens": rows.size}


def _check_ids(tokens: np.ndarray, vocab_size: int, path: str | os.PathLike) -> None:
    """Refuse a stream with an id the tokenizer next to it does not have, before any shard is
    written (any tokenizer kind): the model would index past its embedding."""
    flat = tokens.reshape(-1)
    for start in range(0, flat.size, _CHUNK):
        top = int(flat[start : start + _CHUNK].max())
        if top >= vocab_size:
            raise UserError(
                f"{path}: token id {top} is not in its tokenizer's vocabulary of {vocab_size} "
                "ids; the token stream was made with another tokenizer: redo text_to_tokens.py"
            )


def text_bytes(rows: np.ndarray, byte_lengths: np.ndarray | None) -> int | None:
    """UTF-8 bytes the tokens of ``rows`` decode to (see ``token_byte_lengths``), in chunks."""
    if byte_lengths is None:
        return None
    flat = rows.reshape(-1)
    return sum(
        int(byte_lengths[flat[start : start + _CHUNK]].sum())
        for start in range(0, flat.size, _CHUNK)
    )
