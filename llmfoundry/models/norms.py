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

    def __init__(
        self, dim: int, bias: bool, low_precision: bool, eps: float = LAYER_NORM_EPS
    ) -> None:
        super().__init__(dim, eps=eps, bias=bias)
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
    """RMSNorm (x / rms(x) * weight, no bias) as transformers' Llama and Qwen compute it: the
    normalisation in float32, cast back to the input's dtype before the weight. With
    `low_precision=True` it runs in the autocast dtype, as `LayerNorm` does (llm-foundry's
    `low_precision_rmsnorm`).

    In float32 this is torch's RMSNorm to the bit (MPT's `rmsnorm` computed that before the
    families shared one decoder); under autocast the residual stream a block norms is float32,
    so both still agree; a model cast to bf16 without autocast rounds once more here (before
    the weight), as transformers' does.
    """

    def __init__(self, dim: int, low_precision: bool, eps: float = LAYER_NORM_EPS) -> None:
        super().__init__(dim, eps=eps)
        self.low_precision = low_precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (self.low_precision and torch.is_autocast_enabled(device)):
            normed = F.rms_norm(x.float(), self.normalized_shape, eps=self.eps)
            return self.weight * normed.to(x.dtype)
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return F.rms_norm(x.to(dtype), self.normalized_shape, self.weight.to(dtype), self.eps)


NORM_TYPES = ("layernorm", "rmsnorm")


def build_norm(
    norm_type: str, dim: int, bias: bool, low_precision: bool, eps: float = LAYER_NORM_EPS
) -> nn.Module:
    """A `norm_type` norm over `dim` features (`bias`: LayerNorm's; RMSNorm has none)."""
    if norm_type == "rmsnorm":
        return RMSNorm(dim, low_precision, eps)
    return LayerNorm(dim, bias, low_precision, eps)
