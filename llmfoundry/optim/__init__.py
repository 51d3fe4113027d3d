"""Optimizers, parameter groups and learning-rate schedules."""

from llmfoundry.optim.adamw import DecoupledAdamW
from llmfoundry.optim.lion import DecoupledLionW
from llmfoundry.optim.param_groups import build_param_groups
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
    "DecoupledLionW",
    "InverseSqrtWithWarmup",
    "LinearWithWarmup",
    "build_param_groups",
]
