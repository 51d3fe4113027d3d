"""One run name for all processes of a run, so every rank writes into the same run folder.

Hydra names its output folder by the time each process starts, which differs between the ranks
that torchrun launches. The run name is therefore taken from what all ranks share.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import PurePath


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
        return f"run-{run_id[:8]}"
    if int(env.get("WORLD_SIZE", "1")) > 1:
        addr = env.get("MASTER_ADDR", "localhost").replace(".", "-")
        return f"run-{addr}-{env.get('MASTER_PORT', '0')}"
    return f"run-{stamp}"


def _multirun_job_name() -> str | None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.mode != RunMode.MULTIRUN:
        return None
    return f"{PurePath(hydra.sweep.dir).name}/{hydra.job.num}"
