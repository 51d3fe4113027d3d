"""Metrics as JSON Lines: one object per log call, the run's durable, tool-free record.

Each line is ``{"step": <batches trained>, "time": <unix seconds>, "metrics": {name: value}}``;
the first line of a run is ``{"time": ..., "hyperparameters": {...}}`` (secrets removed).
Non-finite values are written as null, so every line is strict JSON. Lines are written every
`flush_interval` (values still on the device are read then, `llmfoundry.loggers.buffered`), at
evaluations, at the end, at close and before every checkpoint save (then also fsynced, as the
checkpoint is), each line handed to the OS as it is written: a run that fails keeps everything it
logged, a killed one all it logged up to its last checkpoint. A resumed run appends to the same
file and re-logs the steps after its checkpoint; readers keep the last value of a step
(`llmfoundry.loggers.plot.read_metrics`). Only rank 0 writes.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import IO, Any

from llmfoundry.core.engine import Logger
from llmfoundry.core.state import State
from llmfoundry.core.time import TimeString
from llmfoundry.loggers.buffered import BufferedDestination
from llmfoundry.utils.secrets import redact_secrets


class JSONLLogger(BufferedDestination):
    def __init__(self, path: str = "metrics.jsonl", flush_interval: TimeString = "10ba") -> None:
        """`path`: the file; a relative path is inside the run folder."""
        super().__init__(flush_interval)
        self.path = path
        self._file: IO[str] | None = None

    def init(self, state: State, logger: Logger) -> None:
        if state.rank != 0:
            return
        path = state.run_dir / Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # line-buffered
        self.log_hyperparameters(state.config)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._write({"time": time.time(), "hyperparameters": redact_secrets(hyperparameters)})

    def write_metrics(self, metrics: dict[str, float], step: int) -> None:
        values = {k: v if math.isfinite(v) else None for k, v in metrics.items()}
        self._write({"step": step, "time": time.time(), "metrics": values})

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")

    def flush(self) -> None:
        super().flush()
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
