"""What every trainer dataset shares: epochs, exact resumption, the rank partition, repeat masks.

A dataset numbers the samples of an epoch by *position* ``0 .. epoch_size - 1`` (its global
order, the same on every world size) and maps positions to sample ids with :meth:`order`;
sampling.py's :class:`RankPlan` hands each data-parallel rank its positions, padding the epoch
to a multiple of the world size with repeats. The trainer's contract
(``set_epoch``, ``state_dict(num_samples)``, ``load_state_dict``, ``len``) is implemented here
once, so an MDS dataset and a plain token file resume the same way.

Canonical nodes (``canonical_nodes``, sampling.py): a dataset whose order is cut into ``C``
spans, one per canonical node, is read by physical nodes that each take ``C / N`` of them, so
it runs on ``N`` nodes only where ``N`` divides ``C`` (``C = 1``: one sequence, which any node
count reads). ``C`` defaults to the node count the dataset is first built on; the data state
records it (and the global batch the spans were laid out with), and a resumption adopts it.

Evaluation datasets (``evaluation=True``) mark the repeated positions: their batches carry
``"sample_mask"`` (bool [B]), False for a sample that repeats one read earlier in the epoch, so
metrics can count every sample exactly once on any number of ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from llmfoundry.core.metrics import SAMPLE_MASK  # the key the eval metrics read
from llmfoundry.data.streaming.checks import check_int
from llmfoundry.data.streaming.sampling import RankPlan
from llmfoundry.data.streaming.world import World
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.logs import SAME_ON_EVERY_RANK

__all__ = ["EpochDataset"]

log = logging.getLogger(__name__)


class EpochDataset(IterableDataset):
    """Base of the trainer's datasets: subclasses set ``epoch_size`` and define ``order`` and
    ``get_batch``; ``state_checked`` names the attributes the order depends on, which a
    resumption must find unchanged.

    Args:
        batch_size: samples per rank per step; None hands out single samples.
        data_parallel: (rank, size) of this process among the data-parallel readers; default
            torchrun's RANK and WORLD_SIZE (world.py).
        evaluation: batches carry ``sample_mask`` (module docstring).
        canonical_nodes: spans of the order, one per canonical node (module docstring); None:
            the node count of this launch. Evaluation always reads one sequence (1).
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
        canonical_nodes: int | None = None,
    ) -> None:
        super().__init__()
        check_int("batch_size", batch_size, minimum=1, optional=True)
        check_int("canonical_nodes", canonical_nodes, minimum=1, optional=True)
        if not isinstance(evaluation, bool):
            raise TypeError(f"evaluation must be true or false, got {evaluation!r}")
        world = World.detect(data_parallel)  # a bad (rank, size) fails here, not at a batch
        self.batch_size = batch_size
        self.data_parallel = data_parallel
        self.evaluation = evaluation
        # Set by the user: a resumption must find it unchanged; defaulted: it adopts the state's.
        self._canonical_given = canonical_nodes is not None and not evaluation
        self.canonical_nodes = 1 if evaluation else canonical_nodes or world.num_nodes
        self._check_nodes(world)
        self._epoch = 0
        # (epoch, samples consumed, global batch of that epoch's spans or None)
        self._resume: tuple[int, int, int | None] | None = None

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
        state = {
            "epoch": self._epoch,
            "sample_in_epoch": consumed,
            "canonical_nodes": self.canonical_nodes,
            "global_batch": self.layout_batch(),
        }
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
            raise UserError(
                f"cannot resume: the data order changed since the checkpoint ({detail}); "
                "resume with the same data and shuffle settings, or start a fresh run"
            )
        check_int("epoch", state["epoch"], minimum=0)
        check_int("sample_in_epoch", state["sample_in_epoch"], minimum=0)
        # A state from before canonical nodes existed was read as one sequence.
        canonical = state.get("canonical_nodes", 1)
        check_int("canonical_nodes", canonical, minimum=1)
        layout = state.get("global_batch")
        check_int("global_batch", layout, minimum=1, optional=True)
        if self._canonical_given and canonical != self.canonical_nodes:
            raise UserError(
                f"cannot resume: the checkpoint's data order has canonical_nodes={canonical}, "
                f"the config sets {self.canonical_nodes}; set data.canonical_nodes={canonical} "
                "(or null), or start a fresh run"
            )
        if not self.evaluation:
            world = World.detect(self.data_parallel)
            self.canonical_nodes = int(canonical)
            self._check_nodes(world)
            if canonical == 1 and world.num_nodes > 1 and not self._canonical_given:
                log.warning(
                    "the checkpoint's data order has canonical_nodes=1 (a one-node run): each "
                    "of the %d nodes reads every shard until a fresh run",
                    world.num_nodes,
                    extra=SAME_ON_EVERY_RANK,
                )
        self._epoch = int(state["epoch"])
        self._resume = (self._epoch, int(state["sample_in_epoch"]), layout)

    # -- the partition --------------------------------------------------------------------

    def _check_nodes(self, world: World) -> None:
        """Refuse a node count that cannot read this order's spans node by node."""
        spans, nodes = self.canonical_nodes, world.num_nodes
        if spans > 1 and spans % nodes:
            fits = [n for n in range(1, spans + 1) if spans % n == 0]
            raise UserError(
                f"the data order has canonical_nodes={spans} but this run has {nodes} nodes; "
                f"run on {', '.join(map(str, fits))} nodes (the divisors of {spans}), or start "
                "a fresh run with data.canonical_nodes set to a multiple of every node count "
                "it should resume on"
            )

    def layout_batch(self) -> int:
        """The global batch this epoch's spans take turns in: the one the state of a resumed
        epoch recorded, else this run's (samples per rank times ranks)."""
        if self._resume is not None and self._resume[0] == self._epoch and self._resume[2]:
            return self._resume[2]
        return (self.batch_size or 1) * World.detect(self.data_parallel).world_size

    def _plan(self, world: World, start: int | None = None, batch_size: int | None = None):
        self._check_nodes(world)
        return RankPlan(
            self.epoch_size,
            self._start() if start is None else start,
            world.world_size,
            world.rank,
            batch_size or self.batch_size or 1,
            nodes=world.num_nodes if self.canonical_nodes > 1 else 1,
            layout_batch=self.layout_batch(),
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
    # On several nodes the last batch is not one run of positions (RankPlan.positions).
    last = (
        plan.num_batches - 1 if plan.nodes > 1 and ks and ks[-1] == plan.num_batches - 1 else None
    )
    runs = ks[:-1] if last is not None else ks
    per_chunk = max(1, 4096 // plan.batch_size)  # amortise the lookup over many small batches
    for first in range(0, len(runs), per_chunk):
        starts, lengths = np.array([plan.span(k) for k in runs[first : first + per_chunk]]).T
        ends = np.cumsum(lengths)
        # Each batch's positions are consecutive: start, start + 1, ..., start + length - 1.
        positions = np.arange(ends[-1]) + np.repeat(starts - (ends - lengths), lengths)
        ids = order(positions)
        lo = 0
        for hi in ends.tolist():
            yield ids[lo:hi], positions[lo:hi]
            lo = hi
    if last is not None:
        positions = plan.positions(last)
        yield order(positions), positions
