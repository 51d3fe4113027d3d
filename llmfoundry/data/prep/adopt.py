"""Token files made elsewhere (nanoGPT's ``train.bin``, a Pile dump): read them as our own.

Our readers take a token file's dtype, length, vocabulary and EOS id from its ``.json``
sidecar (text_to_tokens.py writes one). A bare ``.bin`` carries none of them, and none can be
inferred safely: the bytes read as uint16 or uint32 alike, and the largest id in the file is
only a lower bound of the tokenizer's vocabulary (rare tokens may never occur), while
model.vocab_size may be padded. So the user names dtype and vocab_size (eos_id when known),
and the ids are checked against vocab_size once, in chunks (bounded memory for any file
size). ``adopt_tokens`` records that in a sidecar, so later commands need no flags; without
one, :func:`open_token_file` takes the same facts as arguments. No tokenizer is needed.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from llmfoundry.data.prep.reuse import settings_fingerprint
from llmfoundry.data.prep.text_to_tokens import TOKENS_FORMAT, open_tokens, sidecar_path
from llmfoundry.utils.errors import MissingInput, OutputExists, UserError
from llmfoundry.utils.files import atomic_write

__all__ = [
    "TOKEN_DTYPES",
    "add_bare_token_arguments",
    "adopt_tokens",
    "bare_tokens_meta",
    "check_token_ids",
    "open_token_file",
]

TOKEN_DTYPES = ("uint16", "uint32")
_CHUNK = 1 << 24  # tokens per pass when checking ids: bounded memory for any file length


def adopt_tokens(
    path: str | os.PathLike,
    *,
    dtype: str | None,
    vocab_size: int | None,
    eos_id: int | None = None,
    bos_id: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the sidecar of the bare token file ``path`` (``x.bin`` -> ``x.json``); return it.

    An existing sidecar is kept (and returned) when it says the same; a different one is an
    error without ``overwrite``.
    """
    meta = bare_tokens_meta(path, dtype=dtype, vocab_size=vocab_size, eos_id=eos_id, bos_id=bos_id)
    sidecar = sidecar_path(path)
    if sidecar.is_file() and not overwrite:
        previous = json.loads(sidecar.read_text())
        if previous.get("fingerprint") == meta["fingerprint"]:
            return previous
        raise OutputExists(
            f"{sidecar} already describes {Path(path).name} otherwise; pass --overwrite to "
            "replace it"
        )
    atomic_write(sidecar, json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


def bare_tokens_meta(
    path: str | os.PathLike,
    *,
    dtype: str | None,
    vocab_size: int | None,
    eos_id: int | None = None,
    bos_id: int | None = None,
) -> dict[str, Any]:
    """The sidecar of a bare token file: given facts checked against the file (one pass)."""
    path = Path(path)
    if not path.is_file():
        raise MissingInput(f"token file {path} does not exist")
    if dtype not in TOKEN_DTYPES:
        raise UserError(
            f"{path} has no sidecar saying its dtype: give dtype uint16 (nanoGPT's) or uint32, "
            f"got {dtype!r}"
        )
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise UserError(
            f"{path} has no sidecar saying its vocabulary: give vocab_size, the tokenizer's "
            f"(50257 for GPT-2), got {vocab_size!r}"
        )
    for name, value in (("eos_id", eos_id), ("bos_id", bos_id)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size
        ):
            raise UserError(
                f"{name} must be a token id below vocab_size={vocab_size}, got {value!r}"
            )
    stat = path.stat()
    itemsize = np.dtype(dtype).itemsize
    if stat.st_size == 0 or stat.st_size % itemsize:
        raise UserError(
            f"{path} is {stat.st_size} bytes, not a whole number of {dtype} tokens; is it a "
            "token file, and of this dtype?"
        )
    num_tokens = stat.st_size // itemsize
    check_token_ids(np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,)), vocab_size, path)
    facts = {"dtype": dtype, "vocab_size": vocab_size, "eos_id": eos_id, "bos_id": bos_id}
    file_id = {"file": path.name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {
        "format": TOKENS_FORMAT,
        "version": 1,
        "tokens_file": path.name,
        "num_tokens": num_tokens,
        "doc_index": None,
        "tokenizer": None,
        "adopted": True,
        **facts,
        "fingerprint": settings_fingerprint({**facts, **file_id, "version": 1}),
    }


def open_token_file(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    keys: str = "--dtype and --vocab-size",
) -> tuple[np.memmap, dict[str, Any]]:
    """A token file as a read-only memmap and its metadata: from its sidecar, or for a bare
    file from the facts given (checked as :func:`bare_tokens_meta` does). Facts given beside a
    sidecar must agree with it: a silently ignored setting would hide a mistake. ``keys``: how
    the caller's user gives the facts, for the error without them."""
    path = Path(path)
    if path.suffix == ".json" or sidecar_path(path).is_file():
        tokens, meta = open_tokens(path)
        given = {"dtype": dtype, "vocab_size": vocab_size, "eos_id": eos_id}
        for key, value in given.items():
            if value is not None and meta.get(key) != value:
                raise UserError(
                    f"{key}={value!r} was given but {sidecar_path(path)} records "
                    f"{meta.get(key)!r}; leave {key} out (the sidecar says it) or fix the sidecar "
                    "with data_prep/adopt_tokens.py --overwrite"
                )
        return tokens, meta
    if not path.is_file():
        raise MissingInput(
            f"token file {path} does not exist; write it with data_prep/text_to_tokens.py, or "
            "give the path of your own token file (nanoGPT's train.bin)"
        )
    if dtype is None and vocab_size is None:
        raise MissingInput(
            f"token file {path} has no sidecar {sidecar_path(path).name}: describe it once with "
            f"`python data_prep/adopt_tokens.py {path} --dtype uint16 --vocab-size N "
            f"[--eos-id E]`, or set {keys}"
        )
    meta = bare_tokens_meta(path, dtype=dtype, vocab_size=vocab_size, eos_id=eos_id)
    return np.memmap(path, dtype=dtype, mode="r", shape=(meta["num_tokens"],)), meta


def add_bare_token_arguments(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """``--dtype``, ``--vocab-size``, ``--eos-id``: the facts of a token file made elsewhere."""
    bare = "" if required else " (a token file without a .json sidecar)"
    parser.add_argument(
        "--dtype", choices=TOKEN_DTYPES, required=required, help=f"token dtype{bare}"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        required=required,
        help=f"the tokenizer's vocabulary size, e.g. 50257 for GPT-2{bare}",
    )
    parser.add_argument(
        "--eos-id", type=int, help=f"the end-of-document token id, e.g. 50256 for GPT-2{bare}"
    )


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    """Refuse an id at or past ``vocab_size``: a wrong dtype or vocabulary, which the model
    would otherwise meet as an index past its embedding."""
    for start in range(0, len(tokens), _CHUNK):
        top = int(tokens[start : start + _CHUNK].max())
        if top >= vocab_size:
            raise UserError(
                f"{path} holds token id {top}, not below vocab_size={vocab_size}: give the "
                "tokenizer's vocab_size, or the right dtype (uint16 vs uint32)"
            )
