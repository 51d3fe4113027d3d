"""The ``data`` config group -> this rank's train and eval loaders, for any dataset.

A data config (``conf/data/*.yaml``) is one node: a ``_partial_: true`` dataset target (any
:class:`~llmfoundry.data.streaming.epochs.EpochDataset`: ``StreamingTextDataset`` for MDS
shards, ``MemmapTokens`` for a token file) with its own arguments, plus the keys read here:

- :class:`DataSplits`: ``train_split``, ``eval_split`` and ``eval_datasets``;
- the loader's (:class:`~llmfoundry.data.streaming.StreamingDataLoader`): ``num_workers``,
  ``pin_memory``, ``prefetch_factor``, ``drop_last``, ``timeout``.

The builder supplies the rest of the dataset's arguments: ``split``, ``batch_size``,
``max_seq_len``, ``data_parallel``, ``evaluation=True`` for the eval splits, and under
tensor or context parallelism ``pad_to_multiple_of`` (rows padded to a multiple of tp, and
of 2 cp). Each setting and its default is defined once, in the signature that takes it; the
config schema (llmfoundry/config/schema.py) checks the node against those signatures
(``group_hints``).

``eval_datasets`` adds eval sets by label, each read from ``eval_split``: a remote (the same
dataset kind, every other argument as the main data's), a mapping of arguments to change, or a
dataset node of its own (with ``_target_``). A node that sets none of remote/local/streams
reads the group's remote. An entry that names any of remote/local/streams takes none of the
main data's, so it never caches in the main data's ``local`` (both hold an ``eval_split``
folder): its cache is its own ``local``, else the default per-remote temp folder (also where a
local folder of compressed shards is decompressed).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from llmfoundry.data.streaming import EpochDataset, StreamingDataLoader
from llmfoundry.utils.errors import UserError

__all__ = ["DataLoaders", "DataSplits", "build_loaders", "group_hints", "splits_of"]

_SOURCE_KEYS = ("remote", "local", "streams")


@dataclass(frozen=True)
class DataSplits:
    """Which splits the run reads.

    Args:
        train_split: split the model trains on.
        eval_split: split evaluated every eval_interval (reported as eval/<eval_split>/...);
            None: no evaluation.
        eval_datasets: more eval sets by label, ``{label: remote | {args} | dataset node}``,
            reported as eval/<label>/<metric> (module docstring).
    """

    train_split: str = "train"
    eval_split: str | None = "val"
    eval_datasets: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.train_split, str) or not self.train_split:
            raise UserError("data.train_split must name the training split (e.g. train)")
        if self.eval_split is not None and not isinstance(self.eval_split, str):
            raise UserError(
                f"data.eval_split must be a split name or null, not {self.eval_split!r}"
            )
        if self.eval_datasets is None:
            return
        if not self.eval_split:
            raise UserError("data.eval_datasets needs data.eval_split, the split to read")
        if not isinstance(self.eval_datasets, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (str, Mapping))
            for k, v in self.eval_datasets.items()
        ):
            raise UserError(
                "data.eval_datasets must map labels to datasets (a folder or URL, or a mapping "
                f"of dataset arguments), e.g. {{code: s3://bucket/code/mds}}; got "
                f"{self.eval_datasets!r}"
            )
        if self.eval_split in self.eval_datasets:
            raise UserError(
                f"data.eval_datasets label {self.eval_split!r} is taken by the main data's "
                "eval split; choose another label"
            )


def splits_of(group: Mapping[str, Any]) -> DataSplits:
    """The group's splits, checked (also by the config check, before anything is built)."""
    values = OmegaConf.to_container(group, resolve=True) if isinstance(group, DictConfig) else group
    return DataSplits(**{f.name: values[f.name] for f in fields(DataSplits) if f.name in values})


def _loader_parameters() -> dict[str, inspect.Parameter]:
    params = inspect.signature(StreamingDataLoader.__init__).parameters
    return {k: p for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def group_hints() -> dict[str, Any]:
    """Type of each key of the data group that is not the dataset's (for the config schema)."""
    hints = typing.get_type_hints(DataSplits)
    loader = typing.get_type_hints(StreamingDataLoader.__init__)
    return hints | {k: loader.get(k, Any) for k in _loader_parameters()}


@dataclass(frozen=True)
class DataLoaders:
    """This rank's training loader and its evaluation loaders by label."""

    train: StreamingDataLoader
    evals: dict[str, StreamingDataLoader]

    @property
    def train_dataset(self) -> EpochDataset:
        return self.train.streaming_dataset


def build_loaders(
    group: Mapping[str, Any],
    *,
    batch_size: int,
    eval_batch_size: int,
    max_seq_len: int | None,
    data_parallel: tuple[int, int] | None = None,
    pad_to_multiple_of: int = 1,
) -> DataLoaders:
    """Build the ``data`` group's loaders: ``train_split`` and every eval set.

    Args:
        group: the data config node (module docstring).
        batch_size, eval_batch_size: samples per rank per batch, training and evaluation.
        max_seq_len: tokens per row the model takes (longer rows are cut, or windows are this
            long); None keeps rows whole.
        data_parallel: (rank, size) among the data-parallel readers (the strategy's).
        pad_to_multiple_of: the batches' widths are a multiple of this (the strategy's tp:
            sequence parallelism splits each row; times 2 cp: context parallelism cuts it into
            2 cp chunks); passed to the datasets only when above 1, so a dataset of one's own
            needs the argument only to be trained tensor- or context-parallel.
    """
    values = (
        OmegaConf.to_container(group, resolve=True)
        if isinstance(group, DictConfig)
        else dict(group)
    )
    if not isinstance(values.get("_target_"), str):
        raise UserError(
            "the data config has no _target_: name the dataset class (e.g. "
            "llmfoundry.data.StreamingTextDataset, see conf/data/mds.yaml)"
        )
    splits = splits_of(values)
    values = {k: v for k, v in values.items() if k not in vars(splits)}
    loader_args = {k: values.pop(k) for k in _loader_parameters() if k in values}
    dataset = _factory(values)

    def loader(
        make: Callable[..., EpochDataset], split: str, evaluation: bool
    ) -> StreamingDataLoader:
        padding = {"pad_to_multiple_of": pad_to_multiple_of} if pad_to_multiple_of > 1 else {}
        built = make(
            split=split,
            batch_size=eval_batch_size if evaluation else batch_size,
            max_seq_len=max_seq_len,
            data_parallel=data_parallel,
            evaluation=evaluation,
            **padding,
        )
        # Evaluation reads every sample once: drop_last shapes training batches only.
        args = {**loader_args, "drop_last": False} if evaluation else loader_args
        return StreamingDataLoader(built, **args)

    train = loader(dataset, splits.train_split, evaluation=False)
    evals = {}
    if splits.eval_split:
        evals[splits.eval_split] = loader(dataset, splits.eval_split, evaluation=True)
        for label, spec in (splits.eval_datasets or {}).items():
            evals[label] = loader(_factory(_eval_node(values, spec)), splits.eval_split, True)
    return DataLoaders(train, evals)


def _eval_node(main: dict[str, Any], spec: str | Mapping[str, Any]) -> dict[str, Any]:
    """The dataset node of one ``eval_datasets`` entry (module docstring)."""
    if isinstance(spec, str):
        spec = {"remote": spec}
    spec = dict(spec)
    if "_target_" in spec:
        node = {"_partial_": True, **spec}
    else:
        node = dict(main)
        if any(k in spec for k in _SOURCE_KEYS):  # a new source replaces the main one whole
            node = {k: v for k, v in node.items() if k not in _SOURCE_KEYS}
        node.update(spec)
    if not any(node.get(k) is not None for k in _SOURCE_KEYS):
        node["remote"] = main.get("remote")
    return node


def _factory(node: dict[str, Any]) -> Callable[..., EpochDataset]:
    """The dataset class of ``node`` with its configured arguments bound (Hydra's partial)."""
    if not node.get("_partial_", False):
        raise UserError(
            f"data: the dataset node {node['_target_']} needs _partial_: true (the builder "
            "gives split, batch_size, max_seq_len and data_parallel)"
        )
    return instantiate(node, _convert_="all")
