"""Language-model evaluation metrics, accumulated over batches and summed over processes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from llmfoundry.core.loss import IGNORE_INDEX, Labels, next_token_scores, targets_of
from llmfoundry.utils.errors import UserError

# Eval batches may carry this bool [batch] key: False marks a sample repeated only to pad the
# last batches, so that every rank reads as many batches as the others.
SAMPLE_MASK = "sample_mask"


def loss_token_count(labels: Labels) -> torch.Tensor:
    """Positions that count toward the loss: every label after the first that is not ignored,
    of labels or of a batch (its `targets` when it carries them: `loss.targets_of`).

    A tensor on the labels' device, so counting needs no host synchronisation.
    """
    if isinstance(labels, torch.Tensor):
        return (labels[:, 1:] != IGNORE_INDEX).sum()
    return (targets_of(labels) != IGNORE_INDEX).sum()


class DeviceScalar:
    """A number still on the device (a batch's loss, a gradient norm), read when needed.

    Reading it (``float()``, formatting) makes the host wait for the device's queued work, once:
    the value is kept, so later reads are free. Logger destinations receive these among plain
    floats and read them when they write (`llmfoundry.loggers.buffered`); checks that can stay
    on the device (NaN detection) use `tensor`.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._value: float | None = None

    def __float__(self) -> float:
        if self._value is None:
            self._value = self.tensor.item()
        return self._value

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __repr__(self) -> str:
        return f"DeviceScalar({float(self)!r})"


def read_all(values: Iterable[Any]) -> None:
    """Read the unread `DeviceScalar`s among `values` with one wait for the device, not one
    each (a destination writing many batches' records at once)."""
    by_device: dict[torch.device, list[DeviceScalar]] = {}
    for value in values:
        if isinstance(value, DeviceScalar) and value._value is None:
            by_device.setdefault(value.tensor.device, []).append(value)
    for unread in by_device.values():
        stacked = torch.stack([v.tensor.detach().double().reshape(()) for v in unread])
        for scalar, number in zip(unread, stacked.tolist(), strict=True):
            scalar._value = number


class LanguageMetrics:
    """Token-weighted cross-entropy, perplexity and next-token accuracy; bits per byte when
    `bytes_per_token` (text bytes per token of the eval split, recorded by data_prep) is given.

    Bits per byte (loss / ln 2 / bytes per token) does not depend on the tokenizer, so runs with
    different vocabularies compare on it.

    Rows whose ``sample_mask`` is False (samples an eval loader repeated only so that every rank
    reads the same number of batches) count nowhere, so the metrics of a split are the same at
    every world size. Each token's loss is summed in float64, so they agree to float64 rounding
    of the sum whatever the split into ranks and batches.
    """

    def __init__(self, device: torch.device, bytes_per_token: float | None = None) -> None:
        # [sum of loss, number of loss tokens, number of correct predictions]
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)
        self.bytes_per_token = bytes_per_token

    def update(
        self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor], sample_mask: torch.Tensor
    ) -> None:
        """Add a batch's sums. Each position's loss and prediction come from the logits in their
        own dtype, chunk by chunk (`next_token_scores`: no float32 copy of the logits; a
        tensor-parallel head's vocabulary-sharded logits are read in place, not gathered)."""
        targets = targets_of(batch)  # a context-parallel rank's part carries them shifted
        losses, predicted = next_token_scores(logits, batch)
        mask = (targets != IGNORE_INDEX) & sample_mask[:, None]
        token_loss = torch.where(mask, losses, 0.0)
        correct = ((predicted == targets) & mask).sum()
        self.totals += torch.stack(
            [token_loss.double().sum(), mask.sum().double(), correct.double()]
        )

    def compute(self) -> dict[str, float]:
        loss_sum, tokens, correct = self.totals.tolist()
        if tokens == 0:
            raise UserError("evaluation saw no loss tokens: is the eval split empty?")
        loss = loss_sum / tokens
        metrics = {
            "loss": loss,
            "perplexity": math.exp(min(loss, 50.0)),
            "accuracy": correct / tokens,
        }
        if self.bytes_per_token:
            metrics["bits_per_byte"] = loss / math.log(2) / self.bytes_per_token
        return metrics
