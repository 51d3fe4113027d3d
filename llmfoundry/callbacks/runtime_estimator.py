"""How long the run has left, extrapolated from how fast it has moved through `max_duration`.

Logged after every batch: ``time/elapsed`` (seconds since fit start) and
``time/remaining_estimate`` (seconds). The estimate is the wall-clock time per unit of progress
(the fraction of `max_duration` done, in whatever unit it is given) since a reference batch,
times the progress still to go. Evaluation and checkpointing are part of the wall clock, so a
run that evaluates at a steady interval gets them counted in its ETA. The first `skip_batches`
batches are left out of the rate: they carry one-off costs (allocator warm-up, kernel selection,
the first evaluation) that would inflate the estimate for the whole run.
"""

from __future__ import annotations

from time import perf_counter

from llmfoundry.trainer.engine import Callback, Logger
from llmfoundry.trainer.state import State


class RuntimeEstimator(Callback):
    def __init__(self, skip_batches: int = 1) -> None:
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        self.skip_batches = skip_batches
        self._fit_start = 0.0
        self._batches = 0
        # (wall clock, fraction of max_duration done) where the rate is measured from.
        self._reference: tuple[float, float] | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self._fit_start = perf_counter()
        self._batches = 0
        self._reference = None
        if self.skip_batches == 0:
            self._reference = (self._fit_start, self._progress(state))

    def batch_end(self, state: State, logger: Logger) -> None:
        now, progress = perf_counter(), self._progress(state)
        self._batches += 1
        metrics = {"time/elapsed": now - self._fit_start}
        if self._reference is None:
            if self._batches >= self.skip_batches:
                self._reference = (now, progress)
        else:
            start, start_progress = self._reference
            if progress > start_progress:
                rate = (now - start) / (progress - start_progress)
                metrics["time/remaining_estimate"] = rate * (1.0 - progress)
        logger.log_metrics(metrics)

    @staticmethod
    def _progress(state: State) -> float:
        return min(state.elapsed(state.max_duration), 1.0)
