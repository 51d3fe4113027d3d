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


class RMSNorm(nn.RMSNorm):
    """torch's RMSNorm (x / rms(x) * weight, no bias) that, with `low_precision=True`, runs in
    the autocast dtype, as `LayerNorm` does: llm-foundry's `rmsnorm` and `low_precision_rmsnorm`.

    Llama's own norm (`models/llama/model.py`) rounds differently under autocast (float32, cast
    back before the weight, as transformers' Llama); in float32 all three compute the same.
    """

    def __init__(self, dim: int, low_precision: bool) -> None:
        super().__init__(dim, eps=LAYER_NORM_EPS)
        self.low_precision = low_precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (self.low_precision and torch.is_autocast_enabled(device)):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return F.rms_norm(x.to(dtype), self.normalized_shape, self.weight.to(dtype), self.eps)


NORM_TYPES = ("layernorm", "rmsnorm")


def build_norm(norm_type: str, dim: int, bias: bool, low_precision: bool) -> nn.Module:
    """A `norm_type` norm over `dim` features (`bias`: LayerNorm's; RMSNorm has none)."""
    if norm_type == "rmsnorm":
        return RMSNorm(dim, low_precision)
    return LayerNorm(dim, bias, low_precision)
