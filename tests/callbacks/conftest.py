"""A tiny real training run, and a logger destination that records what is logged."""

from __future__ import annotations

import functools

import torch

from llmfoundry.trainer import LoggerDestination, Trainer
from tests.trainer.conftest import tiny_model, token_batches


class Recorder(LoggerDestination):
    """Keeps every log call as (step, metrics)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((step, dict(metrics)))

    def values(self, name: str) -> list[tuple[int, float]]:
        return [(step, float(m[name])) for step, m in self.calls if name in m]  # DeviceScalar too


def make_trainer(
    tmp_path, n_batches: int = 4, batch_size: int = 4, lr: float = 0.1, **kwargs
) -> Trainer:
    """mpt with d_model 32 on random tokens (seq 16, so batch_size * 16 tokens per batch)."""
    kwargs.setdefault("train_dataloader", token_batches(n_batches, batch_size))
    kwargs.setdefault("max_duration", f"{n_batches}ba")
    kwargs.setdefault("model", tiny_model())
    return Trainer(
        optimizer=functools.partial(torch.optim.SGD, lr=lr),
        run_dir=tmp_path,
        **kwargs,
    )
