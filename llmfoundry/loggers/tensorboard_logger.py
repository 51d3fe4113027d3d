"""Metrics as TensorBoard scalars, in the run folder: ``tensorboard --logdir outputs``.

Hyperparameters (secrets removed) go in as one text entry holding the config as JSON; the
scalar and text plugins are the two every TensorBoard version shows. Only rank 0 writes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmfoundry.core.engine import Logger
from llmfoundry.core.state import State
from llmfoundry.core.time import TimeString
from llmfoundry.loggers.buffered import BufferedDestination
from llmfoundry.utils.errors import MissingPackage, UserError
from llmfoundry.utils.secrets import redact_secrets


class TensorBoardLogger(BufferedDestination):
    def __init__(
        self,
        log_dir: str = "tensorboard",
        flush_secs: int = 30,
        flush_interval: TimeString = "10ba",
    ) -> None:
        """`log_dir`: a relative path is inside the run folder. Scalars are handed to the writer
        every `flush_interval` (`llmfoundry.loggers.buffered`), which writes them to disk at
        least every `flush_secs` seconds, before every checkpoint save, and at close."""
        super().__init__(flush_interval)
        if flush_secs < 1:
            raise UserError(f"flush_secs must be >= 1, got {flush_secs}")
        self.log_dir = log_dir
        self.flush_secs = flush_secs
        self._writer: Any = None

    def init(self, state: State, logger: Logger) -> None:
        if state.rank != 0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MissingPackage(
                "loggers.tensorboard needs the tensorboard package: "
                "pip install 'llmfoundry[tensorboard]'"
            ) from None
        log_dir = state.run_dir / Path(self.log_dir)
        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=self.flush_secs)
        self.log_hyperparameters(state.config)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        if self._writer is None:
            return
        text = json.dumps(redact_secrets(hyperparameters), indent=2, default=str)
        # Markdown: indent four spaces so the JSON shows as a code block.
        self._writer.add_text(
            "hyperparameters", "\n".join("    " + line for line in text.splitlines())
        )

    def write_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            return
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        super().flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.close()
            self._writer = None
