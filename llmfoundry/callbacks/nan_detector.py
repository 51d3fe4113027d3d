"""Stop at the first batch whose loss is NaN or infinite, naming it.

A diverged run otherwise goes on for hours, logging ``nan`` and saving checkpoints full of NaN
weights. Reading the loss on the host every batch would make the host wait for the device every
batch (the trainer keeps the loss on the device, `DeviceScalar`), so the check is split:

- every batch, at AFTER_TRAIN_BATCH, ``torch.isfinite`` of the loss updates, on the device, the
  index of the first non-finite batch since the last look (no host sync);
- every `check_every` batches (at that batch's AFTER_TRAIN_BATCH, before its optimizer step),
  when training stops, at each epoch's end and at the end of training, the host reads it (one
  sync) and raises naming the batch.

With ``check_every=1`` no non-finite step is ever taken: the weights in memory and in every
checkpoint stay finite, at the cost of one host sync per batch. With the default, up to
`check_every` - 1 steps may be taken after the first non-finite one (their weights, and a
checkpoint saved among them, are not finite; the error says so and names the batch to resume
before), and the check costs one sync per `check_every` batches, which the console logger's
interval usually spends anyway.
"""

from __future__ import annotations

import torch

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.utils.errors import UserError


class NaNDetector(Callback):
    def __init__(self, check_every: int = 10) -> None:
        if check_every < 1:
            raise UserError(f"nan_detector.check_every must be >= 1 batches, got {check_every}")
        self.check_every = check_every
        # On the device: the loss of the first non-finite batch since the last look, and its
        # position in `_batches` (-1: none).
        self._first: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        # Host: (batch, epoch, batch of the epoch, first sample, last sample) of each batch
        # since the last look, 1-based batches, for the message.
        self._batches: list[tuple[int, int, int, int, int]] = []

    def after_train_batch(self, state: State, logger: Logger) -> None:
        if state.batch_loss is None:
            return
        loss = state.batch_loss.tensor
        if self._first is None:
            self._first = torch.full((), -1, dtype=torch.long, device=loss.device)
            self._loss = torch.zeros((), dtype=loss.dtype, device=loss.device)
        new = (self._first < 0) & ~torch.isfinite(loss)
        self._first = torch.where(new, len(self._batches), self._first)
        self._loss = torch.where(new, loss, self._loss)
        ts = state.timestamp
        samples = state.batch["labels"].shape[0] * state.dp_size
        self._batches.append(
            (ts.batch + 1, ts.epoch, ts.batch_in_epoch + 1, ts.sample, ts.sample + samples - 1)
        )
        if (ts.batch + 1) % self.check_every == 0:
            self._check(step_taken=False)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if state.stop_training:
            self._check(step_taken=True)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._check(step_taken=True)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._check(step_taken=True)

    def _check(self, step_taken: bool) -> None:
        """Read the device's verdict on the batches since the last look (one host sync)."""
        if not self._batches:
            return
        first, loss = torch.stack([self._first.double(), self._loss.double()]).tolist()
        batches, self._batches = self._batches, []
        self._first.fill_(-1)
        if first < 0:
            return
        batch, epoch, in_epoch, start, end = batches[int(first)]
        last = batches[-1][0]
        if step_taken or last != batch:
            done = (
                f"the optimizer steps of batches {batch} to {last} were taken (checked every "
                f"{self.check_every} batches), so the weights are not finite: resume from a "
                f"checkpoint saved before batch {batch}. "
            )
        else:
            done = "the optimizer step was not taken. "
        raise FloatingPointError(
            f"the training loss is {loss} at batch {batch} (epoch {epoch}, batch {in_epoch} of "
            f"the epoch, samples {start} to {end} of the run); {done}Training diverged: lower "
            "optimizer.lr, lengthen the scheduler warmup, enable algorithms=[gradient_clipping], "
            "use fp32 or amp_bf16 rather than amp_fp16, or check this batch's data (a batch "
            "whose labels are all -100 has no loss: nan)"
        )
