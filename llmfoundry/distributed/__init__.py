"""Distributed strategies: applied to a model from outside; model code knows nothing of them."""

from llmfoundry.distributed.single import SingleDevice, Strategy, resolve_device

__all__ = ["SingleDevice", "Strategy", "resolve_device"]
