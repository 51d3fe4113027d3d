"""What every trainer dataset shares: epochs, exact resumption, the rank partition, repeat masks.

A dataset numbers the samples of an epoch by *position* ``0 .. epoch_size - 1`` (its global
order, the same on every world size) and maps positions to sample ids with :meth:`order`;
sampling.py's :class:`RankPlan` hands each data-parallel rank its positions, padding the epoch
to a multiple of the world size by wrapping around. The trainer's contract
(``set_epoch``, ``state_dict(num_samples)``, ``load_state_dict``, ``len``) is implemented here
once, so an MDS dataset and a plain token file resume the same way.

Evaluation datasets (``evaluation=True``) mark the wrapped-around positions: their batches carry
``"sample_mask"`` (bool [B]), False for a sample that repeats one read earlier in the epoch, so
metrics can count every sample exactly once on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from llmfoundry.data.streaming.checks import check_int
from llmfoundry.data.streaming.sampling import RankPlan
from llmfoundry.data.streaming.world import World
from llmfoundry.trainer.metrics import SAMPLE_MASK  # the key the eval metrics read

__all__ = ["EpochDataset"]


class EpochDataset(IterableDataset):
    """Base of the trainer's datasets: subclasses set ``epoch_size`` and define ``order`` and
    ``get_batch``; ``state_checked`` names the attributes the order depends on, which a
    resumption must find unchanged.

    Args:
        batch_size: samples per rank per step; None hands out single samples.
        data_parallel: (rank, size) of this process among the data-parallel readers; default
            torchrun's RANK and WORLD_SIZE (world.py).
        evaluation: batches carry ``sample_mask`` (module docstring).
    """

    state_checked: tuple[str, ...] = ("epoch_size",)
    epoch_size: int
    # What data_prep recorded about the data (vocab_size, eos_id, ...) and where, if anything.
    meta: dict[str, Any] | None = None
    meta_url: str | None = None

    def __init__(
        self,
        *,
        batch_size: int | None = None,
        data_parallel: tuple[int, int] | None = None,
        evaluation: bool = False,
    ) -> None:
        super().__init__()
        check_int("batch_size", batch_size, minimum=1, optional=True)
        if not isinstance(evaluation, bool):
            raise TypeError(f"evaluation must be true or false, got {evaluation!r}")
        World.detect(data_parallel)  # a bad (rank, size) fails here, not at the first batch
        self.batch_size = batch_size
        self.data_parallel = data_parallel
        self.evaluation = evaluation
        self._epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, samples consumed)

    def order(self) -> Callable[[np.ndarray], np.ndarray]:
        """The current epoch's map from global positions to sample ids."""
        raise NotImplementedError

    def get_batch(self, ids: np.ndarray) -> Any:
        """The samples ``ids`` as one batch."""
        raise NotImplementedError

    def make_batch(self, ids: np.ndarray, positions: np.ndarray) -> Any:
        """The batch of ``ids`` (at global ``positions``), with ``sample_mask`` when evaluating."""
        batch = self.get_batch(ids)
        if self.evaluation:
            batch[SAMPLE_MASK] = torch.from_numpy(positions < self.epoch_size)
        return batch

    # -- epochs and resumption ------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration reads (its order is seeded by the epoch)."""
        check_int("epoch", epoch, minimum=0)
        self._epoch = epoch
        if self._resume is not None and self._resume[0] != epoch:
            self._resume = None

    def _start(self) -> int:
        if self._resume is not None and self._resume[0] == self._epoch:
            return self._resume[1]
        return 0

    def state_dict(self, num_samples: int, from_beginning: bool = True) -> dict[str, Any]:
        """Position after ``num_samples`` global samples of the current epoch.

        ``from_beginning=False`` counts from where this epoch was resumed instead of its start.
        """
        check_int("num_samples", num_samples, minimum=0)
        consumed = num_samples if from_beginning else self._start() + num_samples
        state = {"epoch": self._epoch, "sample_in_epoch": consumed}
        return state | {k: getattr(self, k) for k in self.state_checked}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next iteration of its epoch yields the remaining order."""
        missing = [k for k in ("epoch", "sample_in_epoch", *self.state_checked) if k not in state]
        if missing:
            raise ValueError(f"dataset state is missing {missing}; was it made by state_dict()?")
        changed = {
            k: (state[k], getattr(self, k))
            for k in self.state_checked
            if state[k] != getattr(self, k)
        }
        if changed:
            detail = ", ".join(
                f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items()
            )
            raise ValueError(
                f"cannot resume: the data order changed since the checkpoint ({detail}); "
                "resume with the same data and shuffle settings, or start a fresh run"
            )
        check_int("epoch", state["epoch"], minimum=0)
        check_int("sample_in_epoch", state["sample_in_epoch"], minimum=0)
        self._epoch = int(state["epoch"])
        self._resume = (self._epoch, int(state["sample_in_epoch"]))

    # -- the partition --------------------------------------------------------------------

    def _plan(self, world: World, start: int | None = None, batch_size: int | None = None):
        return RankPlan(
            self.epoch_size,
            self._start() if start is None else start,
            world.world_size,
            world.rank,
            batch_size or self.batch_size or 1,
        )

    def __len__(self) -> int:
        """Samples this rank reads in a full epoch: ``ceil(epoch_size / world_size)``."""
        return self._plan(World.detect(self.data_parallel), start=0, batch_size=1).num_samples

    def num_batches(self) -> int:
        """Batches this rank reads in a full epoch (needs ``batch_size``)."""
        if self.batch_size is None:
            raise ValueError("num_batches() needs the dataset's batch_size")
        return self._plan(World.detect(self.data_parallel), start=0).num_batches

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(sample ids, global positions) of this process's batches of the current epoch."""
        world = World.detect(self.data_parallel)
        yield from batch_ids(self.order(), self._plan(world), world)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """This process's samples of the current epoch, one at a time (rows of its batches)."""
        for ids, positions in self.batches():
            batch = self.make_batch(ids, positions)
            for row in range(len(ids)):
                yield {key: value[row] for key, value in batch.items()}


def batch_ids(
    order: Callable[[np.ndarray], np.ndarray], plan: RankPlan, world: World
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, positions) of the rank batches of ``plan`` that ``world``'s worker makes."""
    ks = plan.worker_batches(world.worker, world.num_workers)
    per_chunk = max(1, 4096 // plan.batch_size)  # amortise the lookup over many small batches
    for first in range(0, len(ks), per_chunk):
        starts, lengths = np.array([plan.span(k) for k in ks[first : first + per_chunk]]).T
        ends = np.cumsum(lengths)
        # Each batch's positions are consecutive: start, start + 1, ..., start + length - 1.
        positions = np.arange(ends[-1]) + np.repeat(starts - (ends - lengths), lengths)
        ids = order(positions)
        lo = 0
        for hi in ends.tolist():
            yield ids[lo:hi], positions[lo:hi]
            lo = hi
