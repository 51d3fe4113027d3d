"""State: everything the loop, algorithms and callbacks share, in one object.

Algorithms and callbacks read and change the state (the batch, the loss, the model) instead of
reaching into the trainer; the trainer owns no other mutable training data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmfoundry.core.metrics import DeviceScalar
from llmfoundry.core.precision import Precision
from llmfoundry.core.time import Time, Timestamp, TimeUnit


@dataclass
class State:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    max_duration: Time
    run_dir: Path
    device: torch.device
    # Autocast and loss scaling of the step; `precision.name` is the setting ("amp_bf16"; auto
    # resolved for the device), and
    # its state_dict (amp_fp16's grad scaler) is saved in checkpoints under "scaler".
    precision: Precision = field(default_factory=lambda: Precision("fp32", torch.device("cpu")))
    # This process's place among all training processes (loggers print on rank 0 only), and
    # the data-parallel ranks among them: how many different parts of each batch are read.
    rank: int = 0
    world_size: int = 1
    dp_size: int = 1
    seed: int = 17
    train_dataloader: Any = None
    eval_dataloaders: dict[str, Any] = field(default_factory=dict)
    # Number of batches in one epoch of the train dataloader, when it is known.
    dataloader_len: int | None = None
    timestamp: Timestamp = field(default_factory=Timestamp)
    # The current batch (train or eval) and what the model and loss made of it.
    batch: dict[str, torch.Tensor] | None = None
    outputs: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    # The whole batch's loss, averaged over its loss tokens (NaN if it had none), from
    # AFTER_TRAIN_BATCH on; kept on the device so that training never waits for it: read it as
    # `train_loss` only where a number is needed (log intervals), or check `.tensor` on the device.
    batch_loss: DeviceScalar | None = None
    # Name of the evaluation set being run, and metrics by "eval/<name>/<metric>".
    eval_name: str | None = None
    eval_metrics: dict[str, float] = field(default_factory=dict)
    # Set by callbacks (early stopping, preemption) to end the run after the current batch.
    stop_training: bool = False
    # Per-microbatch sizes of the batch being trained (set by the trainer, read by callbacks).
    device_train_microbatch_size: int | None = None
    # What the engine runs on each event; kept here so checkpoints can save their state.
    algorithms: list[Any] = field(default_factory=list)
    callbacks: list[Any] = field(default_factory=list)
    # Free-form config (plain containers) saved with checkpoints for provenance.
    config: dict[str, Any] = field(default_factory=dict)
    # The distributed strategy (llmfoundry.distributed): checkpoints get and set model and
    # optimizer state through it.
    strategy: Any = None

    @property
    def train_loss(self) -> float | None:
        """The batch's loss as a number: the first read of each batch waits for the device."""
        return None if self.batch_loss is None else float(self.batch_loss)

    def elapsed(self, duration: Time, timestamp: Timestamp | None = None) -> float:
        """How much of `duration` has passed at `timestamp` (default: now), as a fraction.

        Epochs count fractionally within an epoch when the dataloader length is known, so
        a schedule over ``1ep`` moves every batch rather than jumping at epoch ends.
        """
        ts = timestamp or self.timestamp
        if duration.value == 0:
            return 1.0
        if duration.unit is TimeUnit.DURATION:
            return self.elapsed(self.max_duration, ts) / duration.value
        if duration.unit is TimeUnit.EPOCH:
            done = float(ts.epoch)
            if self.dataloader_len:
                done += ts.batch_in_epoch / self.dataloader_len
            return done / duration.value
        return ts.get(duration.unit) / duration.value

    def crossed(self, interval: Time, before: Timestamp) -> bool:
        """Whether time moved past a multiple of `interval` between `before` and now.

        This is how periodic work (evaluation, checkpoints) is scheduled in any unit: a
        token-based interval fires on the batch that passes the boundary.
        """
        if interval.value == 0:
            return False
        if interval.unit is TimeUnit.EPOCH:
            # Epoch intervals fire only at epoch ends, never mid-epoch.
            now, then = self.timestamp.epoch, before.epoch
        else:
            now, then = self.elapsed(interval), self.elapsed(interval, before)
            return math.floor(now + 1e-9) > math.floor(then + 1e-9)
        return now // interval.value > then // interval.value

    @property
    def finished(self) -> bool:
        return self.stop_training or self.elapsed(self.max_duration) >= 1.0
