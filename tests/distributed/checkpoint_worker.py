"""Bodies of the two-process FSDP checkpoint tests (test_fsdp_checkpoints.py): a run whose
sharded checkpoint the HF export reads.

One spawn runs every training in a row (a fresh process group each), since starting two
processes costs more than training the tiny model.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import safetensors.torch
import torch

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.distributed import FSDP
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Callback, Trainer
from tests.trainer.conftest import tiny_model

from .sharded_worker import join
from .workers import global_batches, rank_slice

# tiny_model()'s config as a training config records it (what load_pretrained rebuilds).
MODEL = {
    "_target_": "llmfoundry.models.mpt.MPTConfig",
    "d_model": 32,
    "n_heads": 2,
    "n_layers": 2,
    "max_seq_len": 16,
    "vocab_size": 64,
}
TOKENIZER = "tokenizer.json"  # written into the output folder by the test before the spawn
EXPORT_RUN = "fsdp_export"  # save folder of the run the export tests read
GATHERED = "gathered.safetensors"  # that run's final weights, gathered from the live model


class GatherAtEnd(Callback):
    """At FIT_END, the whole weights of the live sharded model (a collective), written by rank 0:
    what the sharded checkpoint holds, obtained without reading it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fit_end(self, state, logger) -> None:
        weights = state.strategy.model_state_dict(state.model)
        if state.rank == 0:
            safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, self.path)


def export_run(rank: int, world: int, out: str) -> None:
    """Three AdamW steps under FSDP, saved at the end as a sharded checkpoint whose run
    config names its model and tokenizer."""
    Trainer(
        model=tiny_model(),
        strategy=FSDP("cpu", timeout_s=60),
        train_dataloader=rank_slice(global_batches(), rank, world),
        max_duration="3ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2),
        callbacks=[CheckpointSaver(f"{out}/{EXPORT_RUN}"), GatherAtEnd(Path(out) / GATHERED)],
        run_dir=os.environ.get("TMPDIR", "/tmp"),
        config={"model": MODEL, "tokenizer": f"{out}/{TOKENIZER}"},
    ).fit()


def rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    del mds
    torch.set_num_threads(1)
    ports = iter(ports)
    result: dict[str, dict] = {}
    join(rank, world, next(ports))
    export_run(rank, world, out)
    torch.save(result, Path(out) / f"rank{rank}.pt")
