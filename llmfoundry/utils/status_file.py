"""The run's status file: how `scripts/runs.py` and the launchers know where a run stands.

Rank 0 writes one small JSON object (`llmfoundry.callbacks.run_status`), replacing it atomically
(a temporary file renamed over it locally; a single PUT on object stores), so a reader never sees
half a file:

    {"run_name", "status", "step", "total_steps", "max_duration", "progress", "loss",
     "tokens_per_sec", "eta_s", "save_folder", "started", "updated", "host", "pid", "world_size",
     "backend", "job_id", "error"}

``backend`` says what started the run and ``job_id`` its id there (`launcher`): what
``scripts/runs.py stop`` cancels (local runs: the pid on the host).

Apart from the callback (and so from torch): the launchers, `scripts/runs.py` and the command
that ends every launched run's script read it, and start in a fraction of the seconds the
trainer's imports take.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import atomic_write
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


def json_number(value: float | None) -> float | str | None:
    """`value` as JSON holds it: NaN and infinities as their text (`NON_FINITE`); the strict
    JSON writer refused them, which ended a diverging run at its next heartbeat."""
    return str(value) if value is not None and not math.isfinite(value) else value


def _refuse_constant(name: str) -> None:
    raise UserError(f"{name} in a status file, which the writer never writes")
