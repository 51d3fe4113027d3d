"""Clip gradients after backward and before the optimizer step."""

from __future__ import annotations

from typing import Literal

import torch

from llmfoundry.core.engine import Algorithm, Logger
from llmfoundry.core.events import Event
from llmfoundry.core.metrics import DeviceScalar
from llmfoundry.core.state import State
from llmfoundry.distributed.grad_norm import clip_grad_norm_
from llmfoundry.utils.errors import UserError


class GradientClipping(Algorithm):
    """`norm`: scale all gradients so their global L2 norm is at most `threshold` (logged);
    `value`: clamp each gradient element to [-threshold, threshold]."""

    def __init__(
        self, clipping_type: Literal["norm", "value"] = "norm", threshold: float = 1.0
    ) -> None:
        if clipping_type not in ("norm", "value"):
            raise UserError(f"clipping_type must be 'norm' or 'value', got {clipping_type!r}")
        if threshold <= 0:
            raise UserError(f"threshold must be positive, got {threshold}")
        self.clipping_type = clipping_type
        self.threshold = threshold

    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_TRAIN_BATCH

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        params = [p for p in state.model.parameters() if p.grad is not None]
        pipeline = state.strategy.pipeline if state.strategy is not None else None
        if self.clipping_type == "norm" and pipeline is not None:  # over every stage's gradients
            logger.log_metrics(
                {"grad/norm": DeviceScalar(pipeline.clip_grad_norm_(state.model, self.threshold))}
            )
        elif self.clipping_type == "norm":  # a sharded norm is gathered now, on every rank
            norm = clip_grad_norm_(params, self.threshold)
            # On the device: loggers read it at their intervals, so clipping never waits for it.
            logger.log_metrics({"grad/norm": DeviceScalar(norm)})
        else:
            torch.nn.utils.clip_grad_value_(params, self.threshold)
