"""Stop at the first batch whose loss is NaN or infinite, naming it.

A diverged run otherwise goes on for hours, logging ``nan`` and saving checkpoints full of NaN
weights. The check runs at AFTER_TRAIN_BATCH, on the batch's loss the trainer has already
brought to the host (no extra device synchronization), and before the optimizer step, so the
weights in memory and in every checkpoint stay finite.
"""

from __future__ import annotations

import math

from llmfoundry.trainer.engine import Callback, Logger
from llmfoundry.trainer.state import State


class NaNDetector(Callback):
    def after_train_batch(self, state: State, logger: Logger) -> None:
        loss = state.train_loss
        if loss is None or math.isfinite(loss):
            return
        ts = state.timestamp
        samples = state.batch["input_ids"].shape[0] * state.world_size
        raise FloatingPointError(
            f"the training loss is {loss} at batch {ts.batch + 1} (epoch {ts.epoch}, batch "
            f"{ts.batch_in_epoch + 1} of the epoch, samples {ts.sample} to "
            f"{ts.sample + samples - 1} of the run); the optimizer step was not taken. Training diverged: lower optimizer.lr, "
            "lengthen the scheduler warmup, enable algorithms=[gradient_clipping], use fp32 or "
            "amp_bf16 rather than amp_fp16, or check this batch's data"
        )
