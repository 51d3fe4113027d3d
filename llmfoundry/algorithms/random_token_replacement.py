"""Example of a user algorithm: replace a random fraction of input tokens after loading a batch.

It is the template for writing your own: pick an event in `match`, change `state` in `apply`.
Labels are left as they were, so the model learns to predict the true next token from a noisy
context (a simple denoising augmentation). Each rank draws its own noise (seed + rank), and the
generator's state is saved with checkpoints, so a resumed run replaces the same tokens.
"""

from __future__ import annotations

import torch

from llmfoundry.core.engine import Algorithm, Logger
from llmfoundry.core.events import Event
from llmfoundry.core.state import State
from llmfoundry.utils.errors import UserError


class RandomTokenReplacement(Algorithm):
    def __init__(self, probability: float = 0.05, vocab_size: int = 8192, seed: int = 0) -> None:
        if not 0.0 <= probability <= 1.0:
            raise UserError(f"probability must be in [0, 1], got {probability}")
        if vocab_size < 1:
            raise UserError(f"vocab_size must be positive, got {vocab_size}")
        self.probability = probability
        self.vocab_size = vocab_size
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)

    def match(self, event: Event, state: State) -> bool:
        return event in (Event.INIT, Event.AFTER_DATALOADER)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event is Event.INIT:
            self.generator.manual_seed(self.seed + state.rank)
            return
        input_ids = state.batch["input_ids"]
        replace = torch.rand(input_ids.shape, generator=self.generator) < self.probability
        noise = torch.randint(0, self.vocab_size, input_ids.shape, generator=self.generator)
        device = input_ids.device
        replaced = torch.where(replace.to(device), noise.to(device), input_ids)
        state.batch = {**state.batch, "input_ids": replaced}
        logger.log_metrics({"algorithms/replaced_fraction": replace.float().mean().item()})

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
