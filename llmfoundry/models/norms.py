"""Normalization layers the model families share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LAYER_NORM_EPS = 1e-5


class LayerNorm(nn.LayerNorm):
    """LayerNorm that, with `low_precision=True`, runs in the autocast dtype.

    Autocast normally computes LayerNorm in float32; MPT's low-precision LayerNorm casts input,
    weight and bias to the autocast dtype (bf16) instead, trading a little precision for speed and
    memory. Outside autocast it is an ordinary LayerNorm.
    """

    def __init__(self, dim: int, bias: bool, low_precision: bool) -> None:
        super().__init__(dim, eps=LAYER_NORM_EPS, bias=bias)
        self.low_precision = low_precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (self.low_precision and torch.is_autocast_enabled(device)):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return F.layer_norm(
                x.to(dtype), self.normalized_shape, self.weight.to(dtype), bias, self.eps
            )
