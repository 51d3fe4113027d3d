"""A tqdm progress bar over the run, showing the latest train loss."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm

from llmfoundry.trainer.engine import Logger, LoggerDestination
from llmfoundry.trainer.state import State
from llmfoundry.trainer.time import TimeUnit

_COUNTERS = {TimeUnit.BATCH: "ba", TimeUnit.SAMPLE: "sp", TimeUnit.TOKEN: "tok", TimeUnit.EPOCH: "ep"}


class ProgressBarLogger(LoggerDestination):
    """Counts in max_duration's unit (batches for 'dur' and wall-clock); ETA from tqdm."""

    def __init__(self) -> None:
        self._bar: tqdm | None = None
        self._unit = TimeUnit.BATCH
        self._last = 0.0

    def fit_start(self, state: State, logger: Logger) -> None:
        if state.rank != 0:
            return
        unit = state.max_duration.unit
        self._unit = unit if unit in _COUNTERS else TimeUnit.BATCH
        total = state.max_duration.value if unit in _COUNTERS else None
        if unit is TimeUnit.EPOCH and state.dataloader_len:
            self._unit, total = TimeUnit.BATCH, state.dataloader_len * state.max_duration.value
        self._last = state.timestamp.get(self._unit)
        self._bar = tqdm(
            total=total, initial=self._last, unit=_COUNTERS[self._unit], file=sys.stderr,
            dynamic_ncols=True, unit_scale=self._unit is TimeUnit.TOKEN,
        )

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._bar is None:
            return
        now = state.timestamp.get(self._unit)
        self._bar.update(now - self._last)
        self._last = now
        self._bar.set_postfix(loss=f"{state.train_loss:.4f}", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
