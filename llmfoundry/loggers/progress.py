"""A progress bar over the run: batches, samples or tokens done, rate, ETA and the train loss.

On a terminal it is a tqdm bar on stderr. When stderr is not a terminal (a log file, a cluster
job's output) a bar redrawn with carriage returns would turn into one unreadable line, so the
same status (tqdm's format) is printed as a plain line every `non_tty_interval` seconds and at
the end. Only rank 0 shows progress. The loss shown is read (the host waits for the device) only
when the status is redrawn with it: at most once a second on a terminal, at each plain line.
"""

from __future__ import annotations

import sys
from time import perf_counter

from tqdm import tqdm

from llmfoundry.core.engine import Logger, LoggerDestination
from llmfoundry.core.state import State
from llmfoundry.core.time import TimeUnit
from llmfoundry.utils.errors import UserError

# Seconds between reads of the loss for a terminal's bar (tqdm redraws up to 10 times a second).
_LOSS_REFRESH_S = 1.0
_COUNTERS = {TimeUnit.BATCH: "ba", TimeUnit.SAMPLE: "sp", TimeUnit.TOKEN: "tok"}


class ProgressBarLogger(LoggerDestination):
    def __init__(self, unit: str | None = None, non_tty_interval: float = 60.0) -> None:
        """`unit`: count in ``ba``, ``sp`` or ``tok``; default: max_duration's unit when it is
        one of those, else batches. When max_duration is in another unit the total (and so the
        ETA) is extrapolated from the fraction of the run done."""
        if unit is not None and unit not in _COUNTERS.values():
            raise UserError(
                f"progress.unit={unit!r}: use ba, sp, tok, or null for max_duration's unit"
            )
        if non_tty_interval < 0:
            raise UserError(f"non_tty_interval must be >= 0 seconds, got {non_tty_interval}")
        self.unit = TimeUnit(unit) if unit else None
        self.non_tty_interval = non_tty_interval
        self._bar: tqdm | None = None
        self._active = False
        self._unit = TimeUnit.BATCH
        self._exact: float | None = None  # the total, when max_duration gives it exactly
        self._total: float | None = None
        self._initial = 0.0
        self._count = 0.0
        self._postfix = ""
        self._started = 0.0
        self._last_print = 0.0

    def fit_start(self, state: State, logger: Logger) -> None:
        if state.rank != 0:
            return
        duration = state.max_duration
        default = duration.unit if duration.unit in _COUNTERS else TimeUnit.BATCH
        self._unit = self.unit or default
        self._exact = self._total = self._exact_total(state)
        self._initial = self._count = state.timestamp.get(self._unit)
        self._started = self._last_print = perf_counter()
        self._active = True
        if sys.stderr.isatty():
            self._bar = tqdm(
                total=self._total,
                initial=self._initial,
                unit=_COUNTERS[self._unit],
                file=sys.stderr,
                dynamic_ncols=True,
                unit_scale=self._unit is TimeUnit.TOKEN,
            )

    def _exact_total(self, state: State) -> float | None:
        duration = state.max_duration
        if duration.unit is self._unit:
            return duration.value
        if (
            duration.unit is TimeUnit.EPOCH
            and self._unit is TimeUnit.BATCH
            and state.dataloader_len
        ):
            return state.dataloader_len * duration.value
        return None

    def batch_end(self, state: State, logger: Logger) -> None:
        if not self._active:
            return
        self._count = state.timestamp.get(self._unit)
        progress = min(state.elapsed(state.max_duration), 1.0)
        if self._exact is None and progress > 0:
            self._total = round(self._count / progress)
        now = perf_counter()
        if self._bar is not None:
            if now - self._last_print >= _LOSS_REFRESH_S or state.finished:
                self._last_print = now
                self._postfix = f"loss={state.train_loss:.4f}"
                self._bar.set_postfix_str(self._postfix, refresh=False)
            self._bar.total = self._total
            self._bar.update(self._count - self._bar.n)
        elif now - self._last_print >= self.non_tty_interval or state.finished:
            self._postfix = f"loss={state.train_loss:.4f}"
            self._print_line()

    def _print_line(self) -> None:
        self._last_print = perf_counter()
        line = tqdm.format_meter(
            self._count,
            self._total,
            self._last_print - self._started,
            unit=_COUNTERS[self._unit],
            unit_scale=self._unit is TimeUnit.TOKEN,
            initial=self._initial,
            postfix=self._postfix,
            ascii=True,
        )
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._active = False
