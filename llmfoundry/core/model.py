"""What the trainer needs of a model, and of an eval set: the whole contract, in one place.

A trainable model is an ``nn.Module`` with

- ``forward(batch)``: outputs for a batch, a mapping of tensors as the train loader yields it
  (``input_ids`` and ``labels`` [batch, seq], maybe ``sequence_id``); the trainer calls the
  (wrapped) module itself, ``model(batch)``, so DDP and FSDP see the forward;
- ``loss(outputs, batch)``: the mean next-token loss over the positions whose label (shifted by
  one: position t predicts ``labels[:, t + 1]``) is not -100, and 0 when none counts. The
  trainer weights each microbatch by that count (``metrics.loss_token_count``), so a large batch
  split into microbatches or over ranks gives the same update. Under context parallelism the
  batch is a rank's part of each sequence and carries ``targets`` (already shifted over the
  whole sequence) instead of ``labels``: ``loss.targets_of(batch)`` reads either;
- optionally ``eval_metrics(device)``: a fresh `Metrics` for an eval set; default
  `LanguageMetrics`, which reads the outputs as logits [batch, seq, vocab];
- optionally ``train_metrics()``: the model's own numbers for the training batch just done
  (a name -> float or `DeviceScalar` mapping; an MoE's router losses and expert load), which
  the trainer logs after each batch beside ``loss/train``. Return `DeviceScalar`s for values
  still on the device: loggers read them in one wait when they write, not every batch.

Every model family's model (`llmfoundry.models.families`: MPT, Llama) is one (its forward also takes ``input_ids`` directly, as
generation calls it). Any other module can be adapted in a few lines, and trained from the
config with ``model=custom`` (llmfoundry/models/custom.py): README "Your own model".

An eval set is a plain loader (the model's metrics), or an `EvalSet` naming its own metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from llmfoundry.core.metrics import DeviceScalar, LanguageMetrics
from llmfoundry.utils.errors import UserError

Batch = Mapping[str, torch.Tensor]


class Metrics(Protocol):
    """Evaluation metrics accumulated over one eval set's batches.

    ``totals`` holds sums only (the trainer all-reduces it across ranks before `compute`).
    ``update`` must leave out rows whose ``sample_mask`` [batch] is False: they are samples a
    loader repeated to give every rank the same number of batches.
    """

    totals: torch.Tensor

    def update(self, outputs: Any, batch: Batch, sample_mask: torch.Tensor) -> None: ...

    def compute(self) -> dict[str, float]: ...


MetricsFactory = Callable[[torch.device], Metrics]


@dataclass(frozen=True)
class EvalSet:
    """An eval loader with the metrics it is scored by (e.g. a classification set's accuracy)."""

    dataloader: Iterable[Batch]
    metrics: MetricsFactory


def loss_fn(model: torch.nn.Module) -> Callable[[Any, Batch], torch.Tensor]:
    """The model's ``loss(outputs, batch)``, taken before a strategy wraps the model."""
    loss = getattr(model, "loss", None)
    if not callable(loss):
        raise UserError(
            f"{type(model).__name__} has no loss(outputs, batch) method, which the trainer "
            "calls after forward(batch); add one (see llmfoundry/core/model.py)"
        )
    return loss


def train_metrics_fn(
    model: torch.nn.Module,
) -> Callable[[], Mapping[str, float | DeviceScalar]] | None:
    """The model's ``train_metrics``, taken before a strategy wraps the model; None if none."""
    return getattr(model, "train_metrics", None)


def metrics_factory(model: torch.nn.Module) -> MetricsFactory:
    """The model's ``eval_metrics``, else `LanguageMetrics`."""
    return getattr(model, "eval_metrics", LanguageMetrics)


def eval_set(value: Iterable[Batch] | EvalSet, default: MetricsFactory) -> EvalSet:
    """An eval set as given, or a plain loader scored by the model's metrics."""
    return value if isinstance(value, EvalSet) else EvalSet(value, default)
