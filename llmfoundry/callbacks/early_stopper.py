"""Stop training when a metric has stopped improving for `patience`.

The metric is an evaluation metric, ``eval/<eval set>/<loss|perplexity|accuracy>``, checked
after every evaluation, or the training loss ``loss/train``, checked after every batch.
Patience is a Time (``"500ba"``, ``"2ep"``, ``"1e8tok"``, ``"0.1dur"``, ``"30min"``) measured
from the batch of the best value so far: the run stops at the first check where the metric has
not improved by more than `min_delta` for at least that long. Every rank sees the same
(all-reduced) metric, so all ranks stop at the same batch. Monitoring ``loss/train`` reads the
loss every batch, so the host waits for the device once per batch (`State.batch_loss`); an eval
metric costs nothing between evaluations.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Literal

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.core.time import Time, Timestamp, TimeString
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)

TRAIN_LOSS = "loss/train"


class EarlyStopper(Callback):
    def __init__(
        self,
        monitor: str = "eval/val/loss",
        comparison: Literal["min", "max"] = "min",
        min_delta: float = 0.0,
        patience: TimeString = "1ep",
    ) -> None:
        if monitor != TRAIN_LOSS and not monitor.startswith("eval/"):
            raise UserError(
                f"early_stopper.monitor={monitor!r}: monitor {TRAIN_LOSS!r} or an eval metric "
                "'eval/<eval set>/<loss|perplexity|accuracy>', e.g. 'eval/val/loss'"
            )
        if comparison not in ("min", "max"):
            raise UserError(
                f"early_stopper.comparison={comparison!r}: use 'min' (loss, perplexity) or "
                "'max' (accuracy)"
            )
        if min_delta < 0:
            raise UserError(f"early_stopper.min_delta must be >= 0, got {min_delta}")
        self.monitor = monitor
        self.comparison = comparison
        self.min_delta = min_delta
        self.patience = Time.parse(patience)
        self.best: float | None = None
        self.best_timestamp = Timestamp()

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.monitor == TRAIN_LOSS:
            return
        eval_set = self.monitor.split("/")[1]
        if eval_set not in state.eval_dataloaders:
            sets = ", ".join(sorted(state.eval_dataloaders)) or "none (data.eval_split is null)"
            raise UserError(
                f"early_stopper.monitor={self.monitor!r} names eval set {eval_set!r}, but the "
                f"run's eval sets are: {sets}; monitor one of them, or {TRAIN_LOSS!r}"
            )

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        # After BATCH_END, where the batch's metrics are printed, so the message follows them;
        # before the checkpoint savers, which then save the stopping run.
        if self.monitor == TRAIN_LOSS:
            self._check(state, state.train_loss)

    def eval_after_all(self, state: State, logger: Logger) -> None:
        if self.monitor == TRAIN_LOSS:
            return
        if self.monitor not in state.eval_metrics:
            available = ", ".join(sorted(state.eval_metrics)) or "none"
            raise UserError(
                f"early_stopper.monitor={self.monitor!r} is not an eval metric of this run "
                f"(available: {available})"
            )
        self._check(state, state.eval_metrics[self.monitor])

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return not math.isnan(value)
        if self.comparison == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _check(self, state: State, value: float) -> None:
        if self._improved(value):
            self.best = value
            self.best_timestamp = copy.copy(state.timestamp)
            return
        waited = state.elapsed(self.patience) - state.elapsed(self.patience, self.best_timestamp)
        if waited < 1.0 - 1e-9:
            return
        state.stop_training = True
        best = "none (never finite)" if self.best is None else f"{self.best:.6g}"
        log.info(
            f"early stopping after batch {state.timestamp.batch}: {self.monitor} = "
            f"{value:.6g} has not improved ({self.comparison}, min_delta={self.min_delta:g}) "
            f"on its best {best} at batch {self.best_timestamp.batch} for patience "
            f"{self.patience}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_timestamp": self.best_timestamp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        self.best_timestamp = Timestamp(**state["best_timestamp"])
