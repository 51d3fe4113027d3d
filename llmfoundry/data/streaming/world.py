"""Where this process sits: rank among data-parallel ranks, node among the machines, and worker
among DataLoader workers.

The trainer passes the data-parallel rank and size its strategy computed (its device mesh), so
processes that share a batch (a tensor- or pipeline-parallel group) read the same partition;
without them, torchrun's RANK and WORLD_SIZE are used. Nodes come from torchrun's
LOCAL_WORLD_SIZE: its ranks are numbered node by node, so node ``n`` holds the consecutive
ranks ``n * per_node ... (n + 1) * per_node - 1``, and the data-parallel ranks are split over the
same nodes. Without LOCAL_WORLD_SIZE every rank is on one node.

Read at iteration time, never at construction, because a DataLoader builds the dataset once in
the main process and iterates copies of it in worker processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch.utils.data import get_worker_info

from llmfoundry.utils.errors import UserError

__all__ = ["World"]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} must be an integer") from None


@dataclass(frozen=True)
class World:
    """Rank, node and DataLoader worker of the current process.

    ``local_world_size`` ranks share a node: the partition (sampling.py) hands each node its own
    spans of the epoch, so a node downloads about its share of the shards.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise UserError(f"RANK={self.rank} must be in [0, WORLD_SIZE={self.world_size})")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise UserError(
                f"LOCAL_RANK={self.local_rank} must be in [0, "
                f"LOCAL_WORLD_SIZE={self.local_world_size})"
            )
        if self.world_size % self.local_world_size:
            raise UserError(
                f"WORLD_SIZE={self.world_size} is not a multiple of "
                f"LOCAL_WORLD_SIZE={self.local_world_size}"
            )
        if not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker {self.worker} is outside {self.num_workers} workers")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @classmethod
    def detect(cls, data_parallel: tuple[int, int] | None = None) -> World:
        """From `data_parallel` (rank, size), else torchrun's RANK, WORLD_SIZE, LOCAL_RANK and
        LOCAL_WORLD_SIZE, and the DataLoader worker info."""
        info = get_worker_info()
        workers = {
            "worker": info.id if info is not None else 0,
            "num_workers": info.num_workers if info is not None else 1,
        }
        world_size = _env_int("WORLD_SIZE", 1)
        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
        if data_parallel is not None:
            rank, size = data_parallel
            nodes = world_size // local_world_size if local_world_size > 0 else 1
            per_node = size // nodes if nodes > 0 and size % nodes == 0 else size
            return cls(
                rank=rank,
                world_size=size,
                local_rank=rank % per_node if per_node > 0 else 0,
                local_world_size=max(per_node, 1),
                **workers,
            )
        return cls(
            rank=_env_int("RANK", 0),
            world_size=world_size,
            local_rank=_env_int("LOCAL_RANK", 0),
            local_world_size=local_world_size,
            **workers,
        )
