"""One process on one device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from llmfoundry.distributed.base import Strategy, materialize, resolve_device
from llmfoundry.distributed.mesh import ParallelDims, parallel_dims
from llmfoundry.distributed.parallelize import apply_plan


class SingleDevice(Strategy):
    """One process on one device: every axis of the mesh 1 (`parallelism` may say so; any
    other size is refused in one line, naming the strategy that takes it)."""

    name = "single"

    def __init__(
        self, device: str = "auto", parallelism: Mapping[str, Any] | ParallelDims | None = None
    ) -> None:
        self.device = resolve_device(device)
        self.dims = parallel_dims(parallelism, 1, self.name)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        apply_plan(model)
        return materialize(model, self.device)
