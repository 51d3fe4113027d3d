"""One process on one device."""

from __future__ import annotations

import torch

from llmfoundry.distributed.base import Strategy, materialize, resolve_device
from llmfoundry.distributed.parallelize import apply_plan


class SingleDevice(Strategy):
    """One process on one device."""

    def __init__(self, device: str = "auto") -> None:
        self.device = resolve_device(device)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        apply_plan(model)
        return materialize(model, self.device)
