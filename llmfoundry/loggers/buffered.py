"""Destinations that write metrics in batches, so the training loss stays on the device.

The trainer logs each batch's loss as a `DeviceScalar` (llmfoundry/core/metrics.py): reading it
on the host waits for the device to finish the work queued before it. A destination that wrote
every call would force that wait every batch; these keep the records and write them every
`flush_interval`, at each evaluation's end, at the end of training, at close (also after an
error) and before every checkpoint save (`flush`), reading the values then. A killed process
(SIGKILL) loses only what it logged after its last checkpoint (at most one interval), which the
run resumed from that checkpoint logs again.
"""

from __future__ import annotations

import copy
from typing import Any

from llmfoundry.core.engine import Logger, LoggerDestination
from llmfoundry.core.metrics import read_all
from llmfoundry.core.state import State
from llmfoundry.core.time import Time, Timestamp, TimeString


class BufferedDestination(LoggerDestination):
    def __init__(self, flush_interval: TimeString = "10ba") -> None:
        self.flush_interval = Time.parse(flush_interval)
        self._pending: list[tuple[int, dict[str, Any]]] = []
        self._before = Timestamp()

    def write_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write one log call's metrics, all plain floats now."""
        raise NotImplementedError

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        self._pending.append((step, dict(metrics)))

    def batch_start(self, state: State, logger: Logger) -> None:
        self._before = copy.copy(state.timestamp)

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.crossed(self.flush_interval, self._before) or state.finished:
            self.write_pending()

    def eval_end(self, state: State, logger: Logger) -> None:
        self.write_pending()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.write_pending()

    def flush(self) -> None:
        """Write the pending records; subclasses also push them to disk or the service here
        (before checkpoints and at close, not every interval)."""
        self.write_pending()

    def write_pending(self) -> None:
        """Write every record kept since the last write (`write_metrics`)."""
        pending, self._pending = self._pending, []
        read_all(value for _, metrics in pending for value in metrics.values())
        for step, metrics in pending:
            self.write_metrics({key: float(value) for key, value in metrics.items()}, step)
