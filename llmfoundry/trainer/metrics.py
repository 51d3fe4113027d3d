"""Language-model evaluation metrics, accumulated over batches and summed over processes."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def loss_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Positions that count toward the loss: every label after the first that is not ignored.

    A tensor on the labels' device, so counting needs no host synchronisation.
    """
    return (labels[:, 1:] != IGNORE_INDEX).sum()


class LanguageMetrics:
    """Token-weighted cross-entropy, perplexity and next-token accuracy."""

    def __init__(self, device: torch.device) -> None:
        # [sum of loss, number of loss tokens, number of correct predictions]
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        logits = logits[:, :-1].float()
        targets = labels[:, 1:]
        mask = targets != IGNORE_INDEX
        loss_sum = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        correct = ((logits.argmax(-1) == targets) & mask).sum()
        self.totals += torch.stack([loss_sum.double(), mask.sum().double(), correct.double()])

    def compute(self) -> dict[str, float]:
        loss_sum, tokens, correct = self.totals.tolist()
        if tokens == 0:
            raise ValueError("evaluation saw no loss tokens: is the eval split empty?")
        loss = loss_sum / tokens
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "accuracy": correct / tokens}
