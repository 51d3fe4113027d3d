"""Token rows from MDS shards for language-model training: the dataset the ``data=mds`` config
builds (conf/data/mds.yaml, through data/builder.py).

The contract with the trainer (shared by every dataset the builder makes, e.g. memmap.py's):

The builder returns, per split, a :class:`~llmfoundry.data.streaming.StreamingDataLoader` for
this rank whose batches are ``{"input_ids": LongTensor[B, L], "labels": LongTensor[B, L]}``
(plus ``"sequence_id"`` when the shards have that column, or when ``sequence_id_from_eos``
derives it from the eos token ending each document; plus ``"sample_mask"`` on evaluation
batches, epochs.py). ``labels`` is a copy of ``input_ids``, -100 on padding (only
rows of unequal length are padded; fixed-length rows never are), or the shards' own ``labels``
column when they have one (instruction data: -100 on prompts, see data/prep/instructions.py).
``B`` is the per-rank batch size; the final batch of an epoch may be shorter unless
``drop_last``. The trainer calls, on the loader:

- ``loader.set_epoch(epoch)`` before iterating each epoch (the shuffle is seeded by
  ``(shuffle_seed, epoch)``; without the call every iteration repeats epoch 0's order);
- ``loader.state_dict(num_samples)`` when checkpointing, where ``num_samples`` is the number
  of samples consumed in the current epoch summed over all ranks (steps done in the epoch x
  global batch size, counted from the epoch's start even after a resumption);
- ``loader.load_state_dict(state)`` when resuming, before ``set_epoch`` with the saved epoch;
  the next iteration then yields exactly the samples the interrupted run had not consumed, in
  the same global order, also on another number of ranks.

``len(loader)`` is the number of batches of a full epoch for this rank; every rank reads the
same number of samples, a few repeated when the epoch does not divide by the world size.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch

from llmfoundry.data.mds import NDArray, get_encoding
from llmfoundry.data.meta import META_FILE, meta_url, read_meta
from llmfoundry.data.streaming import StreamingDataset
from llmfoundry.data.streaming.checks import check_int
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.logs import SAME_ON_EVERY_RANK

__all__ = ["StreamingTextDataset", "check_vocab", "resolve_eos", "sequence_ids_from_eos"]

log = logging.getLogger(__name__)

TOKENS, SEQUENCE_ID, LABELS = "tokens", "sequence_id", "labels"
_TOKEN_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "int64")
_PAD_LABEL, _PAD_SEQUENCE_ID = -100, -1


class StreamingTextDataset(StreamingDataset):
    """A :class:`StreamingDataset` of token rows: the ``tokens`` column of each sample.

    Samples are ``{"input_ids": LongTensor[L]}`` (plus ``"sequence_id"`` when every shard has
    that column), rows cut to ``max_seq_len`` when longer. Fixed-size rows
    (``ndarray:uint16:L`` / ``ndarray:uint32:L``) are read a batch at a time as numpy views of
    the mapped shards; variable-length rows are supported and padded per batch.

    ``meta`` is what data_prep wrote beside the splits (``<remote>/meta.json``: vocab_size,
    eos_id, ...), or None (streams, or data not from data_prep).

    Args:
        max_seq_len: longest row to return (longer rows are truncated, with a warning naming the
            numbers and the fix); None keeps rows whole.
        pad_to_multiple_of: batches are right-padded to a width that is a multiple of this
            (labels -100, documents apart): tensor parallelism splits every sequence over its
            ranks, so the builder passes parallelism.tp. Padding on the right changes no loss.
        sequence_id_from_eos: document masking: mark each token's document (batches get
            ``sequence_id``) from the eos token data_prep ends every document with; a token
            id, or ``"auto"`` for meta.json's eos_id. Shards with their own sequence_id column
            keep it.
        All other arguments: :class:`StreamingDataset`.
    """

    def __init__(
        self,
        *args: Any,
        max_seq_len: int | None = None,
        sequence_id_from_eos: int | Literal["auto"] | None = None,
        pad_to_multiple_of: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_int("max_seq_len", max_seq_len, minimum=1, optional=True)
        check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1)
        self.max_seq_len = max_seq_len
        self.pad_to_multiple_of = pad_to_multiple_of
        self.meta_url = None if self.remote is None else meta_url(self.remote)
        self.meta = read_meta(self.remote, self.storage_options, self.caches[0].node)
        self.eos_id = resolve_eos(sequence_id_from_eos, self.meta, self.meta_url)
        shards = [(c, s) for c in self.caches for s in c.shards]
        self.has_sequence_id = all(SEQUENCE_ID in s.column_names for _, s in shards)
        with_labels = [LABELS in s.column_names for _, s in shards]
        if any(with_labels) and not all(with_labels):
            raise UserError(
                "some shards have a labels column (instruction data) and others do not; "
                "train on one kind at a time"
            )
        self.has_labels = all(with_labels)
        self.columns = (
            (TOKENS,)
            + ((SEQUENCE_ID,) if self.has_sequence_id else ())
            + ((LABELS,) if self.has_labels else ())
        )
        # Per shard: (row width after the max_seq_len cut, dtype of each column) when every
        # column has a fixed size, so rows are slices of one [samples, L] view of the mapped
        # shard; else None (rows are decoded one by one). Batches whose shards all share one
        # layout take the fast path of get_batch.
        self._layout: list[tuple[int, tuple[np.dtype, ...]] | None] = []
        for cache, shard in shards:
            where = f"shard {shard.raw_basename} of {cache.remote or cache.local}"
            coders = {}
            for column in self.columns:
                coder = get_encoding(shard.columns[column]) if column in shard.columns else None
                if not isinstance(coder, NDArray):
                    raise UserError(
                        f"{where} has no ndarray {column!r} column (columns: "
                        f"{shard.columns}); text datasets need token rows written as "
                        "ndarray:uint16:L or ndarray:uint32:L by the data_prep/ scripts"
                    )
                if coder.dtype is not None and coder.dtype not in _TOKEN_DTYPES:
                    raise UserError(
                        f"{where}: column {column!r} holds {coder.dtype}; token ids must be one "
                        f"of {_TOKEN_DTYPES}"
                    )
                if coder.shape is not None and len(coder.shape) != 1:
                    raise UserError(
                        f"{where}: column {column!r} rows must be 1-D, not {coder.shape}"
                    )
                coders[column] = coder
            shapes = {column: coder.shape for column, coder in coders.items()}
            if len(set(shapes.values())) > 1:
                raise UserError(f"{where}: column rows differ in shape {shapes}")
            fixed = all(size is not None for size in shard.column_sizes)
            if shapes[TOKENS] and max_seq_len is not None and shapes[TOKENS][0] > max_seq_len:
                _warn_cut(shapes[TOKENS][0], max_seq_len, cache.remote or cache.local)
            if fixed and shapes[TOKENS]:
                width = min(shapes[TOKENS][0], max_seq_len or shapes[TOKENS][0])
                dtypes = tuple(np.dtype(coders[c].dtype) for c in self.columns)
                self._layout.append((width, dtypes))
            else:
                self._layout.append(None)

    def _row(self, shard: int, index: int, column: str) -> np.ndarray:
        """One sample's ``column``, cut to max_seq_len, read without assuming a fixed size."""
        reader = self._readers().get(shard)
        row = reader.get_array(index, column)
        if row.ndim != 1 or row.dtype.name not in _TOKEN_DTYPES:
            raise UserError(
                f"sample {index} of {reader.path}: {column!r} is {row.dtype}{list(row.shape)}; "
                f"expected a 1-D array of integer ids ({_TOKEN_DTYPES})"
            )
        return row[: self.max_seq_len]

    def get_item(self, index: int) -> dict[str, torch.Tensor]:
        i = self._check_index(index)
        shards, local = self.locate(np.array([i]))
        shard, j = int(shards[0]), int(local[0])
        out = {}
        for column in self.columns:
            row = torch.from_numpy(self._row(shard, j, column).astype(np.int64))
            out["input_ids" if column == TOKENS else column] = row
        if self.has_labels:
            out["labels"] = out.pop(LABELS)
        if self.eos_id is not None and not self.has_sequence_id:
            out[SEQUENCE_ID] = sequence_ids_from_eos(out["input_ids"][None], self.eos_id)[0]
        return out

    def get_batch(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        """Rows ``ids`` as one batch, right-padded when their lengths differ.

        The hot path (every shard of the batch has one fixed-size layout) decodes nothing: each
        row is a view of its mapped shard and ``bytes.join`` copies them all into one compact
        buffer in a single C loop (numpy's concatenate sets up a separate copy per input, which
        costs ~0.35 us more per row). ``input_ids`` and ``labels`` (a copy the trainer may mask)
        are both widened to int64 from that buffer. Shards of other layouts (variable-length
        rows, or one batch mixing uint16 and uint32 shards) are read row by row.
        """
        shards, local = self.locate(ids)
        shard_list, local_list = shards.tolist(), local.tolist()
        used = set(shard_list)
        layouts = {self._layout[s] for s in used}
        readers = self._readers()
        rows: dict[str, np.ndarray] = {}
        lengths = None
        if len(layouts) == 1 and None not in layouts:
            ((width, dtypes),) = layouts
            for column, dtype in zip(self.columns, dtypes, strict=True):
                views = {}
                for s in used:
                    view = readers.array(s, column)
                    views[s] = view if view.shape[1] == width else view[:, :width]
                data = b"".join([views[s][j] for s, j in zip(shard_list, local_list, strict=True)])
                rows[column] = np.frombuffer(data, dtype).reshape(len(ids), width)
        else:
            pairs = list(zip(shard_list, local_list, strict=True))
            decoded = {c: [self._row(s, j, c) for s, j in pairs] for c in self.columns}
            lengths = np.array([len(row) for row in decoded[TOKENS]], np.int64)
            width = int(lengths.max())
            for column in self.columns:
                array = rows[column] = np.full((len(ids), width), _fill(column), np.int64)
                for r, row in enumerate(decoded[column]):
                    array[r, : len(row)] = row
        if width % self.pad_to_multiple_of:
            padded = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
            for column, array in rows.items():
                rows[column] = np.full((len(ids), padded), _fill(column), np.int64)
                rows[column][:, :width] = array
            if lengths is None:
                lengths = np.full(len(ids), width, np.int64)
            width = padded
        tokens = rows[TOKENS]
        batch = {
            "input_ids": torch.from_numpy(tokens.astype(np.int64)),
            "labels": torch.from_numpy(
                rows[LABELS if self.has_labels else TOKENS].astype(np.int64)
            ),
        }
        padding = None
        if lengths is not None and (lengths < width).any():
            padding = torch.arange(width) >= torch.from_numpy(lengths)[:, None]
            batch["labels"][padding] = _PAD_LABEL
        if self.has_sequence_id:
            batch[SEQUENCE_ID] = torch.from_numpy(rows[SEQUENCE_ID].astype(np.int64))
        elif self.eos_id is not None:
            batch[SEQUENCE_ID] = sequence_ids_from_eos(batch["input_ids"], self.eos_id)
            if padding is not None:
                batch[SEQUENCE_ID][padding] = _PAD_SEQUENCE_ID
        return batch


def _fill(column: str) -> int:
    """What a column holds where a row is padded: token 0, label -100, a document of its own."""
    return {TOKENS: 0, LABELS: _PAD_LABEL}.get(column, _PAD_SEQUENCE_ID)


@functools.cache
def _warn_cut(width: int, max_seq_len: int, where: str) -> None:
    """Say once per dataset that rows longer than max_seq_len lose their tail."""
    log.warning(
        "rows of %s hold %d tokens but max_seq_len=%d: the last %d tokens of every row are cut "
        "and never trained on; set max_seq_len=%d (and model.max_seq_len), or write the data "
        "with data_prep/tokens_to_mds.py --seq-len %d",
        where,
        width,
        max_seq_len,
        width - max_seq_len,
        width,
        max_seq_len,
        extra=SAME_ON_EVERY_RANK,
    )


def check_vocab(meta: Mapping[str, Any] | None, model_vocab_size: int, where: str) -> None:
    """Token ids of the data (``meta.json``'s ``vocab_size``) must fit the model's embedding.

    Checked once at startup: a token id past the embedding is otherwise an IndexError deep in
    the model (a device-side assert on GPU) after the first batch. A model vocabulary larger
    than the tokenizer's is legal (rows padded to a round size for speed) but worth a line.
    Per-batch checking of the ids themselves: the `token_id_check` callback.
    """
    data_vocab = (meta or {}).get("vocab_size")
    if not isinstance(data_vocab, int):
        return
    if data_vocab > model_vocab_size:
        raise UserError(
            f"model.vocab_size={model_vocab_size} is smaller than the data's vocabulary "
            f"({data_vocab} in {where}): token ids up to {data_vocab - 1} would index past the "
            f"embedding; set model.vocab_size={data_vocab} or more (a multiple of 64 is fastest)"
        )
    if model_vocab_size > data_vocab:
        log.warning(
            "model.vocab_size=%d is larger than the data's vocabulary (%d in %s): %d embedding "
            "rows are never trained; fine when padded to a round size, else set "
            "model.vocab_size=%d",
            model_vocab_size,
            data_vocab,
            where,
            model_vocab_size - data_vocab,
            data_vocab,
            extra=SAME_ON_EVERY_RANK,
        )


def sequence_ids_from_eos(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of each token of `input_ids` [B, L], counting the documents of each row.

    data_prep ends every document with `eos_id`; the eos token belongs to the document it ends,
    so a new document starts right after it.
    """
    is_eos = (input_ids == eos_id).long()
    return is_eos.cumsum(dim=1) - is_eos


def resolve_eos(option: Any, meta: Mapping[str, Any] | None, where: str | None) -> int | None:
    """The token id ``sequence_id_from_eos`` names: an id, ``"auto"`` (``meta``'s eos_id, as
    data_prep recorded it in ``where``), or None (no document ids)."""
    if option is None:
        return None
    if option != "auto" and (isinstance(option, bool) or not isinstance(option, int) or option < 0):
        raise UserError(
            f"sequence_id_from_eos must be null, a token id or 'auto' ({META_FILE}'s eos_id), got "
            f"{option!r}"
        )
    if option != "auto":
        return option
    if meta is None:
        raise UserError(
            f"sequence_id_from_eos=auto reads the eos_id data_prep records, but "
            f"{where or f'the data (streams have no single {META_FILE})'} was not found; give the "
            "eos token id instead"
        )
    eos_id = meta.get("eos_id")
    if isinstance(eos_id, bool) or not isinstance(eos_id, int):
        raise UserError(f"sequence_id_from_eos=auto: {where} records no eos_id; give the id")
    return eos_id
