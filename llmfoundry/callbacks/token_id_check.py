"""Debug mode for data: check every batch's token ids against the model's vocabulary.

The startup check (llmfoundry/data/text.py `check_vocab`) trusts the dataset's
``meta.json``; this callback checks the ids themselves, batch by batch, for data without
metadata or suspected of corruption. An id outside ``[0, vocab_size)`` otherwise surfaces as an
IndexError inside the embedding, or a device-side assert on GPU that names nothing. The check is
one min/max reduction per batch on the device, but reading the result waits for the device, so
it is opt-in: ``callbacks=[...,token_id_check]``.
"""

from __future__ import annotations

import torch

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.utils.errors import UserError


class TokenIdCheck(Callback):
    """Raise, naming the batch, the id and the fix, when a token id does not fit the model.

    Args:
        vocab_size: the model's vocabulary (``${model.vocab_size}``).
        key: the batch key holding the token ids.
    """

    def __init__(self, vocab_size: int, key: str = "input_ids") -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise UserError(f"vocab_size must be a positive integer, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self.key = key

    def after_dataloader(self, state: State, logger: Logger) -> None:
        self._check(state, "training")

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        self._check(state, f"eval set {state.eval_name!r}")

    def _check(self, state: State, where: str) -> None:
        ids = state.batch[self.key]
        low, high = torch.aminmax(ids)
        low, high = int(low), int(high)
        if low >= 0 and high < self.vocab_size:
            return
        bad = high if high >= self.vocab_size else low
        ts = state.timestamp
        raise UserError(
            f"{where} batch {ts.batch + 1} (epoch {ts.epoch}) holds token id {bad}, outside the "
            f"model's vocabulary [0, {self.vocab_size}); the data was tokenized with another "
            "tokenizer or is corrupt: set model.vocab_size to the tokenizer's size, or rewrite "
            "the data with data_prep/"
        )
