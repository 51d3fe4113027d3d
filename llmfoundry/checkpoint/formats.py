"""The checkpoint formats a load path may hold, behind one interface; a path is resolved once.

`locate(path)` asks each format in `FORMATS` whether it can read `path` and returns the first
that can, with where its checkpoint is (a save folder resolves to its checkpoint to continue
from); every script and the trainer read through what it returns:
- `model_fields`: the model config as conf/model writes one (`model=from_checkpoint`);
- `read_model`: the weights, the model config and the tokenizer (generate, eval, serve,
  export_hf, import_hf, `load_pretrained`);
- `read_run`: everything a run continues from (weights, optimizer, position, RNG), in our run
  state's layout (state_dict.py's `restore` loads it).
What they return is loaded.py's.

Formats: ours (reader.py and ours.py: a checkpoint folder or save folder; its sharded/ holds DCP's
shards (dcp_reader.py) or DeepSpeed's files (deepspeed.py), told apart by their files
(`sharded.written_by_deepspeed`) and read by the run's strategy) and
Composer's (composer.py: its monolithic file, read by restricted_pickle.py, or its sharded DCP
folder, composer_sharded.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from llmfoundry.checkpoint import composer, composer_sharded, ours, probe
from llmfoundry.checkpoint.loaded import Checkpoint, SavedModel
from llmfoundry.checkpoint.manifest import CheckpointError, describe
from llmfoundry.checkpoint.reader import read_checkpoint
from llmfoundry.checkpoint.writer import distributed
from llmfoundry.utils.errors import UserError


class CheckpointFormat(Protocol):
    """One way of storing a checkpoint."""

    name: str

    def locate(self, path: str) -> str | None:
        """The checkpoint `path` names in this format (a save folder: its checkpoint to
        continue from), or None when `path` is not in this format."""

    def model_fields(self, location: str) -> dict[str, Any]:
        """The model config of the checkpoint at `location` as conf/model writes one
        (``_target_`` and fields), reading no more of it than needed."""

    def read_model(self, location: str) -> SavedModel:
        """The model of the checkpoint at `location`, whole, in this process."""

    def read_run(self, location: str, rank: int) -> Checkpoint:
        """What `rank` continues a run from: weights (None: shards the strategy reads), run state
        in our layout, its RNG states."""


@dataclass(frozen=True)
class Located:
    """A load path resolved: the format that reads it, and where its checkpoint is."""

    format: CheckpointFormat
    location: str

    def model_fields(self) -> dict[str, Any]:
        return self.format.model_fields(self.location)

    def read_model(self) -> SavedModel:
        return self.format.read_model(self.location)

    def read_run(self, rank: int) -> Checkpoint:
        return self.format.read_run(self.location, rank)


class ComposerFormat:
    """Composer's checkpoints (composer.py): a monolithic ``*-rank0.pt`` or a sharded folder."""

    name = "Composer"

    def locate(self, path: str) -> str | None:
        return path if composer.is_monolithic(path) or composer_sharded.is_sharded(path) else None

    def model_fields(self, location: str) -> dict[str, Any]:
        return composer.model_fields(composer.read(location))

    def read_model(self, location: str) -> SavedModel:
        saved = composer.read(location)
        return SavedModel(
            weights=composer.weights(saved),
            config=composer.model_config(saved),
            tokenizer=composer.tokenizer_folder(saved),
            run_name=composer.run_name(saved),
        )

    def read_run(self, location: str, rank: int) -> Checkpoint:
        return composer.read_run(location, rank)


class OurFormat:
    """Our checkpoint folders (ours.py); last, since its `locate` raises for what no format
    reads, naming what the path is instead."""

    name = "llmfoundry"

    def locate(self, path: str) -> str | None:
        return probe.resolve(path)

    def model_fields(self, location: str) -> dict[str, Any]:
        return ours.model_fields(location)

    def read_model(self, location: str) -> SavedModel:
        return ours.read_model(location)

    def read_run(self, location: str, rank: int) -> Checkpoint:
        return read_checkpoint(location, rank)


FORMATS: tuple[CheckpointFormat, ...] = (ComposerFormat(), OurFormat())


def locate(path: str) -> Located:
    """The format of the checkpoint at `path` and where it is; a one-line error when none reads
    it."""
    for fmt in FORMATS:
        location = fmt.locate(path)
        if location is not None:
            return Located(fmt, location)
    raise AssertionError("OurFormat.locate raises for what no format reads")


def read_run_together(path: str, rank: int) -> Checkpoint:
    """`locate(path).read_run(rank)` by every rank of a run at once (the trainer's load), failing
    on every rank when it fails on one. Each rank hashes only its share of the other ranks' files
    and reads its own RNG file, so a damaged file fails one rank: alone, it left the others
    waiting for it in the shards' load, to fail there with a peer's traceback ("Connection
    closed by peer") or wait out the process group's timeout. Every rank raises the first
    failing rank's one-line error instead (that rank its own exception)."""
    failure: Exception | None = None
    try:
        checkpoint = locate(path).read_run(rank)
    except Exception as err:  # noqa: BLE001 - raised below, once the ranks know of it
        failure = err
    if distributed():
        said: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(said, None if failure is None else _said(failure))
        first = next(((r, m) for r, m in enumerate(said) if m is not None), None)
        if failure is None and first is not None:
            other, (user_error, message) = first
            if user_error:
                raise CheckpointError(message)
            raise RuntimeError(f"rank {other} failed to read the checkpoint at {path}: {message}")
    if failure is not None:
        raise failure
    return checkpoint


def _said(err: Exception) -> tuple[bool, str]:
    """What a rank tells the others of its failure: whether the user can fix it, and how."""
    return (True, str(err)) if isinstance(err, UserError) else (False, describe(err))
