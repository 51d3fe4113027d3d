"""What every multi-process strategy shares: joining torchrun's process group and leaving it.

torchrun (one node or many, through its c10d rendezvous) sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT in each process; the backend follows the device (nccl on CUDA,
gloo on CPU) unless the config names one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmfoundry.distributed.base import Strategy, resolve_device
from llmfoundry.distributed.mesh import Mesh, ParallelDims, build_mesh, parallel_dims
from llmfoundry.distributed.torch_compat import forget_meshes
from llmfoundry.utils.errors import UserError

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Seconds given to gloo's worker threads around destroying the process group (see teardown).
_GLOO_DRAIN_S = 0.1


class ProcessGroupStrategy(Strategy):
    """A strategy over the processes `torchrun` started (subclasses say how the model is
    wrapped). `parallelism` lays them out on the mesh (`dims`): the config's `parallelism:`
    block, or a ParallelDims, refused in one line where this strategy cannot take an axis
    (mesh.py `parallel_dims`); None: every process a data-parallel rank. `timeout_s` bounds how
    long a collective waits for a missing rank before failing, instead of hanging a crashed job
    forever."""

    name = "ddp"  # as in `strategy=<name>`, for messages

    def __init__(
        self,
        device: str = "auto",
        backend: str | None = None,
        timeout_s: float = 1800.0,
        parallelism: Mapping[str, Any] | ParallelDims | None = None,
    ):
        missing = [key for key in _ENV if key not in os.environ]
        if missing:
            raise UserError(
                f"strategy={self.name} needs the torchrun environment, but {', '.join(missing)} "
                "is not set: launch with `torchrun --nproc_per_node=N scripts/train.py "
                f"strategy={self.name} ...`, or use strategy=single for one process"
            )
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ["LOCAL_RANK"])
        if not 0 <= self.rank < self.world_size:
            raise UserError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        resolved = resolve_device(device)
        if resolved.type == "cuda" and resolved.index is None:
            resolved = torch.device("cuda", self.local_rank)
        self.device = resolved
        self.backend = backend or ("nccl" if resolved.type == "cuda" else "gloo")
        if timeout_s <= 0:
            raise UserError(f"strategy.timeout_s must be positive, got {timeout_s}")
        self.timeout = timedelta(seconds=timeout_s)
        self._owns_group = False
        self.dims = parallel_dims(parallelism, self.world_size, self.name)
        self.mesh: Mesh | None = None  # built by `setup`, once the process group exists

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.dp_group

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.loss_group

    @property
    def loss_size(self) -> int:
        return self.dims.loss_size

    def setup(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise RuntimeError(
                    f"a process group (rank {dist.get_rank()} of {dist.get_world_size()}) is "
                    f"already initialized, but the environment says rank {self.rank} of "
                    f"{self.world_size}"
                )
        else:
            dist.init_process_group(
                backend=self.backend,
                init_method="env://",
                rank=self.rank,
                world_size=self.world_size,
                timeout=self.timeout,
            )
            self._owns_group = True
        self.mesh = build_mesh(self.dims, self.device.type)

    @contextmanager
    def rank0_generator(self) -> Iterator[None]:
        """Run with rank 0's random generator state on every rank (rank 0 advances its own,
        as one process would; the others use a copy and keep theirs): initializing a model
        inside gives every rank the weights one process would have drawn."""
        cuda = self.device.type == "cuda"
        states = [torch.get_rng_state(), *([torch.cuda.get_rng_state()] if cuda else [])]
        for state in states:
            on_device = state.to(self.device)
            dist.broadcast(on_device, src=0)
            state.copy_(on_device.cpu())
        if self.rank == 0:
            yield
            return
        with torch.random.fork_rng(devices=[self.device] if cuda else []):
            torch.set_rng_state(states[0])
            if cuda:
                torch.cuda.set_rng_state(states[1])
            yield

    def all_reduce_sum(
        self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor

    def barrier(self) -> None:
        dist.barrier()

    def teardown(self) -> None:
        """Destroy the process group this strategy created (gloo can abort at exit otherwise).

        Gloo's worker threads release a finished collective's tensors only after the caller has
        been woken, and that release needs the GIL; a process group destroyed in that window
        (its destructor holds the GIL and joins those threads) deadlocks (pytorch/pytorch#56297).
        Sleeping first hands them the GIL. What DTensor cached about this group's meshes goes
        first (`forget_meshes`): a later group's mesh of the same layout would find it.
        """
        if self._owns_group and dist.is_initialized():
            forget_meshes()
            time.sleep(_GLOO_DRAIN_S)
            dist.destroy_process_group()
            time.sleep(_GLOO_DRAIN_S)
        self._owns_group = False
