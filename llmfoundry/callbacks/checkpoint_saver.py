"""Save checkpoints: every `save_interval`, when the run stops early, and at the end.

A run stops early when a callback or algorithm sets ``state.stop_training`` (early stopping, the
loss-spike guard) or on SIGTERM/SIGINT (preemption); the checkpoint is then taken at the end of
the batch that stopped it, so rerunning with ``autoresume=true`` loses nothing. Before each save
the loggers flush (`Logger.flush`): a checkpoint never covers steps whose metrics a kill could
still lose. Writing: llmfoundry/checkpoint/writer.py; the `latest` pointer and pruning:
llmfoundry/checkpoint/catalogue.py.

A save folder that already holds checkpoints is never written over silently: unless the run
continues from a checkpoint (autoresume, load_path), it stops at FIT_START, before its first
batch, naming the folder and the ways on; ``overwrite=True`` (``save_overwrite=true``) replaces
the old checkpoints, which are deleted once the run's first checkpoint is saved.

With a strategy that saves in the background (``strategy.async_save``) a save returns once the
state is copied, and counts (manifest, `latest`, then pruning) when the saver finishes it:
before the next save, at the end of the run, and at once when the run stops early (a preempted
run has no FIT_END). A run that dies first leaves that checkpoint incomplete: it never counts.
"""

from __future__ import annotations

import copy
import logging

from llmfoundry.checkpoint import (
    CheckpointError,
    PendingCheckpoint,
    begin_save,
    checkpoint_names,
    clean,
    delete_checkpoints,
    newest_complete,
    prune,
    save_checkpoint,
)
from llmfoundry.core.engine import Callback, Logger
from llmfoundry.core.state import State
from llmfoundry.core.time import Time, Timestamp, TimeUnit
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)


class SavesEvery(Callback):
    """A callback that calls `save(state, logger)` every `save_interval` (a Time string in any
    unit, or None: never on an interval) and when training ends; CheckpointSaver and
    HFCheckpointer are this. Batch, sample, token and wall-clock intervals are checked after
    each batch, epoch intervals after each epoch (State.crossed counts an epoch interval as
    crossed only there). `save_when_stopped`: save too after the batch that set
    ``state.stop_training``."""

    save_when_stopped = False

    def __init__(self, save_interval: str | None) -> None:
        self.save_interval = Time.parse(save_interval) if save_interval else None
        self._before = Timestamp()
        self._epoch_start = Timestamp()

    def save(self, state: State, logger: Logger) -> None:
        raise NotImplementedError

    def epoch_start(self, state: State, logger: Logger) -> None:
        self._epoch_start = copy.copy(state.timestamp)

    def batch_start(self, state: State, logger: Logger) -> None:
        self._before = copy.copy(state.timestamp)

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        due = self.save_interval is not None and state.crossed(self.save_interval, self._before)
        if due or (self.save_when_stopped and state.stop_training):
            self.save(state, logger)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        interval = self.save_interval
        if (
            interval
            and interval.unit is TimeUnit.EPOCH
            and state.crossed(interval, self._epoch_start)
        ):
            self.save(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.save(state, logger)


class CheckpointSaver(SavesEvery):
    """Args:
    save_folder: local folder or fsspec URL (``s3://bucket/runs/x/checkpoints``).
    save_interval: Time string in any unit (``500ba``, ``1ep``, ``1000000tok``, ``0.25dur``,
        ``1h``); None saves only when the run stops or ends.
    num_checkpoints_to_keep: newest checkpoints kept (older ones are deleted; the one
        `latest` names never is); -1 keeps all.
    overwrite: replace the checkpoints a folder holds when the run does not continue from one.
    """

    save_when_stopped = True

    def __init__(
        self,
        save_folder: str,
        save_interval: str | None = None,
        num_checkpoints_to_keep: int = -1,
        overwrite: bool = False,
    ) -> None:
        if not save_folder:
            raise UserError("save_folder must name a folder or URL to save checkpoints to")
        if num_checkpoints_to_keep == 0 or num_checkpoints_to_keep < -1:
            raise UserError(
                f"num_checkpoints_to_keep must be -1 (keep all) or a positive number, got "
                f"{num_checkpoints_to_keep}"
            )
        super().__init__(save_interval)
        self.save_folder = save_folder
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.overwrite = overwrite
        self.last_saved: str | None = None
        self._saved_batch: int | None = None
        self._resumed = False
        self._replaced: list[str] = []  # old checkpoints `overwrite` deletes after the first save
        self._pending: PendingCheckpoint | None = None  # a save still writing in the background

    def after_load(self, state: State, logger: Logger) -> None:
        # The checkpoint just loaded is this point of the run: saving it again would only
        # rewrite the checkpoint `latest` names.
        self._saved_batch = state.timestamp.batch
        # A checkpoint loaded without its timestamp (weights only) starts a new run at batch 0.
        self._resumed = state.timestamp.batch > 0

    def fit_start(self, state: State, logger: Logger) -> None:
        existing = [] if self._resumed else checkpoint_names(self.save_folder)
        if existing and not self.overwrite:
            newest = newest_complete(self.save_folder)
            holds = f"checkpoints up to {newest}" if newest else "incomplete checkpoints"
            raise CheckpointError(
                f"save_folder {self.save_folder} already holds {holds}, and this run would "
                "write over them; set autoresume=true to continue from them, or a new run_name "
                "(or save_folder) to keep them, or save_overwrite=true to replace them"
            )
        if existing:
            log.warning(
                "save_overwrite: the checkpoints in %s (%s) are deleted once this run saves its "
                "first one",
                self.save_folder,
                ", ".join(existing),
            )
            self._replaced = existing
        if state.rank == 0:
            clean(self.save_folder)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.save(state, logger)
        self.finish(state)

    def save(self, state: State, logger: Logger) -> None:
        """Save now (once per batch: a second call at the same batch does nothing)."""
        if self._saved_batch == state.timestamp.batch:
            return
        self.finish(state)
        logger.flush()  # the metrics up to this checkpoint are kept before it counts
        if state.strategy.async_save and not state.stop_training:
            self._pending = begin_save(self.save_folder, state, logger)
        else:
            self.last_saved = save_checkpoint(self.save_folder, state, logger)
            self._saved(state)
        self._saved_batch = state.timestamp.batch

    def finish(self, state: State) -> None:
        """Complete the save going on in the background, if any (every rank calls this)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        self.last_saved = pending.finish()
        self._saved(state)

    def close(self) -> None:
        """A run ending in an error: let a background write end (the process group is torn
        down next) and drop it; it never counts (no manifest)."""
        if self._pending is not None:
            self._pending.abandon()
            self._pending = None

    def _saved(self, state: State) -> None:
        """A checkpoint counts now: delete what it replaces, prune older ones."""
        if state.rank == 0:
            name = self.last_saved.rstrip("/").rsplit("/", 1)[-1]
            delete_checkpoints(self.save_folder, [n for n in self._replaced if n != name])
            self._replaced = []
            deleted = prune(self.save_folder, self.num_checkpoints_to_keep)
            note = f" (deleted {', '.join(deleted)})" if deleted else ""
            log.info("saved checkpoint %s%s", self.last_saved, note)
