"""Learning-rate schedules as functions of training time.

A schedule maps the trainer state to a multiplier of each parameter group's initial lr. It is a
pure function of the timestamp, so a resumed run continues the schedule exactly, with no state
of its own to save. Warmups take Time strings ("100ba", "0.01dur", "2000000tok"); the decay
runs from the end of warmup to `max_duration`.
"""

from __future__ import annotations

import math

from llmfoundry.core.state import State
from llmfoundry.core.time import Time, TimeString
from llmfoundry.utils.errors import UserError


class WarmupSchedule:
    """Linear warmup from 0 to 1 over `t_warmup`, then `after_warmup` of the remaining run."""

    def __init__(self, t_warmup: TimeString = "0ba", alpha_f: float = 0.0) -> None:
        self.t_warmup = Time.parse(t_warmup)
        if not 0.0 <= alpha_f <= 1.0:
            raise UserError(f"scheduler.alpha_f must be in [0, 1], got {alpha_f}")
        self.alpha_f = alpha_f

    def __call__(self, state: State) -> float:
        warmup_done = state.elapsed(self.t_warmup)
        if warmup_done < 1.0:
            return warmup_done
        return self.after_warmup(state)

    def decay_progress(self, state: State) -> float:
        """Fraction of the post-warmup run that has passed, in [0, 1].

        The warmup's share of the run is measured as the ratio of the two elapsed fractions
        now, so warmup and max_duration may be in different units (tokens vs batches).
        """
        run_done = state.elapsed(state.max_duration)
        warmup_done = state.elapsed(self.t_warmup)
        has_warmup = self.t_warmup.value > 0 and warmup_done > 0
        warmup_share = run_done / warmup_done if has_warmup else 0.0
        if warmup_share >= 1.0:
            return 1.0
        return min(1.0, max(0.0, (run_done - warmup_share) / (1.0 - warmup_share)))

    def after_warmup(self, state: State) -> float:
        raise NotImplementedError


class ConstantWithWarmup(WarmupSchedule):
    def after_warmup(self, state: State) -> float:
        return 1.0


class LinearWithWarmup(WarmupSchedule):
    """Linear decay from 1 to `alpha_f`."""

    def after_warmup(self, state: State) -> float:
        return 1.0 - (1.0 - self.alpha_f) * self.decay_progress(state)


class CosineWithWarmup(WarmupSchedule):
    """Half-cosine decay from 1 to `alpha_f` (MPT recipes: 100ba warmup, alpha_f 0.1)."""

    def after_warmup(self, state: State) -> float:
        progress = self.decay_progress(state)
        return self.alpha_f + (1.0 - self.alpha_f) * 0.5 * (1.0 + math.cos(math.pi * progress))


class InverseSqrtWithWarmup(WarmupSchedule):
    """1/sqrt(t / t_warmup) after warmup, floored at `alpha_f` (t_warmup must be non-zero)."""

    def __init__(self, t_warmup: TimeString = "100ba", alpha_f: float = 0.0) -> None:
        super().__init__(t_warmup, alpha_f)
        if self.t_warmup.value == 0:
            raise UserError("scheduler.t_warmup must be non-zero for the inverse-sqrt schedule")

    def after_warmup(self, state: State) -> float:
        return max(self.alpha_f, 1.0 / math.sqrt(state.elapsed(self.t_warmup)))
