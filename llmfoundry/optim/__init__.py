"""Optimizers and learning-rate schedules."""

from llmfoundry.optim.adamw import DecoupledAdamW
from llmfoundry.optim.schedules import (
    ConstantWithWarmup,
    CosineWithWarmup,
    InverseSqrtWithWarmup,
    LinearWithWarmup,
)

__all__ = [
    "ConstantWithWarmup",
    "CosineWithWarmup",
    "DecoupledAdamW",
    "InverseSqrtWithWarmup",
    "LinearWithWarmup",
]
