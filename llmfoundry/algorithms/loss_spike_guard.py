"""Skip the optimizer step of a batch whose loss spikes; stop a run whose loss keeps spiking.

A single bad batch (corrupt data, a rare numerical blow-up) can throw large-model training off
course for thousands of steps; not learning from it is cheap insurance. A loss that spikes batch
after batch is not a bad batch but a diverging run, which should stop loudly rather than burn
compute.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Any

from llmfoundry.core.engine import Algorithm, Logger
from llmfoundry.core.events import Event
from llmfoundry.core.state import State
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)


class LossSpikeGuard(Algorithm):
    """At AFTER_TRAIN_BATCH (gradients complete, optimizer step not yet taken), compare the
    batch's loss with the last `window` accepted losses. It is a spike when it is both a
    statistical outlier (above mean + `num_std` standard deviations) and a material jump (above
    `min_ratio` x mean) — the ratio keeps a window of nearly constant losses from flagging tiny
    wiggles — or when it is NaN or infinite. Judging starts once `min_history` losses are in.

    On a spike the gradients are set to None, so the optimizer leaves every parameter (and its
    own state) untouched; the batch still counts as trained time, and the skip is logged
    (``algorithms/loss_spike_skipped``). Spiking losses do not enter the window. After
    `max_consecutive` skipped batches in a row training stops with an error.

    The loss is the global batch loss, the same on every rank, so all ranks skip together.
    Judging each batch before its step means reading its loss on the host: with this algorithm
    on, the host waits for the device once per batch (`State.batch_loss`).
    """

    def __init__(
        self,
        window: int = 100,
        min_history: int = 20,
        num_std: float = 6.0,
        min_ratio: float = 1.2,
        max_consecutive: int = 5,
    ) -> None:
        if not 2 <= min_history <= window:
            raise UserError(
                f"LossSpikeGuard needs 2 <= min_history <= window, got min_history={min_history}, "
                f"window={window}"
            )
        if num_std <= 0 or min_ratio < 1.0:
            raise UserError(
                f"LossSpikeGuard needs num_std > 0 and min_ratio >= 1, got num_std={num_std}, "
                f"min_ratio={min_ratio}"
            )
        if max_consecutive < 1:
            raise UserError(f"LossSpikeGuard max_consecutive must be >= 1, got {max_consecutive}")
        self.min_history = min_history
        self.num_std = num_std
        self.min_ratio = min_ratio
        self.max_consecutive = max_consecutive
        self.history: deque[float] = deque(maxlen=window)
        self.consecutive = 0

    def match(self, event: Event, state: State) -> bool:
        return event is Event.AFTER_TRAIN_BATCH

    def threshold(self) -> float | None:
        """The loss above which a batch is skipped, or None while the window is filling."""
        if len(self.history) < self.min_history:
            return None
        mean = statistics.fmean(self.history)
        return max(mean + self.num_std * statistics.stdev(self.history), self.min_ratio * mean)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        loss = state.train_loss
        threshold = self.threshold()
        spike = not math.isfinite(loss) or (threshold is not None and loss > threshold)
        if not spike:
            self.consecutive = 0
            self.history.append(loss)
            return
        self.consecutive += 1
        for param in state.model.parameters():
            param.grad = None
        logger.log_metrics({"algorithms/loss_spike_skipped": 1.0, "algorithms/loss_spike": loss})
        reason = "not finite" if not math.isfinite(loss) else f"above {threshold:.4g}"
        log.warning(
            f"loss spike at batch {state.timestamp.batch}: loss {loss:.4g} ({reason}); "
            f"optimizer step skipped ({self.consecutive} in a row)"
        )
        if self.consecutive >= self.max_consecutive:
            mean = statistics.fmean(self.history) if self.history else float("nan")
            raise RuntimeError(
                f"the loss spiked {self.consecutive} batches in a row (last {loss:.4g}, recent "
                f"mean {mean:.4g}), so these are not bad batches but a diverging run; stopped. "
                "Resume from an earlier checkpoint with a lower lr, a longer warmup or gradient "
                "clipping, or raise algorithms.loss_spike_guard.max_consecutive."
            )

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.clear()
        self.history.extend(state["history"])
        self.consecutive = state["consecutive"]
