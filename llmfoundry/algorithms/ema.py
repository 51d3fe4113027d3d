"""Exponential moving average (EMA) of the weights, used for evaluation.

The average of recent weights often evaluates better than the latest weights (it smooths the
noise of the last steps) at no cost to training: the training weights are untouched, and the
average is swapped in only while evaluating.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from llmfoundry.core.engine import Algorithm, Logger
from llmfoundry.core.events import Event
from llmfoundry.core.state import State
from llmfoundry.core.time import Time, Timestamp, TimeString, TimeUnit
from llmfoundry.distributed import unwrap_model
from llmfoundry.utils.errors import UserError


class EMA(Algorithm):
    """Keep ``ema = s * ema + (1 - s) * weights`` after every optimizer step (BATCH_END).

    Give either `half_life` (a Time: after that much training, the current weights have half
    the weight in the average; any unit, e.g. "100ba", "1000000tok", "0.01dur") or `smoothing`
    (s, applied once per batch). With a half-life, s is ``0.5 ** (elapsed / half_life)`` for the
    time each batch took, so a half-life in tokens stays right when batches change size.

    The average is kept in float32 on the weights' device. For evaluation (EVAL_BEFORE_ALL) the
    training weights are set aside and the average copied in; EVAL_AFTER_ALL copies them back,
    bit for bit. `state_dict` holds the average, so checkpoints carry it.
    """

    def __init__(
        self, half_life: TimeString | None = "1000ba", smoothing: float | None = None
    ) -> None:
        if (half_life is None) == (smoothing is None):
            raise UserError(
                "EMA needs exactly one of half_life (a time such as '1000ba') and smoothing "
                f"(a number in [0, 1)); got half_life={half_life!r}, smoothing={smoothing!r}"
            )
        self.half_life = Time.parse(half_life) if half_life is not None else None
        if self.half_life is not None and self.half_life.value == 0:
            raise UserError("EMA half_life must be positive")
        if smoothing is not None and not 0.0 <= smoothing < 1.0:
            raise UserError(f"EMA smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self.averages: dict[str, torch.Tensor] | None = None
        self._loaded: dict[str, torch.Tensor] | None = None
        self._training_weights: list[torch.Tensor] | None = None
        self._last = Timestamp()

    def match(self, event: Event, state: State) -> bool:
        return event in (
            Event.INIT,
            Event.FIT_START,
            Event.BATCH_END,
            Event.EVAL_BEFORE_ALL,
            Event.EVAL_AFTER_ALL,
        )

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event is Event.INIT:
            self._start(state)
        elif event is Event.FIT_START:
            self._last = copy.copy(state.timestamp)
        elif event is Event.BATCH_END:
            self._update(state, logger)
        elif event is Event.EVAL_BEFORE_ALL:
            self._swap_in(state)
        else:
            self._swap_out(state)

    def batch_smoothing(self, state: State) -> float:
        """s for the batch that just ended (time since the previous update)."""
        if self.smoothing is not None:
            return self.smoothing
        assert self.half_life is not None
        if self.half_life.unit is TimeUnit.EPOCH and not state.dataloader_len:
            raise UserError(
                "EMA half_life in epochs needs a train dataloader with a length; "
                "give it in batches, samples or tokens instead"
            )
        passed = state.elapsed(self.half_life) - state.elapsed(self.half_life, self._last)
        return math.pow(0.5, passed)

    def _params(self, state: State) -> list[tuple[str, torch.nn.Parameter]]:
        return list(unwrap_model(state.model).named_parameters())

    @torch.no_grad()
    def _start(self, state: State) -> None:
        self.averages = {
            name: param.detach().to(torch.float32, copy=True) for name, param in self._params(state)
        }
        if self._loaded is not None:
            self._copy_loaded()

    @torch.no_grad()
    def _update(self, state: State, logger: Logger) -> None:
        assert self.averages is not None
        smoothing = self.batch_smoothing(state)
        for name, param in self._params(state):
            self.averages[name].lerp_(param.detach().float(), 1.0 - smoothing)
        self._last = copy.copy(state.timestamp)
        logger.log_metrics({"algorithms/ema_smoothing": smoothing})

    @torch.no_grad()
    def _swap_in(self, state: State) -> None:
        assert self.averages is not None
        params = self._params(state)
        self._training_weights = [param.detach().clone() for _, param in params]
        for name, param in params:
            param.copy_(self.averages[name])

    @torch.no_grad()
    def _swap_out(self, state: State) -> None:
        if self._training_weights is None:
            return
        for (_, param), saved in zip(self._params(state), self._training_weights, strict=True):
            param.copy_(saved)
        self._training_weights = None

    def state_dict(self) -> dict[str, Any]:
        return {"averages": self.averages}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = state["averages"]
        if self.averages is not None:
            self._copy_loaded()

    @torch.no_grad()
    def _copy_loaded(self) -> None:
        assert self.averages is not None and self._loaded is not None
        if self._loaded.keys() != self.averages.keys():
            missing = sorted(self.averages.keys() - self._loaded.keys())
            extra = sorted(self._loaded.keys() - self.averages.keys())
            raise UserError(
                f"the checkpoint's EMA does not match the model: missing {missing[:5]}, "
                f"unexpected {extra[:5]}; was it saved from another model configuration?"
            )
        for name, average in self.averages.items():
            average.copy_(self._loaded[name])
        self._loaded = None
