"""The strategy interface and its one-process implementation.

A strategy owns the process group, the device, and how a model built on the meta device is
materialized and wrapped. Data-parallel and sharded strategies implement the same interface, so
the trainer never branches on which one is in use.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from llmfoundry.utils.errors import UserError


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU; anything else is passed to torch.device."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"strategy.device={device!r} but no CUDA device is available; use 'cpu' or 'auto'"
        )
    return resolved


class Strategy:
    """How one training process relates to the others. Subclasses override what differs."""

    rank: int = 0
    world_size: int = 1
    device: torch.device

    def setup(self) -> None:
        """Join the process group (no-op for one process)."""

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Materialize a model built on the meta device, initialize it, and wrap it."""
        raise NotImplementedError

    def sync_context(self, model: torch.nn.Module, sync: bool) -> AbstractContextManager:
        """Wrap one microbatch's forward and backward; with `sync=False` gradients stay local.

        Data-parallel strategies average gradients during the backward of the microbatch run
        with `sync=True` (the last one), overlapping communication with compute.
        """
        del model, sync
        return nullcontext()

    def sync_gradients(self, model: torch.nn.Module) -> None:
        """Average gradients over processes now, for steps whose microbatches all ran unsynced.

        Auto-microbatching defers the averaging until every rank has finished its backward
        without running out of memory, so no rank is left waiting in a collective.
        """
        del model

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over all processes, in place, and return it."""
        return tensor

    def barrier(self) -> None:
        """Wait for all processes."""

    def teardown(self) -> None:
        """Leave the process group cleanly."""


class SingleDevice(Strategy):
    """One process on one device."""

    def __init__(self, device: str = "auto") -> None:
        self.device = resolve_device(device)

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        return materialize(model, self.device)


def materialize(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Allocate a meta-device model on `device` and initialize it (its `init_weights`)."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        model.init_weights()
    return model.to(device)
