"""One run name for all processes of a run, so every rank writes into the same run folder.

Hydra names its output folder by the time each process starts, which differs between the ranks
that torchrun launches. The run name is therefore taken from what all ranks share.

A run name becomes a path (``outputs/<run_name>``, its checkpoints, a sweep trial's folder), so
it must be one folder name (`check_run_name`): ``run_name=..`` would make the working directory
the run folder, ``../../x`` write outside ``outputs/``, and ``''`` make ``outputs/`` itself the
run folder. The rule keeps to ASCII letters, digits and ``._+=-``, which every filesystem, object
store URL and terminal takes as they are (no quoting, no look-alike characters).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import PurePath

from llmfoundry.config.schema import ConfigError

# One folder name: not '.', '..' or hidden (no leading '.'), not an option ('-x'), no separator.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]{0,127}\Z")
RUN_NAME_RULE = "use 1-128 ASCII letters, digits and '._+=-', starting with a letter, digit or '_'"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+=-]")


def check_run_name(name: str) -> None:
    """Raise ConfigError unless `name` is a run name (`RUN_NAME`), or the name of a trial of the
    running sweep (``<sweep folder>/<job number>``, `default_run_name`) whose two parts are."""
    parts = name.split("/") if name and name == _multirun_job_name() else [name]
    if all(RUN_NAME.match(part) for part in parts):
        return
    shown = repr(name) if len(name) <= 80 else f"{name[:60]!r}... ({len(name)} characters)"
    raise ConfigError(
        "run_name",
        f"{shown} is not one folder name (the run's folder is outputs/<run_name>); "
        f"{RUN_NAME_RULE}, e.g. run_name=my-run-2",
    )


def default_run_name(env: Mapping[str, str] | None = None, now: float | None = None) -> str:
    """Run name when `run_name` is not set.

    - torchrun with a rendezvous id (``--standalone`` makes one per launch): that id.
    - several processes without one: the rendezvous address and port, which all ranks share
      (set `run_name` explicitly for multi-node runs that reuse a port).
    - one process: the start time.
    - a job of a Hydra multirun (sweep): ``<sweep folder name>/<job number>``, so each trial
      has its own name and its folder (``outputs/<run_name>``) is the one Hydra gives the job.
    """
    sweep_job = _multirun_job_name()
    if sweep_job:
        return sweep_job
    env = os.environ if env is None else env
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now))
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return _safe(f"run-{run_id[:8]}")
    if int(env.get("WORLD_SIZE", "1")) > 1:
        addr = env.get("MASTER_ADDR", "localhost").replace(".", "-")
        return _safe(f"run-{addr}-{env.get('MASTER_PORT', '0')}")
    return f"run-{stamp}"


def _safe(name: str) -> str:
    """`name` (built from a rendezvous id or address the user chose: ``--rdzv-id=a/b``, an IPv6
    ``::1``) as a run name: other characters become '-'."""
    return _UNSAFE.sub("-", name)[:128]


def _multirun_job_name() -> str | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN:
        return None
    return f"{PurePath(hydra.sweep.dir).name}/{hydra.job.num}"
