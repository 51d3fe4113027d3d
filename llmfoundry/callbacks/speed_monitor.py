"""Throughput: tokens/s and samples/s over a sliding window of recent batches."""

from __future__ import annotations

from collections import deque

from llmfoundry.trainer.engine import Callback, Logger
from llmfoundry.trainer.state import State


class SpeedMonitor(Callback):
    def __init__(self, window_size: int = 20) -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        # (wall clock, samples, tokens) after each batch
        self._history: deque[tuple[float, int, int]] = deque(maxlen=window_size + 1)

    def fit_start(self, state: State, logger: Logger) -> None:
        ts = state.timestamp
        self._history.append((ts.wall_clock, ts.sample, ts.token))

    def batch_end(self, state: State, logger: Logger) -> None:
        ts = state.timestamp
        self._history.append((ts.wall_clock, ts.sample, ts.token))
        (t0, s0, k0), (t1, s1, k1) = self._history[0], self._history[-1]
        if t1 <= t0:
            return
        logger.log_metrics(
            {
                "throughput/samples_per_sec": (s1 - s0) / (t1 - t0),
                "throughput/tokens_per_sec": (k1 - k0) / (t1 - t0),
            }
        )
