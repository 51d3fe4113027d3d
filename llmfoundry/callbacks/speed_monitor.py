"""Throughput and model flops utilization over a sliding window of recent batches.

Logged after every batch (rates over the last `window_size` batches, all ranks together):

- ``throughput/batches_per_sec``, ``throughput/samples_per_sec``, ``throughput/tokens_per_sec``
- ``throughput/device/tokens_per_sec`` and ``throughput/device/flops_per_sec`` (per device)
- ``throughput/mfu``: model flops per second per device over the device's peak. Model flops are
  ``model.flops_per_token(seq_len)`` times the tokens trained (6N + 12 L d s: forward and
  backward, the convention of the MPT and PaLM papers), so MFU does not depend on how the step
  was computed and compares across implementations.
- ``throughput/hfu``: hardware flops utilization, which also counts work done twice. With
  activation checkpointing (torch's checkpoint wrappers around modules) the forward pass is
  recomputed during backward, one third more flops: HFU = MFU * 4/3, counting a full forward
  recompute. Without it HFU = MFU.

Time is the wall clock between batch ends, data loading and checkpointing included (they are
part of what a step costs) and evaluation excluded (it is not training throughput).

MFU on a CPU is the exception: its peak is measured by a matmul benchmark at start, and on a
shared machine the wall clock counts other processes' time in both the benchmark and the steps,
by different amounts (a peak measured under load read 0.2-122 GFLOP/s between runs, and MFU
744%). There both are timed on this process's CPU-time clock (`time.process_time`, all its
threads), as ``bench/train_throughput.py`` does: MFU is then the model flops per CPU-second
over the benchmark's, whatever else runs. The rates above stay on the wall clock, and
``throughput/device/flops_per_cpu_sec`` is logged beside them: MFU is that over the peak (a
2-process run on 2 loaded cores read 29 GFLOP/s on the wall clock, 112 per CPU-second, and MFU
0.72 against a 157 GFLOP per CPU-second peak).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from time import perf_counter, process_time
from typing import NamedTuple

import torch

from llmfoundry.callbacks.peak_flops import device_peak_flops
from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.distributed import unwrap_model
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.logs import SAME_ON_EVERY_RANK

log = logging.getLogger(__name__)


class _Point(NamedTuple):
    seconds: float
    mfu_seconds: float  # on the clock MFU is measured with (`SpeedMonitor._mfu_clock`)
    batches: int
    samples: int
    tokens: int
    flops: float


def recomputes_activations(model: torch.nn.Module) -> bool:
    """Whether any module is wrapped for activation checkpointing (its forward runs twice)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # torch built without distributed: nothing can be wrapped
        return False
    return any(isinstance(module, CheckpointWrapper) for module in model.modules())


class SpeedMonitor(Callback):
    def __init__(self, window_size: int = 20, peak_flops: float | None = None) -> None:
        """`peak_flops`: flop/s of one device; overrides the lookup by device name (and the CPU
        benchmark), e.g. for a GPU missing from the table or a power-capped one."""
        if window_size < 1:
            raise UserError(f"window_size must be >= 1, got {window_size}")
        if peak_flops is not None and peak_flops <= 0:
            raise UserError(f"peak_flops must be a positive flop/s per device, got {peak_flops}")
        self.window_size = window_size
        self.peak_flops = peak_flops
        self._history: deque[_Point] = deque(maxlen=window_size + 1)
        self._flops_per_token: Callable[[int], int] | None = None
        self._peak: float | None = None
        self._hfu_factor = 1.0
        self._mfu_clock: Callable[[], float] = perf_counter
        self._eval_seconds = self._eval_mfu_seconds = 0.0
        self._eval_started = self._eval_mfu_started = 0.0

    def fit_start(self, state: State, logger: Logger) -> None:
        model = unwrap_model(state.model)
        self._flops_per_token = getattr(model, "flops_per_token", None)
        self._hfu_factor = 4 / 3 if recomputes_activations(model) else 1.0
        self._mfu_clock = perf_counter
        if self.peak_flops is not None:
            self._peak, source = self.peak_flops, "set by speed_monitor.peak_flops"
        else:
            self._mfu_clock = process_time if state.device.type == "cpu" else perf_counter
            self._peak, source = device_peak_flops(
                state.device, state.precision.name, self._mfu_clock
            )
        # Every rank would say these alike (same model, same device kind): rank 0 says them once.
        if self._flops_per_token is None:
            log.warning(
                "speed monitor: MFU is not logged: %s has no flops_per_token; add a method "
                "`def flops_per_token(self, seq_len: int) -> int` returning training flops per "
                "token (forward + backward, ~6 * params + 12 * n_layers * d_model * seq_len)",
                type(model).__name__,
                extra=SAME_ON_EVERY_RANK,
            )
        elif self._peak is None:
            log.warning(
                "speed monitor: MFU is not logged: no peak flop/s known (%s) for precision %s; "
                "set callbacks.speed_monitor.peak_flops=<flop/s per device>",
                source,
                state.precision.name,
                extra=SAME_ON_EVERY_RANK,
            )
        elif self._mfu_clock is perf_counter:
            log.info("speed monitor: peak %.1f GFLOP/s per device (%s)", self._peak / 1e9, source)
        else:
            log.info(
                "speed monitor: peak %.1f GFLOP per CPU-second (%s); MFU is "
                "throughput/device/flops_per_cpu_sec over it",
                self._peak / 1e9,
                source,
            )
        ts = state.timestamp
        self._eval_seconds = self._eval_mfu_seconds = 0.0
        self._history.clear()
        self._history.append(
            _Point(perf_counter(), self._mfu_clock(), ts.batch, ts.sample, ts.token, 0.0)
        )

    def eval_before_all(self, state: State, logger: Logger) -> None:
        self._eval_started, self._eval_mfu_started = perf_counter(), self._mfu_clock()

    def eval_after_all(self, state: State, logger: Logger) -> None:
        self._eval_seconds += perf_counter() - self._eval_started
        self._eval_mfu_seconds += self._mfu_clock() - self._eval_mfu_started

    def batch_end(self, state: State, logger: Logger) -> None:
        ts, previous = state.timestamp, self._history[-1]
        flops = previous.flops
        if self._flops_per_token is not None:
            seq_len = state.batch["input_ids"].shape[1]
            flops += self._flops_per_token(seq_len) * (ts.token - previous.tokens)
        now = perf_counter() - self._eval_seconds
        mfu_now = self._mfu_clock() - self._eval_mfu_seconds
        self._history.append(_Point(now, mfu_now, ts.batch, ts.sample, ts.token, flops))
        first, last = self._history[0], self._history[-1]
        seconds = last.seconds - first.seconds
        if seconds <= 0:
            return
        tokens_per_sec = (last.tokens - first.tokens) / seconds
        # Per device: over every process (world_size), not the data-parallel ranks; a tensor-
        # or pipeline-parallel axis splits one data-parallel rank's work over several devices.
        metrics = {
            "throughput/batches_per_sec": (last.batches - first.batches) / seconds,
            "throughput/samples_per_sec": (last.samples - first.samples) / seconds,
            "throughput/tokens_per_sec": tokens_per_sec,
            "throughput/device/tokens_per_sec": tokens_per_sec / state.world_size,
        }
        if self._flops_per_token is not None:
            device_flops = (last.flops - first.flops) / state.world_size
            metrics["throughput/device/flops_per_sec"] = device_flops / seconds
            mfu_seconds = last.mfu_seconds - first.mfu_seconds
            if self._mfu_clock is not perf_counter and mfu_seconds > 0:
                # MFU's numerator on its own clock, so that MFU reads as this over the peak;
                # flops_per_sec above, on the wall clock, also counts the time other processes
                # had the cores (and this one waited for its peers).
                metrics["throughput/device/flops_per_cpu_sec"] = device_flops / mfu_seconds
            if self._peak is not None and mfu_seconds > 0:
                utilization = device_flops / mfu_seconds / self._peak
                metrics["throughput/mfu"] = utilization
                metrics["throughput/hfu"] = utilization * self._hfu_factor
        logger.log_metrics(metrics)
