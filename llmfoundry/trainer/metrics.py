"""Language-model evaluation metrics, accumulated over batches and summed over processes."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# Eval batches may carry this bool [batch] key: False marks a sample repeated only to pad the
# last batches, so that every rank reads as many batches as the others.
SAMPLE_MASK = "sample_mask"


def loss_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Positions that count toward the loss: every label after the first that is not ignored.

    A tensor on the labels' device, so counting needs no host synchronisation.
    """
    return (labels[:, 1:] != IGNORE_INDEX).sum()


class LanguageMetrics:
    """Token-weighted cross-entropy, perplexity and next-token accuracy.

    Rows whose ``sample_mask`` is False (samples an eval loader repeated only so that every rank
    reads the same number of batches) count nowhere, so the metrics of a split are the same at
    every world size. Each token's loss is summed in float64, so they agree to float64 rounding
    of the sum whatever the split into ranks and batches.
    """

    def __init__(self, device: torch.device) -> None:
        # [sum of loss, number of loss tokens, number of correct predictions]
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)

    def update(
        self, logits: torch.Tensor, batch: Mapping[str, torch.Tensor], sample_mask: torch.Tensor
    ) -> None:
        logits = logits[:, :-1].float()
        targets = batch["labels"][:, 1:]
        mask = (targets != IGNORE_INDEX) & sample_mask[:, None]
        token_loss = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.masked_fill(~mask, IGNORE_INDEX).reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        )
        correct = ((logits.argmax(-1) == targets) & mask).sum()
        self.totals += torch.stack(
            [token_loss.double().sum(), mask.sum().double(), correct.double()]
        )

    def compute(self) -> dict[str, float]:
        loss_sum, tokens, correct = self.totals.tolist()
        if tokens == 0:
            raise ValueError("evaluation saw no loss tokens: is the eval split empty?")
        loss = loss_sum / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": correct / tokens}
