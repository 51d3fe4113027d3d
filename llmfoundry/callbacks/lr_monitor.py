"""The learning rate of each parameter group, after every batch."""

from __future__ import annotations

from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State


class LRMonitor(Callback):
    def batch_end(self, state: State, logger: Logger) -> None:
        groups = state.optimizer.param_groups
        logger.log_metrics({f"lr/group{i}": group["lr"] for i, group in enumerate(groups)})
