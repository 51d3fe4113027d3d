"""Numeric precision of the training step: autocast, and loss scaling for fp16.

One object answers the three questions the loop asks (how to run forward, how to run backward,
how to step), so the loop has no precision branches.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from llmfoundry.utils.errors import UserError

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
# Where amp_fp16 runs: fp16 matmul is unusably slow on CPU.
FP16_DEVICE_TYPES = ("cuda",)


class Precision:
    """`grad_scaler`: whether amp_fp16 scales losses with torch's GradScaler; a strategy whose
    engine scales them itself (DeepSpeed: `Strategy.scales_loss`) passes False, since unscaling
    gradients a GradScaler never scaled fails, and scaling twice would be wrong."""

    def __init__(self, precision: str, device: torch.device, grad_scaler: bool = True) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        if precision == "amp_fp16" and device.type not in FP16_DEVICE_TYPES:
            raise UserError(
                "precision=amp_fp16 needs a CUDA device (fp16 matmul is unusably slow on CPU); "
                "use amp_bf16 or fp32"
            )
        self.name = precision
        self.device = device
        self._dtype = {"fp32": None, "amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}[
            precision
        ]
        scaled = precision == "amp_fp16" and grad_scaler
        self._scaler = torch.amp.GradScaler("cuda") if scaled else None

    def autocast(self) -> AbstractContextManager:
        return torch.autocast(
            device_type=self.device.type, dtype=self._dtype, enabled=self._dtype is not None
        )

    def backward(self, loss: torch.Tensor) -> None:
        (self._scaler.scale(loss) if self._scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true scale, before anything reads them (e.g. clipping)."""
        if self._scaler:
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._scaler:
            self._scaler.step(optimizer)
            self._scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict:
        return self._scaler.state_dict() if self._scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self._scaler and state:
            self._scaler.load_state_dict(state)
