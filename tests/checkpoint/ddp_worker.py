"""Body of each rank of the four-process checkpoint test (spawned children import it)."""

from __future__ import annotations

import functools
import os

import torch

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.distributed import DDP, unwrap_model
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Callback, Trainer
from tests.trainer.conftest import token_batches

from .helpers import Batches, StepRecorder, model

BATCHES, GLOBAL_BATCH = 5, 4


class StopAt(Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_end(self, state, logger) -> None:
        state.stop_training = state.stop_training or state.timestamp.batch == self.batch


def run(
    rank: int, world: int, port: int, folder: str, **kwargs
) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train this rank's share of each global batch; returns its recorded steps and the final
    weights."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    batches = [{k: v[rows] for k, v in b.items()} for b in token_batches(BATCHES, GLOBAL_BATCH)]
    recorder = StepRecorder()
    state = Trainer(
        model=model(dropout=0.1),  # dropout draws from each rank's own (differently seeded) RNG
        strategy=DDP(device="cpu", timeout_s=60),
        train_dataloader=Batches(batches, world),
        max_duration=f"{BATCHES}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2),
        callbacks=[recorder, *kwargs.pop("callbacks", []), CheckpointSaver(folder)],
        run_dir=folder,
        **kwargs,
    ).fit()
    weights = {k: v.detach().clone() for k, v in unwrap_model(state.model).state_dict().items()}
    return recorder.steps, weights


def rank_main(rank: int, world: int, ports: list[int], out: str) -> None:
    """A straight run; then one stopped at batch 3 and resumed from its checkpoint."""
    torch.set_num_threads(1)
    straight, straight_weights = run(rank, world, ports[0], f"{out}/straight")
    first, _ = run(rank, world, ports[1], f"{out}/resumed", callbacks=[StopAt(3)])
    second, weights = run(rank, world, ports[2], f"{out}/resumed", load_path=f"{out}/resumed")
    torch.save(
        {
            "straight": repr(straight), "resumed": repr(first + second),
            "straight_weights": straight_weights, "weights": weights,
        },
        f"{out}/rank{rank}.pt",
    )  # fmt: skip
