"""How long the run has left, extrapolated from how fast it has moved through `max_duration`.

Logged after every batch: ``time/elapsed`` (seconds since fit start) and
``time/remaining_estimate`` (seconds). The estimate is the wall-clock time per unit of progress
(the fraction of `max_duration` done, in whatever unit it is given) since a reference batch,
times the progress still to go. Evaluation and checkpointing are part of the wall clock, so a
run that evaluates at a steady interval gets them counted in its ETA. The first `skip_batches`
batches are left out of the rate: they carry one-off costs (allocator warm-up, kernel selection,
the first evaluation) that would inflate the estimate for the whole run.

A run that knows how long it should take (`expected_minutes`: ``make demo`` states the README's
time) says so once, after `CHECK_AFTER_BATCHES` measured batches, when this machine projects
more than `FAR_BEYOND` times that: a busy 2-core laptop ran the demo at 35 s per batch (six
hours) without a word, where the user would rather have chosen a shorter run (`hint`).
"""

from __future__ import annotations

import logging
from time import perf_counter

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)

CHECK_AFTER_BATCHES = 3
FAR_BEYOND = 2.0


class RuntimeEstimator(Callback):
    def __init__(
        self,
        skip_batches: int = 1,
        expected_minutes: float | None = None,
        hint: str = "for a shorter run set max_duration to fewer batches",
    ) -> None:
        """`expected_minutes`: the whole run's expected wall time (None: nothing is expected);
        `hint`: what to do instead, said with the warning."""
        if skip_batches < 0:
            raise UserError(f"skip_batches must be >= 0, got {skip_batches}")
        if expected_minutes is not None and expected_minutes <= 0:
            raise UserError(f"expected_minutes must be > 0 or null, got {expected_minutes}")
        self.skip_batches = skip_batches
        self.expected_minutes = expected_minutes
        self.hint = hint
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
                if self._batches == self.skip_batches + CHECK_AFTER_BATCHES:
                    self._warn_if_far_beyond(metrics["time/elapsed"] + rate * (1.0 - progress))
        logger.log_metrics(metrics)

    def _warn_if_far_beyond(self, projected_seconds: float) -> None:
        if (
            self.expected_minutes is None
            or projected_seconds <= FAR_BEYOND * 60 * self.expected_minutes
        ):
            return
        log.warning(
            "this run projects %s in total, over %g times the expected %s "
            "(callbacks.runtime_estimator.expected_minutes): this machine is slower or busier; %s",
            _minutes(projected_seconds),
            FAR_BEYOND,
            _minutes(60 * self.expected_minutes),
            self.hint,
        )

    @staticmethod
    def _progress(state: State) -> float:
        return min(state.elapsed(state.max_duration), 1.0)


def _minutes(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60}h {minutes % 60:02d}m" if minutes >= 60 else f"{max(minutes, 1)} min"
