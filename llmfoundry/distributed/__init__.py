"""Distributed strategies: applied to a model from outside; model code knows nothing of them."""

from llmfoundry.distributed.ddp import DDP, unwrap_model
from llmfoundry.distributed.single import SingleDevice, Strategy, materialize, resolve_device

__all__ = ["DDP", "SingleDevice", "Strategy", "materialize", "resolve_device", "unwrap_model"]
