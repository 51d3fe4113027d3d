"""Seeding and capturing the random number generators a run depends on."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices) so a run is repeatable."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
