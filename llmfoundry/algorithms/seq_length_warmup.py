"""Sequence-length warmup: train on short sequences first, growing them to full length.

Early in training the model learns mostly local statistics, which short contexts teach as well
as long ones at a fraction of the cost; short sequences also make the first, least stable steps
gentler (Li et al. 2022, "The Stability-Efficiency Dilemma").

Each batch is truncated (every tensor cut to its first `length` columns), not reshaped, so the
number of samples per batch is unchanged and the tokens past `length` are dropped for that step.
The trainer counts the tokens of the batch it trains on, so during the warmup every batch adds
fewer tokens to the timestamp than a full one: a run measured in tokens ("tok" max_duration or
intervals) takes more batches, and a warmup `duration` in tokens counts trained tokens.
"""

from __future__ import annotations

from llmfoundry.core.engine import Algorithm, Logger
from llmfoundry.core.events import Event
from llmfoundry.core.state import State
from llmfoundry.core.time import Time, TimeString
from llmfoundry.utils.errors import UserError


class SeqLengthWarmup(Algorithm):
    """Truncate each training batch to a length growing linearly from `min_seq_len` to
    `max_seq_len` (default: the batch's own length) over `duration`, in steps of `step_size`
    (a multiple of 8 keeps matmul shapes efficient). Evaluation batches are not touched."""

    def __init__(
        self,
        duration: TimeString = "0.3dur",
        min_seq_len: int = 8,
        max_seq_len: int | None = None,
        step_size: int = 8,
    ) -> None:
        self.duration = Time.parse(duration)
        if self.duration.value == 0:
            raise UserError("SeqLengthWarmup duration must be positive, e.g. '0.3dur' or '1000ba'")
        if min_seq_len < 2:
            raise UserError(
                f"SeqLengthWarmup min_seq_len must be >= 2 (a shorter sequence has no next-token "
                f"target), got {min_seq_len}"
            )
        if max_seq_len is not None and max_seq_len < min_seq_len:
            raise UserError(
                f"SeqLengthWarmup max_seq_len={max_seq_len} is below min_seq_len={min_seq_len}"
            )
        if step_size < 1:
            raise UserError(f"SeqLengthWarmup step_size must be >= 1, got {step_size}")
        self.min_seq_len = min_seq_len
        self.max_seq_len = max_seq_len
        self.step_size = step_size

    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_DATALOADER

    def length(self, state: State, batch_len: int) -> int:
        """The sequence length for the batch about to be trained."""
        full = min(self.max_seq_len or batch_len, batch_len)
        progress = state.elapsed(self.duration)
        if progress >= 1.0 or full <= self.min_seq_len:
            return full
        grown = int((full - self.min_seq_len) * progress) // self.step_size * self.step_size
        return self.min_seq_len + grown

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        batch_len = state.batch["input_ids"].shape[1]
        length = self.length(state, batch_len)
        if length < batch_len:
            state.batch = {k: v[:, :length].contiguous() for k, v in state.batch.items()}
        logger.log_metrics({"algorithms/seq_length": length})
