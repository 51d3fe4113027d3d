"""Eval sets split over ranks the way a loader pads them: each rank reads the same number of
batches, the last rank's missing sample repeated with ``sample_mask`` False."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from llmfoundry.distributed import DDP, SingleDevice
from llmfoundry.trainer import Trainer
from tests.distributed.spawn import join_env
from tests.trainer.conftest import tiny_model, token_batches

N_SAMPLES, PER_RANK_BATCH = 5, 2


def eval_samples() -> dict[str, torch.Tensor]:
    batch = token_batches(1, N_SAMPLES, seed=11)[0]
    batch["labels"][1, 4:] = -100  # unequal loss tokens per sample
    return batch


def rank_batches(rank: int, world: int, keep_mask: bool = True) -> list[dict[str, torch.Tensor]]:
    """This rank's share (samples rank, rank + world, ...), padded to the count every rank
    reads by repeating the last sample with its mask False; `keep_mask=False` drops the mask
    (what a trainer ignoring it would compute)."""
    samples = eval_samples()
    per_rank = -(-N_SAMPLES // world)
    rows = list(range(rank, N_SAMPLES, world))
    mask = [True] * len(rows) + [False] * (per_rank - len(rows))
    rows += [N_SAMPLES - 1] * (per_rank - len(rows))
    batches = []
    for start in range(0, per_rank, PER_RANK_BATCH):
        index = torch.tensor(rows[start : start + PER_RANK_BATCH])
        batch = {key: value[index] for key, value in samples.items()}
        if keep_mask:
            batch["sample_mask"] = torch.tensor(mask[start : start + PER_RANK_BATCH])
        batches.append(batch)
    return batches


def evaluate(rank: int, world: int, strategy) -> dict[str, float]:
    trainer = Trainer(
        model=tiny_model(),
        strategy=strategy,
        train_dataloader=token_batches(1, 2),
        max_duration="1ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir="/tmp",
        eval_dataloaders={
            "masked": rank_batches(rank, world),
            "unmasked": rank_batches(rank, world, keep_mask=False),
        },
    )
    try:
        return trainer.evaluate()
    finally:
        trainer.close()


def single_process() -> dict[str, float]:
    return evaluate(0, 1, SingleDevice("cpu"))


def eval_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    join_env(rank, world, port)
    metrics = evaluate(rank, world, DDP(device="cpu", timeout_s=60))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(metrics))
