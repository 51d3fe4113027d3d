"""Plain-text metrics every `log_interval`, and a run summary at the end.

Lines go through `logging` (stdout and the run folder's train.log; see llmfoundry/utils/logs.py).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from llmfoundry.core.engine import Logger, LoggerDestination
from llmfoundry.core.state import State
from llmfoundry.core.time import Time, Timestamp, TimeString

log = logging.getLogger(__name__)


def format_metrics(metrics: dict[str, float]) -> str:
    return "  ".join(f"{key} {value:.4g}" for key, value in sorted(metrics.items()))


class ConsoleLogger(LoggerDestination):
    def __init__(self, log_interval: TimeString = "10ba") -> None:
        self.log_interval = Time.parse(log_interval)
        self._pending: dict[str, float] = {}
        self._before: Timestamp = Timestamp()
        self._eval_history: dict[str, list[float]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._pending.update(metrics)
        for key, value in metrics.items():
            if key.startswith("eval/"):
                self._eval_history.setdefault(key, []).append(value)

    def batch_start(self, state: State, logger: Logger) -> None:
        self._before = copy.copy(state.timestamp)

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.crossed(self.log_interval, self._before) or state.finished:
            train = {k: v for k, v in self._pending.items() if not k.startswith("eval/")}
            self._print(state, f"[batch {state.timestamp.batch}] {format_metrics(train)}")
            self._pending = {k: v for k, v in self._pending.items() if k.startswith("eval/")}

    def eval_end(self, state: State, logger: Logger) -> None:
        # Each eval set's line as soon as its metrics are in, so it comes before anything that
        # acts on them at EVAL_AFTER_ALL (an early stopper's message refers to it).
        evals = {k: v for k, v in self._pending.items() if k.startswith("eval/")}
        self._print(state, f"[eval @ batch {state.timestamp.batch}] {format_metrics(evals)}")
        self._pending = {k: v for k, v in self._pending.items() if not k.startswith("eval/")}

    def fit_end(self, state: State, logger: Logger) -> None:
        for key, values in sorted(self._eval_history.items()):
            if key.endswith("/loss"):
                self._print(state, f"{key}: first {values[0]:.4f} -> last {values[-1]:.4f}")

    def state_dict(self) -> dict[str, Any]:
        return {"eval_history": self._eval_history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._eval_history = {k: list(v) for k, v in state.get("eval_history", {}).items()}

    @staticmethod
    def _print(state: State, line: str) -> None:
        del state  # other ranks are filtered out by the logging setup (llmfoundry/utils/logs.py)
        log.info(line)
