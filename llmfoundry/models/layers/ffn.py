"""The feed-forward layers families share: `MLP` (up, activation, down) and `GLU` (a gated MLP:
the activation of a gate projection times the up projection), with the activations `ACTIVATIONS`
names. Parameter names (`gate_proj`, `up_proj`, `down_proj`) are transformers' and llm-foundry's,
so checkpoints and exports copy them as they are; the plans split them by those names."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,  # exact (erf)
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


class MLP(nn.Module):
    """down_proj(act(up_proj(x))): d_model -> hidden -> d_model."""

    def __init__(self, d_model: int, hidden: int, bias: bool, act: str = "gelu") -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GLU(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): SwiGLU with silu, GeGLU with gelu."""

    def __init__(self, d_model: int, hidden: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
