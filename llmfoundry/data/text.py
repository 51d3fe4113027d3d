"""Token rows from MDS shards for language-model training: the dataset, its config, its loader.

The contract with the trainer:

``build_dataloader(cfg, split, batch_size, max_seq_len, shuffle=None)`` returns a
:class:`~llmfoundry.data.streaming.StreamingDataLoader` for this rank whose batches are
``{"input_ids": LongTensor[B, L], "labels": LongTensor[B, L]}`` (plus ``"sequence_id"`` when
the shards have that column, or when ``cfg.sequence_id_from_eos`` derives it from the eos token
ending each document). ``labels`` is a copy of ``input_ids``, -100 on padding (only
rows of unequal length are padded; fixed-length rows never are), or the shards' own ``labels``
column when they have one (instruction data: -100 on prompts, see data/prep/instructions.py).
``B`` is the per-rank batch size; the final batch of an epoch may be shorter unless
``cfg.drop_last``. The trainer calls, on the loader:

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
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from llmfoundry.data.mds import NDArray, get_encoding, is_hash
from llmfoundry.data.streaming import Stream, StreamingDataLoader, StreamingDataset
from llmfoundry.data.streaming.checks import check_int
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url, parse_size
from llmfoundry.utils.storage import open_url

__all__ = ["DataConfig", "StreamingTextDataset", "build_dataloader"]

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

    Args:
        max_seq_len: longest row to return (longer rows are truncated, with a warning naming the
            numbers and the fix); None keeps rows whole.
        All other arguments: :class:`StreamingDataset`.
    """

    def __init__(
        self,
        *args: Any,
        max_seq_len: int | None = None,
        eos_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_int("max_seq_len", max_seq_len, minimum=1, optional=True)
        check_int("eos_id", eos_id, minimum=0, optional=True)
        self.max_seq_len = max_seq_len
        self.eos_id = eos_id
        shards = [(c, s) for c in self.caches for s in c.shards]
        self.has_sequence_id = all(SEQUENCE_ID in s.column_names for _, s in shards)
        with_labels = [LABELS in s.column_names for _, s in shards]
        if any(with_labels) and not all(with_labels):
            raise ValueError(
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
                    raise ValueError(
                        f"{where} has no ndarray {column!r} column (columns: "
                        f"{shard.columns}); text datasets need token rows written as "
                        "ndarray:uint16:L or ndarray:uint32:L by the data_prep/ scripts"
                    )
                if coder.dtype is not None and coder.dtype not in _TOKEN_DTYPES:
                    raise ValueError(
                        f"{where}: column {column!r} holds {coder.dtype}; token ids must be one "
                        f"of {_TOKEN_DTYPES}"
                    )
                if coder.shape is not None and len(coder.shape) != 1:
                    raise ValueError(
                        f"{where}: column {column!r} rows must be 1-D, not {coder.shape}"
                    )
                coders[column] = coder
            shapes = {column: coder.shape for column, coder in coders.items()}
            if len(set(shapes.values())) > 1:
                raise ValueError(f"{where}: column rows differ in shape {shapes}")
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
            raise ValueError(
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
                fill = {TOKENS: 0, LABELS: _PAD_LABEL}.get(column, _PAD_SEQUENCE_ID)
                array = rows[column] = np.full((len(ids), width), fill, np.int64)
                for r, row in enumerate(decoded[column]):
                    array[r, : len(row)] = row
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
        )


def sequence_ids_from_eos(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document index of each token of `input_ids` [B, L], counting the documents of each row.

    data_prep ends every document with `eos_id`; the eos token belongs to the document it ends,
    so a new document starts right after it.
    """
    is_eos = (input_ids == eos_id).long()
    return is_eos.cumsum(dim=1) - is_eos


_STREAM_KEYS = ("remote", "local", "proportion", "repeat", "choose")


@dataclass
class DataConfig:
    """The ``data`` config group: where the MDS shards are and how to load them.

    ``remote`` is a local MDS folder or an fsspec URL (``s3://bucket/mds``) with one sub-folder
    per split (``train/``, ``val/``). ``local`` caches a remote (default: a per-remote folder in
    the temp dir); with a local ``remote`` the shards are read in place. ``streams`` mixes
    several datasets instead: ``{name: {remote, local, proportion | repeat | choose}}``, cached
    under ``local/<name>`` when ``local`` is set. ``epoch_size`` and the streams' shares shape
    the training split only; evaluation reads every sample of each eval split once.
    See :class:`~llmfoundry.data.streaming.StreamingDataset` for the other fields.
    """

    remote: str | None = None
    local: str | None = None
    train_split: str = "train"
    eval_split: str | None = "val"
    streams: dict[str, dict[str, Any]] | None = None
    # More evaluation sets by label, {label: remote}; each is read from its `eval_split` folder
    # and reported as eval/<label>/<metric> (the main data's as eval/<eval_split>/...).
    eval_datasets: dict[str, str] | None = None
    shuffle: bool = True
    shuffle_seed: int = 17
    shuffle_block_size: int | None = None
    epoch_size: int | None = None
    # Reads are memcpy-cheap gathers and downloads run on a background thread, so the main
    # process keeps up with a GPU; workers help when batches need heavy decoding.
    num_workers: int = 0
    # Page-locked batches, so the trainer's non_blocking copy to the GPU overlaps compute;
    # null: exactly when CUDA is available.
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    drop_last: bool = False
    cache_limit: int | str | None = None
    predownload: int | None = None
    validate_hash: str | None = None
    keep_zip: bool = False
    download_retry: int = 2
    storage_options: dict[str, Any] | None = None
    allow_unsafe: bool = False
    # Document masking: mark each token's document (batches get "sequence_id") from the eos
    # token data_prep ends every document with. An id, or "auto" for meta.json's eos_id. Shards
    # with their own sequence_id column keep it.
    sequence_id_from_eos: int | str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (DictConfig, ListConfig)):
                setattr(self, f.name, OmegaConf.to_container(value, resolve=True))
        for name in ("remote", "local", "train_split", "eval_split", "validate_hash"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"data.{name} must be a string, got {value!r}")
        if not self.train_split:
            raise ValueError("data.train_split must name the training split folder (e.g. train)")
        if self.streams is None and self.remote is None and self.local is None:
            raise ValueError(
                "data.remote is required: a local MDS folder (e.g. data/demo/mds) or a URL "
                "(s3://bucket/mds), with train/ and val/ sub-folders; or set data.streams"
            )
        if self.streams is not None:
            if self.remote is not None:
                raise ValueError(
                    "set data.remote or data.streams, not both: with data.streams add "
                    "data.remote=null (its default is the demo dataset) and set "
                    "tokenizer=<path or URL of tokenizer.json>"
                )
            if not isinstance(self.streams, Mapping) or not self.streams:
                raise ValueError("data.streams must map stream names to {remote, local, ...}")
            for name, spec in self.streams.items():
                self._stream(name, spec)  # validates
        if self.eval_datasets is not None:
            if not self.eval_split:
                raise ValueError(
                    "data.eval_datasets needs data.eval_split, the split folder to read"
                )
            if not isinstance(self.eval_datasets, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.eval_datasets.items()
            ):
                raise ValueError(
                    "data.eval_datasets must map labels to MDS folders or URLs, "
                    f"e.g. {{code: s3://bucket/code/mds}}; got {self.eval_datasets!r}"
                )
            if self.eval_split in self.eval_datasets:
                raise ValueError(
                    f"data.eval_datasets label {self.eval_split!r} is taken by the main data's "
                    "eval split; choose another label"
                )
        if self.pin_memory is None:
            self.pin_memory = torch.cuda.is_available()
        for name in ("shuffle", "pin_memory", "drop_last", "keep_zip", "allow_unsafe"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"data.{name} must be true or false, got {getattr(self, name)!r}")
        check_int("data.shuffle_seed", self.shuffle_seed, minimum=0)
        check_int("data.num_workers", self.num_workers, minimum=0)
        check_int("data.download_retry", self.download_retry, minimum=0)
        for name in ("shuffle_block_size", "epoch_size", "prefetch_factor"):
            check_int(f"data.{name}", getattr(self, name), minimum=1, optional=True)
        check_int("data.predownload", self.predownload, minimum=0, optional=True)
        if self.prefetch_factor is not None and self.num_workers == 0:
            raise ValueError("data.prefetch_factor needs data.num_workers > 0 (or set it to null)")
        if self.validate_hash is not None and not is_hash(self.validate_hash):
            raise ValueError(
                f"data.validate_hash={self.validate_hash!r} is not a hash name; use one listed "
                "in the index (e.g. xxh64, sha1) or null"
            )
        if self.cache_limit is not None:
            parse_size(self.cache_limit, "data.cache_limit")
        eos = self.sequence_id_from_eos
        if (
            eos is not None
            and eos != "auto"
            and (isinstance(eos, bool) or not isinstance(eos, int) or eos < 0)
        ):
            raise ValueError(
                f"data.sequence_id_from_eos must be null, a token id or 'auto' (meta.json's "
                f"eos_id), got {eos!r}"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ValueError("data.storage_options must be a mapping of fsspec options")

    def _stream(self, name: str, spec: Any, shares: bool = True) -> Stream:
        where = f"data.streams.{name}"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where} must be a mapping with keys {_STREAM_KEYS}")
        unknown = sorted(set(spec) - set(_STREAM_KEYS))
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {unknown}; allowed: {list(_STREAM_KEYS)} (the split "
                "comes from data.train_split / data.eval_split)"
            )
        args = dict(spec)
        if args.get("local") is None and self.local is not None:
            args["local"] = join_url(self.local, name)
        if not shares:
            args = {k: v for k, v in args.items() if k in ("remote", "local")}
        try:
            return Stream(**args)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None

    @property
    def meta_url(self) -> str | None:
        """Where data_prep describes the dataset (vocab_size, eos_id, ...): <remote>/meta.json."""
        return None if self.remote is None else join_url(self.remote, "meta.json")

    def meta(self) -> dict[str, Any] | None:
        """The content of `meta_url`, or None when there is none (data not from data_prep)."""
        if self.meta_url is None:
            return None
        try:
            with open_url(self.meta_url, "r", **(self.storage_options or {})) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def eos_id(self) -> int | None:
        """The token id that ends documents, if `sequence_id_from_eos` asks for document ids."""
        if self.sequence_id_from_eos != "auto":
            return self.sequence_id_from_eos
        if self.remote is None:
            raise ValueError(
                "data.sequence_id_from_eos=auto reads <remote>/meta.json, but data.remote is not "
                "set; give the eos token id instead"
            )
        meta = self.meta()
        if meta is None:
            raise ValueError(
                f"data.sequence_id_from_eos=auto: {self.meta_url} not found (data_prep writes "
                "it); give the eos token id instead"
            )
        eos_id = meta.get("eos_id")
        if not isinstance(eos_id, int):
            raise ValueError(f"data.sequence_id_from_eos=auto: {self.meta_url} records no eos_id")
        return eos_id

    def stream_list(self, training: bool) -> list[Stream] | None:
        """The configured streams (without their epoch shares unless ``training``), or None."""
        if self.streams is None:
            return None
        return [self._stream(name, spec, shares=training) for name, spec in self.streams.items()]


def build_dataloader(
    cfg: DataConfig,
    split: str,
    batch_size: int,
    max_seq_len: int | None,
    *,
    shuffle: bool | None = None,
    data_parallel: tuple[int, int] | None = None,
) -> StreamingDataLoader:
    """This rank's loader of ``split`` (see the module docstring for the trainer contract).

    Args:
        cfg: the data config.
        split: split folder to read (``cfg.train_split`` or ``cfg.eval_split``).
        batch_size: samples per rank per batch.
        max_seq_len: cut longer rows to this many tokens; None keeps them whole.
        shuffle: override; default ``cfg.shuffle`` for the training split, False otherwise.
        data_parallel: (rank, size) among the data-parallel readers (the strategy's); default
            torchrun's RANK and WORLD_SIZE.
    """
    if not isinstance(cfg, DataConfig):
        raise TypeError(f"cfg must be a DataConfig, got {type(cfg).__name__}")
    if not isinstance(split, str) or not split:
        raise ValueError(f"split must name a split folder, got {split!r}")
    check_int("batch_size", batch_size, minimum=1)
    training = split == cfg.train_split
    dataset = StreamingTextDataset(
        remote=cfg.remote if cfg.streams is None else None,
        local=cfg.local if cfg.streams is None else None,
        split=split,
        streams=cfg.stream_list(training),
        shuffle=(cfg.shuffle and training) if shuffle is None else shuffle,
        shuffle_seed=cfg.shuffle_seed,
        shuffle_block_size=cfg.shuffle_block_size,
        batch_size=batch_size,
        epoch_size=cfg.epoch_size if training else None,
        cache_limit=cfg.cache_limit,
        predownload=cfg.predownload,
        validate_hash=cfg.validate_hash,
        keep_zip=cfg.keep_zip,
        download_retry=cfg.download_retry,
        storage_options=cfg.storage_options,
        allow_unsafe=cfg.allow_unsafe,
        max_seq_len=max_seq_len,
        eos_id=cfg.eos_id(),
        data_parallel=data_parallel,
    )
    return StreamingDataLoader(
        dataset,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory,
        prefetch_factor=cfg.prefetch_factor,
        drop_last=cfg.drop_last,
    )


def build_eval_dataloaders(
    cfg: DataConfig,
    batch_size: int,
    max_seq_len: int | None,
    data_parallel: tuple[int, int] | None = None,
) -> dict[str, StreamingDataLoader]:
    """Every evaluation loader by label: the main data's `eval_split`, then `eval_datasets`."""
    if not cfg.eval_split:
        return {}
    loaders = {
        cfg.eval_split: build_dataloader(
            cfg, cfg.eval_split, batch_size, max_seq_len, data_parallel=data_parallel
        )
    }
    for label, remote in (cfg.eval_datasets or {}).items():
        other = replace(cfg, remote=remote, local=None, streams=None, eval_datasets=None)
        loaders[label] = build_dataloader(
            other, cfg.eval_split, batch_size, max_seq_len, data_parallel=data_parallel
        )
    return loaders
