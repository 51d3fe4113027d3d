"""Windows of a plain token file, read in place: the ``data=memmap`` dataset.

``data_prep/text_to_tokens.py`` writes one token stream, ``<remote>/tokens.bin`` (uint16, or
uint32 for large vocabularies), beside ``tokens.json`` (its dtype, token count, vocab_size,
eos_id) and ``tokenizer.json``. This dataset trains on it directly, nanoGPT style, without
cutting MDS shards: each sample is a window of ``max_seq_len`` consecutive tokens. A token file
made elsewhere (nanoGPT's ``train.bin``) needs its sidecar written once by
``data_prep/adopt_tokens.py``, or ``dtype`` and ``vocab_size`` here (prep/adopt.py); no
tokenizer is needed.

- ``windows="random"``: window starts drawn uniformly over the split, seeded by
  (shuffle_seed, epoch, block of positions), so the epoch's order is deterministic and does
  not depend on the world size; an epoch is ``epoch_size`` windows (default: as many as
  fit the split side by side).
- ``windows="sequential"``: the split cut into non-overlapping windows in file order (a tail
  shorter than a window is not read).

Evaluation (``evaluation=True``) always reads the split's sequential windows once, and records
the text bytes they decode to in ``meta["splits"][split]`` as tokens_to_mds.py does for MDS (a
byte-level tokenizer beside the file), so evaluation reports bits per byte here too. Splits: the
last ``val_fraction`` of the file's tokens is split ``val``, the rest ``train``; or
``split_files`` names a file per split. The epochs, resumption and rank partition are
epochs.py's, as for MDS data.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch

from llmfoundry.data.prep.adopt import TOKEN_DTYPES, open_token_file
from llmfoundry.data.prep.text_to_tokens import sidecar_path
from llmfoundry.data.prep.tokens_to_mds import text_bytes
from llmfoundry.data.streaming.checks import check_int
from llmfoundry.data.streaming.epochs import EpochDataset
from llmfoundry.data.text import SEQUENCE_ID, resolve_eos, sequence_ids_from_eos
from llmfoundry.tokenizers.tokenizer import load_tokenizer, token_byte_lengths
from llmfoundry.utils.errors import MissingInput, UserError
from llmfoundry.utils.storage import is_local, local_path

__all__ = ["MemmapTokens"]

_BLOCK = 1 << 16  # positions per seeded draw of random window starts


class MemmapTokens(EpochDataset):
    """Token windows of a data_prep token file (module docstring).

    Args:
        remote: local folder holding the token file(s), their ``.json`` sidecars and
            ``tokenizer.json``.
        split: ``train`` or ``val`` (cut by ``val_fraction``), or a key of ``split_files``.
        file: the token file in ``remote``.
        split_files: ``{split: file}``, one token file per split, instead of cutting ``file``.
        val_fraction: share of ``file``'s tokens (its tail) that split ``val`` reads; null:
            every split reads the whole file.
        windows: ``random`` or ``sequential`` training windows.
        shuffle_seed: seed of the random windows.
        epoch_size: random windows per epoch over all ranks (default: split tokens //
            max_seq_len).
        max_seq_len: tokens per window (the builder passes the model's).
        pad_to_multiple_of: what max_seq_len must be a multiple of (the builder passes
            parallelism.tp; windows are never padded).
        sequence_id_from_eos: batches get ``sequence_id`` (document index of each token) from
            this eos id, or ``auto`` (the sidecar's eos_id).
        dtype, vocab_size, eos_id: what a token file without a ``.json`` sidecar holds
            (uint16 or uint32 ids below vocab_size; eos_id for ``auto`` above); beside a
            sidecar they must agree with it.
        batch_size, data_parallel, evaluation: :class:`EpochDataset`.
    """

    state_checked = ("windows", "shuffle_seed", "epoch_size", "num_tokens", "max_seq_len")

    def __init__(
        self,
        remote: str | None = None,
        split: str = "train",
        *,
        file: str = "tokens.bin",
        split_files: Mapping[str, str] | None = None,
        val_fraction: float | None = 0.02,
        windows: Literal["random", "sequential"] = "random",
        shuffle_seed: int = 17,
        epoch_size: int | None = None,
        max_seq_len: int | None = None,
        sequence_id_from_eos: int | Literal["auto"] | None = None,
        pad_to_multiple_of: int = 1,
        dtype: str | None = None,
        vocab_size: int | None = None,
        eos_id: int | None = None,
        batch_size: int | None = None,
        data_parallel: tuple[int, int] | None = None,
        evaluation: bool = False,
    ) -> None:
        # A local file has no shards to keep apart per node: one sequence, any node count.
        super().__init__(
            batch_size=batch_size,
            data_parallel=data_parallel,
            evaluation=evaluation,
            canonical_nodes=1,
        )
        if not isinstance(remote, str) or not is_local(remote):
            raise UserError(
                f"memmap data reads a local folder, got remote={remote!r}; copy the token file "
                "to this machine, or write MDS shards (data_prep/tokens_to_mds.py) for data=mds"
            )
        if windows not in ("random", "sequential"):
            raise UserError(f"windows must be 'random' or 'sequential', got {windows!r}")
        check_int("shuffle_seed", shuffle_seed, minimum=0)
        check_int("epoch_size", epoch_size, minimum=1, optional=True)
        if max_seq_len is None:
            raise UserError("memmap windows need max_seq_len (tokens per sample)")
        check_int("max_seq_len", max_seq_len, minimum=1)
        check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
        if max_seq_len % pad_to_multiple_of:
            raise UserError(
                f"memmap windows are max_seq_len={max_seq_len} tokens, never padded: make it a "
                f"multiple of {pad_to_multiple_of} (parallelism.tp splits every sequence)"
            )
        path, part = _split_file(local_path(remote), split, file, split_files, val_fraction)
        self.path, self.split, self.max_seq_len = path, split, max_seq_len
        self.tokens, self.meta = _open(path, dtype=dtype, vocab_size=vocab_size, eos_id=eos_id)
        sidecar = sidecar_path(path)
        self.meta_url = str(sidecar) if sidecar.is_file() else f"the data config for {path}"
        n = len(self.tokens)
        cut = n - round(n * (val_fraction or 0))
        self.lo, hi = (0, n) if part == "all" else (0, cut) if part == "head" else (cut, n)
        self.num_tokens = hi - self.lo
        if self.num_tokens < max_seq_len:
            raise UserError(
                f"split {split!r} of {path} holds {self.num_tokens} tokens, fewer than one "
                f"window of max_seq_len={max_seq_len}; use a smaller max_seq_len or more data"
                + (" (or a larger val_fraction)" if split_files is None else "")
            )
        if evaluation or windows == "sequential":
            if epoch_size is not None and not evaluation:
                raise UserError(
                    "epoch_size sets the number of random windows; sequential windows read the "
                    "split once (set epoch_size=null or windows=random)"
                )
            windows, epoch_size = "sequential", self.num_tokens // max_seq_len
        self.windows = windows
        self.shuffle_seed = shuffle_seed
        self.epoch_size = epoch_size or self.num_tokens // max_seq_len
        self.eos_id = resolve_eos(sequence_id_from_eos, self.meta, self.meta_url)
        if evaluation:
            read = self.tokens[self.lo : self.lo + self.epoch_size * max_seq_len]
            split_info = {"tokens": len(read), "text_bytes": _text_bytes_of(read, path)}
            self.meta = {**self.meta, "splits": {split: split_info}}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["tokens"] = None  # a DataLoader worker maps the file itself instead of a copy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # The file as checked when the dataset was made (no second pass over a bare file).
        dtype, size = self.meta["dtype"], self.meta["num_tokens"]
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r", shape=(size,))

    def order(self) -> Callable[[np.ndarray], np.ndarray]:
        """Positions -> token offsets of their windows' first tokens."""
        lo, length, size = self.lo, self.max_seq_len, self.epoch_size
        if self.windows == "sequential":
            return lambda positions: lo + (positions % size) * length
        seed, epoch, starts = self.shuffle_seed, self._epoch, self.num_tokens - length + 1

        def offsets(positions: np.ndarray) -> np.ndarray:
            positions = positions % size
            blocks = positions // _BLOCK
            out = np.empty_like(positions)
            for b in np.unique(blocks).tolist():
                draw = np.random.default_rng(np.random.SeedSequence([seed, epoch, b]))
                mask = blocks == b
                out[mask] = lo + draw.integers(0, starts, _BLOCK)[positions[mask] - b * _BLOCK]
            return out

        return offsets

    def get_batch(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        rows = self.tokens[ids[:, None] + np.arange(self.max_seq_len)].astype(np.int64)
        batch = {"input_ids": torch.from_numpy(rows), "labels": torch.from_numpy(rows.copy())}
        if self.eos_id is not None:
            batch[SEQUENCE_ID] = sequence_ids_from_eos(batch["input_ids"], self.eos_id)
        return batch


def _split_file(
    folder: str,
    split: str,
    file: str,
    split_files: Mapping[str, str] | None,
    val_fraction: float | None,
) -> tuple[str, Literal["all", "head", "tail"]]:
    """The token file ``split`` reads, and which part of it: all, or the head / tail that
    ``val_fraction`` cuts."""
    if split_files is not None:
        if val_fraction is not None:
            raise UserError(
                "split_files gives each split its own token file: set val_fraction=null"
            )
        if not isinstance(split_files, Mapping) or split not in split_files:
            raise UserError(
                f"split {split!r} is not in split_files {dict(split_files or {})}; add it "
                "({split: file in the data folder})"
            )
        return os.path.join(folder, split_files[split]), "all"
    path = os.path.join(folder, file)
    if val_fraction is None:
        return path, "all"
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
        raise UserError(f"val_fraction must be a number in (0, 1) or null, got {val_fraction!r}")
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction must be in (0, 1) or null, got {val_fraction}")
    if split not in ("train", "val"):
        raise UserError(
            f"split {split!r}: with val_fraction the splits are train and val; name other "
            "splits' files in split_files"
        )
    return path, "head" if split == "train" else "tail"


def _text_bytes_of(tokens: np.ndarray, path: str) -> int | None:
    """The text bytes `tokens` decode to, by the tokenizer beside the token file at `path`;
    None without one, or for a tokenizer that is not byte-level (no guess)."""
    tokenizer = os.path.join(os.path.dirname(path), "tokenizer.json")
    if not os.path.isfile(tokenizer):
        return None
    return text_bytes(tokens, token_byte_lengths(load_tokenizer(tokenizer)))


def _open(path: str, **bare: Any) -> tuple[np.ndarray, dict[str, Any]]:
    """The token file as a read-only memmap and its sidecar (or the ``bare`` facts of a file
    without one: dtype, vocab_size, eos_id), or a one-line error."""
    if not os.path.isfile(path):
        raise MissingInput(
            f"token file {path} does not exist; write it with data_prep/text_to_tokens.py "
            "--out <folder>/tokens.bin, or point data.remote at that folder"
        )
    try:
        tokens, meta = open_token_file(path, **bare, keys="data.dtype and data.vocab_size")
    except UserError:
        raise
    except (KeyError, ValueError) as err:
        raise UserError(f"cannot read {path}: {err}") from None
    if tokens.dtype.name not in TOKEN_DTYPES:
        raise UserError(
            f"{path} holds {tokens.dtype} tokens; memmap data reads {' or '.join(TOKEN_DTYPES)} "
            "token ids as data_prep/text_to_tokens.py writes them"
        )
    return tokens, meta
