"""A tiny real training run for algorithm tests, and probes that watch it."""

from __future__ import annotations

import functools

import torch

from llmfoundry.trainer import Algorithm, Event, LoggerDestination, Trainer
from tests.trainer.conftest import tiny_model, token_batches


def make_trainer(tmp_path, batches=None, **kwargs) -> Trainer:
    batches = batches if batches is not None else token_batches(4, 4)
    kwargs.setdefault("max_duration", f"{len(batches)}ba")
    kwargs.setdefault("optimizer", functools.partial(torch.optim.SGD, lr=0.1))
    return Trainer(model=tiny_model(), train_dataloader=batches, run_dir=tmp_path, **kwargs)


class Metrics(LoggerDestination):
    def __init__(self) -> None:
        self.logged: list[tuple[int, str, float]] = []

    def log_metrics(self, metrics, step):
        self.logged += [(step, key, value) for key, value in metrics.items()]

    def values(self, key: str) -> list[float]:
        return [float(value) for _, name, value in self.logged if name == key]  # DeviceScalar too


class At(Algorithm):
    """Runs `fn(state)` at `event`; placed in the algorithm list to run before or after others."""

    def __init__(self, event: Event, fn) -> None:
        self.event, self.fn = event, fn

    def match(self, event, state):
        return event is self.event

    def apply(self, event, state, logger):
        self.fn(state)
