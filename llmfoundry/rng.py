"""This process's random generators (python, numpy, torch, CUDA): seeding, capturing, restoring.

One module for all three, imported by the trainer and by checkpoints alike, so neither package
reaches into the other for them. States are tensors and plain lists, with no numpy arrays or
numpy scalars, so a checkpoint holding them loads with ``torch.load(weights_only=True)``.

Each process trains on one device, so the CUDA state is that device's generator alone, restored
into whatever device the resumed process uses: a resume on a machine with fewer (or more)
visible GPUs continues each rank's stream. Checkpoints saved before held every visible GPU's
generator in a list; `_cuda_state` picks this device's entry from it.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices) so a run is repeatable."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """The generator states of this process, training on `device` (its CUDA generator, if any)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def load_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` captured, so the run draws the numbers it would have drawn.

    The CUDA state goes to `device`'s generator; one saved without CUDA leaves it as seeded."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = _cuda_state(state.get("cuda"), device) if device.type == "cuda" else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _cuda_state(saved: torch.Tensor | list[torch.Tensor] | None, device: torch.device):
    """`device`'s generator state in a checkpoint's ``cuda`` entry, or None if it has none.

    Old checkpoints saved a list, one state per visible GPU, of which the process drew from
    its own device's: entry `device.index` when the resumed process uses the same index (as
    torchrun's ranks do: LOCAL_RANK), the only entry when one GPU was visible (a process per
    GPU). Past the end of a longer list no entry is this device's, so its generator stays as
    seeded rather than continue another device's stream."""
    if saved is None or isinstance(saved, torch.Tensor):
        return saved
    index = torch.cuda.current_device() if device.index is None else device.index
    if len(saved) == 1:
        return saved[0]
    if index < len(saved):
        return saved[index]
    log.warning(
        "the checkpoint's CUDA generator states cover %d GPUs, not this process's cuda:%d; "
        "its generator keeps the run's seed",
        len(saved),
        index,
    )
    return None
