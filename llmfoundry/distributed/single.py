"""One process on one device."""

from __future__ import annotations

import torch

from llmfoundry.distributed.base import Strategy, materialize, resolve_device


class SingleDevice(Strategy):
    """One process on one device."""

    def __init__(self, device: str = "auto") -> None:
        self.device = resolve_device(device)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        return materialize(model, self.device)
