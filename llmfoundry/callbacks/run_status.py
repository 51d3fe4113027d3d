"""The run's status file (`llmfoundry.utils.status_file`: its record and how it is read and
written), kept by rank 0 while the run trains.

``status`` is ``running`` from fit start (rewritten every `interval_s` seconds of training and at
each evaluation, so ``updated`` is a heartbeat), then ``finished`` at FIT_END, ``preempted``
when the run stopped early without FIT_END (SIGTERM/SIGINT: resumable with autoresume) or
``failed`` with the error when an exception ends training. A process killed outright (SIGKILL,
out of host memory) writes nothing more: readers treat a ``running`` status whose heartbeat is
old as lost (`llmfoundry.launch.monitor`).

Throughput and the ETA are measured here rather than read from the speed monitor and runtime
estimator, so the file stays complete when those callbacks are off: tokens per second over the
time since the previous write, and the time per unit of progress since the first batch (which
carries one-off costs) times the progress still to go.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.core.time import TimeUnit
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.secrets import redact_urls
from llmfoundry.utils.status_file import json_number, launcher, write_status


class RunStatus(Callback):
    def __init__(self, path: str = "status.json", interval_s: float = 10.0) -> None:
        """`path`: the file; relative paths are inside the run folder, URLs (s3://...) are
        written through fsspec. `interval_s`: seconds between heartbeat writes while training."""
        if interval_s <= 0:
            raise UserError(f"interval_s must be positive, got {interval_s}")
        self.path = path
        self.interval_s = interval_s
        self._record: dict[str, Any] = {}
        self._state: State | None = None
        self._last_write = 0.0
        self._last_tokens = 0
        # (wall clock, progress) at the first batch end: where the ETA's rate is measured from.
        self._reference: tuple[float, float] | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        if state.rank != 0:
            return
        self._state = state
        if "://" not in self.path:
            self.path = str(state.run_dir / self.path)
        config = state.config
        save_folder = config.get("save_folder")
        if save_folder and "://" not in save_folder:  # readable from any working directory
            save_folder = os.path.abspath(save_folder)
        self._record = {
            "run_name": config.get("run_name") or state.run_dir.name,
            "max_duration": str(state.max_duration),
            "save_folder": save_folder,
            "started": time.time(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "world_size": state.world_size,
            **launcher(),
        }
        self._last_tokens = state.timestamp.token
        self._last_write = time.perf_counter()
        self._write(state, "running")

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._state is None:
            return
        now, progress = time.perf_counter(), self._progress(state)
        if self._reference is None:
            self._reference = (now, progress)
        if now - self._last_write >= self.interval_s:
            self._write(state, "running")

    def eval_after_all(self, state: State, logger: Logger) -> None:
        if self._state is not None:
            self._write(state, "running")

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._state is not None:
            self._write(state, "finished")

    def close(self) -> None:
        """Training is over: record a failure (an exception is propagating) or an early stop."""
        state = self._state
        if state is None or self._record.get("status") == "finished":
            return
        error = sys.exc_info()[1]
        if error is not None:
            self._record["error"] = f"{type(error).__name__}: {redact_urls(str(error))[:500]}"
            self._write(state, "failed")
        else:
            self._write(state, "preempted")
        self._state = None

    def _write(self, state: State, status: str) -> None:
        now = time.perf_counter()
        ts = state.timestamp
        progress = self._progress(state)
        record = self._record
        record.update(
            status=status,
            updated=time.time(),
            step=ts.batch,
            progress=progress,
            total_steps=self._total_steps(state, progress),
            loss=json_number(state.train_loss),
        )
        if now > self._last_write and ts.token > self._last_tokens:
            record["tokens_per_sec"] = (ts.token - self._last_tokens) / (now - self._last_write)
        if self._reference is not None and progress > self._reference[1]:
            start, start_progress = self._reference
            rate = (now - start) / (progress - start_progress)
            record["eta_s"] = rate * (1.0 - progress) if status == "running" else 0.0
        self._last_write, self._last_tokens = now, ts.token
        write_status(self.path, record)

    @staticmethod
    def _progress(state: State) -> float:
        return min(state.elapsed(state.max_duration), 1.0)

    @staticmethod
    def _total_steps(state: State, progress: float) -> int | None:
        """max_duration in batches: exact when given in batches, else extrapolated."""
        if state.max_duration.unit is TimeUnit.BATCH:
            return int(state.max_duration.value)
        if progress > 0:
            return round(state.timestamp.batch / progress)
        return None
