"""Learning-rate schedules as functions of training time.

A schedule maps the trainer state to a multiplier of each parameter group's initial lr. It is a
pure function of the timestamp, so a resumed run continues the schedule exactly, with no state
of its own to save. Warmups take Time strings ("100ba", "0.01dur", "2000000tok"); the decay
runs from the end of warmup to `max_duration`.

`composer_lag=True` evaluates the schedule as Composer's trainer does, for runs that must follow
an llm-foundry run's lr curve: Composer steps its scheduler at the end of each batch BEFORE its
timestamp counts that batch (composer/trainer/trainer.py, `_train_loop`), so its batch k
(1-based) trains with the schedule at k-2 batches, batches 1 and 2 both at 0, where ours
trains batch k at k-1; and a warmup given as a fraction of the run (``0.3dur``) is rounded
down to whole units of max_duration, as Composer converts it. Off by default: a native run's
lr reaches each value one batch sooner.
"""

from __future__ import annotations

import math

from llmfoundry.core.state import State
from llmfoundry.core.time import Time, Timestamp, TimeString, TimeUnit
from llmfoundry.utils.errors import UserError


class WarmupSchedule:
    """Linear warmup from 0 to 1 over `t_warmup`, then `after_warmup` of the remaining run.

    `composer_lag`: evaluate one batch behind, as Composer does (module docstring).
    """

    def __init__(
        self, t_warmup: TimeString = "0ba", alpha_f: float = 0.0, composer_lag: bool = False
    ) -> None:
        self.t_warmup = Time.parse(t_warmup)
        if not 0.0 <= alpha_f <= 1.0:
            raise UserError(f"scheduler.alpha_f must be in [0, 1], got {alpha_f}")
        self.alpha_f = alpha_f
        self.composer_lag = composer_lag

    def __call__(self, state: State) -> float:
        ts = composer_timestamp(state) if self.composer_lag else state.timestamp
        warmup_done = state.elapsed(self.warmup(state), ts)
        if warmup_done < 1.0:
            return warmup_done
        return self.after_warmup(state, ts)

    def decay_progress(self, state: State, ts: Timestamp) -> float:
        """Fraction of the post-warmup run that has passed, in [0, 1].

        The warmup's share of the run is measured as the ratio of the two elapsed fractions
        now, so warmup and max_duration may be in different units (tokens vs batches).
        """
        warmup = self.warmup(state)
        run_done = state.elapsed(state.max_duration, ts)
        warmup_done = state.elapsed(warmup, ts)
        has_warmup = warmup.value > 0 and warmup_done > 0
        warmup_share = run_done / warmup_done if has_warmup else 0.0
        if warmup_share >= 1.0:
            return 1.0
        return min(1.0, max(0.0, (run_done - warmup_share) / (1.0 - warmup_share)))

    def after_warmup(self, state: State, ts: Timestamp) -> float:
        raise NotImplementedError

    def warmup(self, state: State) -> Time:
        """`t_warmup`; with `composer_lag`, a fraction of the run rounded down to whole units
        of max_duration (batches for a run in epochs), as Composer converts it."""
        if not (self.composer_lag and self.t_warmup.unit is TimeUnit.DURATION):
            return self.t_warmup
        run = state.max_duration
        if run.unit is TimeUnit.EPOCH:
            if not state.dataloader_len:
                return self.t_warmup
            run = Time(run.value * state.dataloader_len, TimeUnit.BATCH)
        return Time(int(self.t_warmup.value * run.value), run.unit)


class ConstantWithWarmup(WarmupSchedule):
    def after_warmup(self, state: State, ts: Timestamp) -> float:
        return 1.0


class LinearWithWarmup(WarmupSchedule):
    """Linear decay from 1 to `alpha_f`."""

    def after_warmup(self, state: State, ts: Timestamp) -> float:
        return 1.0 - (1.0 - self.alpha_f) * self.decay_progress(state, ts)


class CosineWithWarmup(WarmupSchedule):
    """Half-cosine decay from 1 to `alpha_f` (MPT recipes: 100ba warmup, alpha_f 0.1)."""

    def after_warmup(self, state: State, ts: Timestamp) -> float:
        progress = self.decay_progress(state, ts)
        return self.alpha_f + (1.0 - self.alpha_f) * 0.5 * (1.0 + math.cos(math.pi * progress))


class InverseSqrtWithWarmup(WarmupSchedule):
    """1/sqrt(t / t_warmup) after warmup, floored at `alpha_f` (t_warmup must be non-zero)."""

    def __init__(
        self, t_warmup: TimeString = "100ba", alpha_f: float = 0.0, composer_lag: bool = False
    ) -> None:
        super().__init__(t_warmup, alpha_f, composer_lag)
        if self.t_warmup.value == 0:
            raise UserError("scheduler.t_warmup must be non-zero for the inverse-sqrt schedule")

    def after_warmup(self, state: State, ts: Timestamp) -> float:
        return max(self.alpha_f, 1.0 / math.sqrt(state.elapsed(self.warmup(state), ts)))


def composer_timestamp(state: State) -> Timestamp:
    """The time Composer's scheduler saw when it set the lr of the batch about to be trained:
    the time after the batch before the last one (at the first two batches, zero).

    Samples and tokens go back by one batch's mean share, exact when every batch has the same
    size (packed text; finetuning batches of varying token counts differ by a fraction of a
    batch). Epochs go back across an epoch end when the epoch length is known."""
    now = state.timestamp
    if now.batch == 0:
        return now
    back = Timestamp(
        epoch=now.epoch,
        batch=now.batch - 1,
        sample=now.sample * (now.batch - 1) // now.batch,
        token=now.token * (now.batch - 1) // now.batch,
        batch_in_epoch=now.batch_in_epoch - 1,
        wall_clock=now.wall_clock,
    )
    if now.batch_in_epoch == 0:  # the last batch ended an epoch: go back into it
        back.epoch -= 1
        back.batch_in_epoch = (state.dataloader_len or 1) - 1
    return back
