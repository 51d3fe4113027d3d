"""Numeric precision of the training step: autocast, and loss scaling for fp16.

One object answers the three questions the loop asks (how to run forward, how to run backward,
how to step), so the loop has no precision branches.

``auto`` (the default) is resolved where the device is known (`resolve_auto`): amp_bf16 on a
GPU with bf16 tensor cores, fp32 elsewhere. On a CUDA device the precision also sets how
float32 matmuls run: IEEE for fp32 (the reference numerics a run asks for by name), TF32
tensor cores for what autocast leaves in float32 under amp_bf16/amp_fp16 (its fp32 islands,
e.g. infini-attention's memory), as torch's ``set_float32_matmul_precision("high")``.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

import torch

from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16")
AUTO = "auto"
# Where amp_fp16 runs: fp16 matmul is unusably slow on CPU.
FP16_DEVICE_TYPES = ("cuda",)
# The first CUDA compute capability with bf16 tensor cores (Ampere); older GPUs emulate bf16.
BF16_CAPABILITY = (8, 0)


def resolve_auto(precision: str, device: torch.device) -> str:
    """`precision`, with ``auto`` spelled out for `device` (and logged: a run's numerics depend
    on it): amp_bf16 on a CUDA device with bf16 tensor cores (ROCm devices are taken to have
    them, as torch.cuda.is_bf16_supported takes them), else fp32. A
    CPU without AMX or AVX512-BF16 runs a bf16 matmul ~40x slower than fp32 (conf/train.yaml),
    so CPUs get fp32; ask for amp_bf16 by name on one that has them."""
    if precision != AUTO:
        return precision
    if device.type != "cuda":
        log.info("precision=auto: fp32 on %s", device)
        return "fp32"
    capability = torch.cuda.get_device_capability(device)
    bf16 = torch.version.hip is not None or capability >= BF16_CAPABILITY
    resolved = "amp_bf16" if bf16 else "fp32"
    major, minor = capability
    log.info("precision=auto: %s on %s (compute capability %d.%d)", resolved, device, major, minor)
    return resolved


class Precision:
    """`grad_scaler`: whether amp_fp16 scales losses with torch's GradScaler; a strategy whose
    engine scales them itself (DeepSpeed: `Strategy.scales_loss`) passes False, since unscaling
    gradients a GradScaler never scaled fails, and scaling twice would be wrong."""

    def __init__(self, precision: str, device: torch.device, grad_scaler: bool = True) -> None:
        precision = resolve_auto(precision, device)
        if precision not in PRECISIONS:
            choices = ", ".join((AUTO, *PRECISIONS))
            raise UserError(f"precision={precision!r} is not one of {choices}")
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
        if device.type == "cuda":  # (see the module docstring)
            torch.set_float32_matmul_precision("highest" if self._dtype is None else "high")

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
