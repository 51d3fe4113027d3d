"""The run's status file: how `scripts/runs.py` and the launchers know where a run stands.

Rank 0 writes one small JSON object, replacing it atomically (a temporary file renamed over it
locally; a single PUT on object stores), so a reader never sees half a file:

    {"run_name", "status", "step", "total_steps", "max_duration", "progress", "loss",
     "tokens_per_sec", "eta_s", "save_folder", "started", "updated", "host", "pid", "world_size",
     "backend", "job_id", "error"}

``backend`` says what started the run and ``job_id`` its id there (`launcher`): what
``scripts/runs.py stop`` cancels (local runs: the pid on the host).

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

import json
import math
import os
import socket
import sys
import time
from typing import Any

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.core.time import TimeUnit
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import atomic_write
from llmfoundry.utils.secrets import redact_urls
from llmfoundry.utils.storage import is_local, local_path, read_small, url_to_fs

STATUSES = ("running", "finished", "preempted", "failed")
# A record is well under 2 KB (its error at most 500 characters): a larger file is not one.
MAX_STATUS_BYTES = 64 << 10
# The record's fields and the type each is written with (float: any number); readers rely on it.
FIELD_TYPES: dict[str, type] = {
    "run_name": str, "status": str, "step": int, "total_steps": int, "max_duration": str,
    "progress": float, "loss": float, "tokens_per_sec": float, "eta_s": float,
    "save_folder": str, "started": float, "updated": float, "host": str, "pid": int,
    "world_size": int, "backend": str, "job_id": str, "error": str,
}  # fmt: skip
# Set in the pods of a Kubernetes job the launcher renders: "<namespace>/<job name>".
KUBERNETES_JOB_ENV = "LLMFOUNDRY_KUBERNETES_JOB"


def launcher() -> dict[str, str]:
    """The scheduler running this process and its job id there: a Slurm job (any, also one
    started without scripts/launch.py) keeps its id when requeued; else local."""
    if os.environ.get("SLURM_JOB_ID"):
        return {"backend": "slurm", "job_id": os.environ["SLURM_JOB_ID"]}
    if os.environ.get(KUBERNETES_JOB_ENV):
        return {"backend": "kubernetes", "job_id": os.environ[KUBERNETES_JOB_ENV]}
    return {"backend": "local"}


def write_status(path: str, record: dict[str, Any]) -> None:
    """Replace the file at `path` (local or fsspec URL) with `record`, atomically."""
    text = json.dumps(record, allow_nan=False, default=str)
    if is_local(path):
        atomic_write(local_path(path), text)
        return
    fs, remote = url_to_fs(path)
    fs.pipe_file(remote, text.encode())  # one PUT: readers see the old object or the new one


def read_status(path: str) -> dict[str, Any] | None:
    """The status at `path`, or None when there is none yet.

    Run folders are written by other processes, often other users' (a shared outputs folder or
    bucket): a file that is not a record as `write_status` writes it (too large, not a regular
    file, not UTF-8 JSON, NaN, a field of another type) raises ValueError (`UserError`, or
    json's JSONDecodeError) naming the problem, and is never read beyond `MAX_STATUS_BYTES`.
    """
    try:
        data = read_small(path, MAX_STATUS_BYTES)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except UserError as err:
        raise UserError(f"{path}: {err}") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{path}: not UTF-8 (byte {err.start}); not a status file") from None
    except RecursionError:
        raise UserError(f"{path}: JSON nested too deeply; not a status file") from None
    if not isinstance(record, dict):
        raise UserError(f"{path}: a JSON {type(record).__name__}, not a status record")
    if record.get("loss") in NON_FINITE:
        record["loss"] = float(record["loss"])
    for key, kind in FIELD_TYPES.items():
        value = record.get(key)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (number if kind is float else type(value) is kind):
            shown = repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
            kinds = {str: "a string", int: "an integer", float: "a number"}
            raise UserError(f"{path}: {key} is {shown}, not {kinds[kind]}")
        if number and key != "loss" and not math.isfinite(value):  # (1e999 reads as inf)
            raise UserError(f"{path}: {key} is {value}, not a finite number")
    return record


# A diverged run's loss: JSON has no NaN, so it is written as this text (and read back).
NON_FINITE = ("nan", "inf", "-inf")


def _json_number(value: float | None) -> float | str | None:
    """`value` as JSON holds it: NaN and infinities as their text (`NON_FINITE`); the strict
    JSON writer refused them, which ended a diverging run at its next heartbeat."""
    return str(value) if value is not None and not math.isfinite(value) else value


def _refuse_constant(name: str) -> None:
    raise UserError(f"{name} in a status file, which the writer never writes")


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
            loss=_json_number(state.train_loss),
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
