"""Save checkpoints into the run folder: periodically and at the end of training."""

from __future__ import annotations

import copy
from pathlib import Path

from llmfoundry.checkpoint import save_checkpoint, training_state
from llmfoundry.trainer.engine import Callback, Logger
from llmfoundry.trainer.state import State
from llmfoundry.trainer.time import Time, Timestamp


class CheckpointSaver(Callback):
    def __init__(self, save_folder: str | None = None, save_interval: str | None = None) -> None:
        self.save_folder = save_folder
        self.save_interval = Time.parse(save_interval) if save_interval else None
        self._before = Timestamp()
        self.last_saved: Path | None = None

    def _folder(self, state: State) -> Path:
        return Path(self.save_folder) if self.save_folder else state.run_dir / "checkpoints"

    def batch_start(self, state: State, logger: Logger) -> None:
        self._before = copy.copy(state.timestamp)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.save_interval and state.crossed(self.save_interval, self._before):
            self._save(state)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.last_saved is None or f"ba{state.timestamp.batch}" not in self.last_saved.name:
            self._save(state)

    def _save(self, state: State) -> None:
        path = self._folder(state) / f"ep{state.timestamp.epoch}-ba{state.timestamp.batch}.pt"
        if state.rank == 0:
            save_checkpoint(training_state(state), path)
            print(f"saved checkpoint {path}", flush=True)
        self.last_saved = path
