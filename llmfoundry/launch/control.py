"""One run's details and stopping it, whatever started it: `scripts/runs.py describe|stop NAME`.

Where a run runs is in its status file (`llmfoundry.callbacks.run_status`): ``backend`` and
``job_id`` (a Slurm job id, a Kubernetes ``namespace/name``), and for every run the host and
pid of its rank 0. Stopping asks the run to checkpoint and stop, as a scheduler does:

- local: SIGTERM to rank 0's process on this host: every rank learns of it in the next step's
  all-reduce and they all checkpoint and stop (`llmfoundry.checkpoint.preemption`), so torchrun
  and the launcher relaying its output end as after a preemption, with the run's last lines;
- slurm: ``scancel <job id>`` (Slurm sends SIGTERM, then SIGKILL after its KillWait);
- kubernetes: the Job and its Service are deleted (pods get SIGTERM and their grace period).

Status files are written by other users' processes: a job id is passed on only when it has its
backend's form, and a pid is signalled only when this host wrote it and the process still runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
from typing import Any

import yaml

from llmfoundry.config.run_files import CONFIG_DIR
from llmfoundry.launch.monitor import Run, format_seconds, process_gone
from llmfoundry.utils import storage
from llmfoundry.utils.errors import UserError, printable
from llmfoundry.utils.secrets import redact_urls
from llmfoundry.utils.storage import url_to_fs
from llmfoundry.utils.yaml_guard import safe_load

_SLURM_JOB = re.compile(r"\d+(_\d+)?\Z")
_K8S_JOB = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
# Statuses of a run something still runs (a preempted Slurm job is requeued, a pod restarted).
_ACTIVE = {"local": ("running",), "slurm": ("running", "preempted")}
_ACTIVE["kubernetes"] = _ACTIVE["slurm"]
# The config values `describe` shows: what tells runs apart, never credentials (URLs redacted).
SUMMARY_KEYS = (
    "max_duration",
    "global_train_batch_size",
    "precision",
    "optimizer.lr",
    "parallelism.tp",
    "parallelism.pp",
    "data.remote",
    "save_folder",
)
# Bytes read from the end of metrics.jsonl for its last line (a line is well under this).
METRICS_TAIL_BYTES = 64 << 10
# Characters shown of one value (status files, configs and metrics are written by others).
MAX_VALUE = 400


def describe(run: Run) -> str:
    """The run as `key  value` lines: status, where it runs, its folder and checkpoint, a
    summary of its config and its last logged metrics."""
    record = run.record
    step = "-" if run.step is None else f"{run.step}/{run.total_steps or '?'}"
    lines = [
        ("name", run.name),
        ("status", run.status + (f" ({run.note})" if run.note else "")),
        ("step", step),
        ("loss", "-" if run.loss is None else f"{run.loss:.4f}"),
        ("eta", format_seconds(run.eta_s)),
        ("backend", _where(record)),
        ("folder", run.folder),
        ("checkpoint", run.checkpoint or "-"),
    ]
    try:
        lines += [(f"config {k}", v) for k, v in config_summary(run.folder).items()]
    except (UserError, yaml.YAMLError) as err:  # (a broken config: the rest is worth showing)
        lines.append(("config", f"unreadable: {(str(err).splitlines() or [''])[0]}"))
    step_logged, metrics = last_metrics(run.folder)
    if metrics:
        shown = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
        )
        step_shown = step_logged if isinstance(step_logged, int) else "?"
        lines.append((f"metrics (step {step_shown})", shown))
    width = max(len(key) for key, _ in lines)
    return "\n".join(f"{key.ljust(width)}  {_shown(value)}" for key, value in lines)


def _shown(value: object) -> str:
    text = printable(str(value))
    return text if len(text) <= MAX_VALUE else f"{text[: MAX_VALUE - 3]}..."


def _where(record: dict[str, Any]) -> str:
    if not record:
        return "unknown (no status file)"
    backend, job_id = record.get("backend"), record.get("job_id")
    host, pid = record.get("host", "?"), record.get("pid", "?")
    if backend in ("slurm", "kubernetes") and job_id:
        return f"{backend} job {job_id} (rank 0: pid {pid} on {host})"
    return f"local (pid {pid} on {host})"


def config_summary(folder: str) -> dict[str, str]:
    """`SUMMARY_KEYS` of the run's saved config (and the config groups chosen), {} without one."""
    path = f"{folder}/{CONFIG_DIR}/config.yaml"
    try:
        config = safe_load(storage.read_small(path, 1 << 20), path)
    except FileNotFoundError:
        return {}
    summary = {}
    for key in SUMMARY_KEYS:
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is not None and not isinstance(value, dict | list):
            summary[key] = redact_urls(str(value))
    return summary


def last_metrics(folder: str) -> tuple[int | None, dict[str, Any]]:
    """(step, metrics) of the last line of the run's metrics.jsonl; (None, {}) without one."""
    fs, path = url_to_fs(f"{folder}/metrics.jsonl")
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None, {}
    if info.get("type") != "file":  # a FIFO would block the reader
        return None, {}
    size = info.get("size") or 0
    tail = fs.cat_file(path, start=max(0, size - METRICS_TAIL_BYTES), end=size)
    for line in reversed(tail.decode("utf-8", "replace").splitlines()):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("metrics"), dict):
            return record.get("step"), record["metrics"]
    return None, {}


def stop_target(run: Run) -> tuple[str, str]:
    """(backend, what is stopped) for `run`, or UserError saying why it cannot be stopped."""
    record = run.record
    if not record:
        raise UserError(
            f"run {run.name} has no status file, so what runs it is unknown; stop it where it "
            "runs (add run_status to callbacks= to make runs stoppable from here)"
        )
    backend = record.get("backend") or "local"
    if backend not in _ACTIVE or run.status not in _ACTIVE[backend]:
        raise UserError(f"run {run.name} is {run.status}: nothing to stop")
    job_id = record.get("job_id") or ""
    if backend == "slurm" and _SLURM_JOB.match(job_id):
        return backend, job_id
    if backend == "kubernetes" and _K8S_JOB.match(job_id):
        return backend, job_id
    if backend != "local":
        raise UserError(
            f"run {run.name}: its status file's job id {job_id!r} is not a {backend} job id"
        )
    if record.get("host") != socket.gethostname():
        raise UserError(
            f"run {run.name} runs on host {printable(str(record.get('host')))}, not this one; "
            "run `scripts/runs.py stop` there"
        )
    if process_gone(record):
        raise UserError(f"run {run.name}: its process {record.get('pid')} is gone already")
    return backend, str(record["pid"])


def stop(backend: str, target: str) -> str:
    """Ask the run to checkpoint and stop; what was done, as one line."""
    if backend == "slurm":
        result = subprocess.run(["scancel", target], capture_output=True, text=True)
        if result.returncode:
            raise UserError(f"scancel {target} failed: {result.stderr.strip()}")
        return f"cancelled Slurm job {target} (the run checkpoints on SIGTERM)"
    if backend == "kubernetes":
        return _delete_kubernetes_job(*target.split("/"))
    os.kill(int(target), signal.SIGTERM)
    return f"sent SIGTERM to process {target} (rank 0): the run checkpoints and stops"


def _delete_kubernetes_job(namespace: str, name: str) -> str:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    try:
        client.BatchV1Api().delete_namespaced_job(name, namespace, propagation_policy="Background")
    except client.ApiException as err:
        if err.status != 404:
            raise
        raise UserError(f"no Job {name} in namespace {namespace}: it was deleted already") from None
    try:
        client.CoreV1Api().delete_namespaced_service(name, namespace)
    except client.ApiException as err:
        if err.status != 404:
            raise
    return f"deleted Job and Service {name} in namespace {namespace} (pods get SIGTERM)"
