"""Process bodies for the two-process tests (spawned children import them by module path)."""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from llmfoundry.distributed import DDP, unwrap_model
from llmfoundry.trainer import Algorithm, Callback, Event, Trainer
from tests.distributed.spawn import join_env
from tests.trainer.conftest import tiny_model, token_batches

BATCH = 4  # global batch; each of the two ranks trains on half of it


def global_batches() -> list[dict[str, torch.Tensor]]:
    """Unequal loss tokens per sample (and per rank), so wrong weighting would show."""
    batches = token_batches(3, BATCH, seed=3)
    for batch in batches:
        batch["labels"][0, :12] = -100
        batch["labels"][3, 5:] = -100
    return batches


def rank_slice(batches: list[dict[str, torch.Tensor]], rank: int, world: int) -> list[dict]:
    per_rank = BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return [{key: value[rows] for key, value in batch.items()} for batch in batches]


def uneven_eval_set(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    """An eval set of 5 and then 3 samples, this data-parallel rank's rows of each (rank 0 gets
    the extra one): batch sizes that pp=2 does not divide (5, 3; 3 and 2, 2 and 1 on two
    ranks), as a split's last batch is."""
    return [
        {key: value.tensor_split(world)[rank] for key, value in batch.items()}
        for batch in token_batches(1, 5, seed=4) + token_batches(1, 3, seed=5)
    ]


class OOMOnRank(Algorithm):
    """Injected out-of-memory error on one rank only, after its backward of any microbatch
    larger than `limit`: the other rank has nothing to run out of memory on."""

    def __init__(self, rank: int, limit: int) -> None:
        self.rank, self.limit, self.raised = rank, limit, 0

    def match(self, event, state):
        return event is Event.AFTER_BACKWARD and state.rank == self.rank

    def apply(self, event, state, logger):
        if state.batch["input_ids"].shape[0] > self.limit:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def train_rank(
    rank: int, world: int, port: int, out_dir: str, microbatch: int | str | None
) -> None:
    """One DDP rank: train on its slice, then save its parameters and what it saw."""
    join_env(rank, world, port)
    oom = OOMOnRank(rank=1, limit=1)
    batches = global_batches()
    trainer = Trainer(
        model=tiny_model(),
        strategy=DDP(device="cpu", timeout_s=60),
        train_dataloader=rank_slice(batches, rank, world),
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=out_dir,
        device_train_microbatch_size=microbatch,
        algorithms=[oom] if microbatch == "auto" else [],
    )
    state = trainer.fit()
    result = {
        "params": {n: p.detach().clone() for n, p in unwrap_model(state.model).named_parameters()},
        "microbatch": torch.tensor(state.device_train_microbatch_size or 0),
        "raised": torch.tensor(oom.raised),
        "train_loss": torch.tensor(state.train_loss, dtype=torch.float64),
        "group_destroyed": torch.tensor(not dist.is_initialized()),
    }
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")


class KillAt(Callback):
    """Both ranks SIGKILL themselves at the end of a batch (together, after a barrier)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.batch:
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
