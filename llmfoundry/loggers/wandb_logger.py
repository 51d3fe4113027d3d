"""Metrics and the config to Weights & Biases.

The W&B run is named after the training run and its files go to the run folder unless
``WANDB_DIR`` or `dir` say otherwise. ``WANDB_MODE=offline`` (or ``mode: offline``) records
everything locally for ``wandb sync`` later, e.g. on clusters without internet. The config is
sent with secret-named keys removed and the command line redacted (`llmfoundry.utils.secrets`). Only rank 0 logs.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from llmfoundry.core.engine import Logger
from llmfoundry.core.state import State
from llmfoundry.core.time import TimeString
from llmfoundry.loggers.buffered import BufferedDestination
from llmfoundry.utils.errors import MissingPackage
from llmfoundry.utils.secrets import redact_argv, redact_secrets


class WandBLogger(BufferedDestination):
    def __init__(
        self,
        project: str | None = None,
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: list[str] | None = None,
        mode: str | None = None,
        dir: str | None = None,
        init_kwargs: dict[str, Any] | None = None,
        flush_interval: TimeString = "10ba",
    ) -> None:
        """`mode`: online, offline or disabled (default: ``WANDB_MODE``, else online).
        `init_kwargs`: any further `wandb.init` arguments (e.g. ``id`` and ``resume: allow`` to
        continue a W&B run after a restart). Metrics are sent every `flush_interval`
        (`llmfoundry.loggers.buffered`)."""
        super().__init__(flush_interval)
        self.init_args = {
            "project": project,
            "entity": entity,
            "name": name,
            "group": group,
            "tags": list(tags) if tags else None,
            "mode": mode,
            "dir": dir,
            **(init_kwargs or {}),
        }
        self._run: Any = None

    def init(self, state: State, logger: Logger) -> None:
        if state.rank != 0:
            return
        try:
            import wandb
        except ImportError:
            raise MissingPackage(
                "loggers.wandb needs the wandb package: pip install 'llmfoundry[wandb]'"
            ) from None
        args = dict(self.init_args)
        args["name"] = args["name"] or state.config.get("run_name") or state.run_dir.name
        args["dir"] = args["dir"] or os.environ.get("WANDB_DIR") or str(state.run_dir)
        os.makedirs(args["dir"], exist_ok=True)
        # W&B stores the command line with the run; overrides may carry credentials.
        argv = sys.argv
        sys.argv = [argv[0], *redact_argv(argv[1:])]
        try:
            self._run = wandb.init(**{k: v for k, v in args.items() if v is not None})
        finally:
            sys.argv = argv
        self.log_hyperparameters(state.config)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self._run is not None:
            self._run.config.update(redact_secrets(hyperparameters), allow_val_change=True)

    def write_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._run is not None:
            self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.flush()
        if self._run is not None:
            self._run.finish()
            self._run = None
