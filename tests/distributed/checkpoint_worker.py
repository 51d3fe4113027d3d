"""Bodies of the two-process FSDP checkpoint tests (test_fsdp_checkpoints.py): a run whose
sharded checkpoint the HF export reads; EMA saved and resumed across world sizes.

One spawn runs every training in a row (a fresh process group each), since starting two
processes costs more than training the tiny model.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor

from llmfoundry.algorithms import EMA
from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.distributed import FSDP, Strategy
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Callback, Trainer
from tests.trainer.conftest import tiny_model

from .sharded_worker import STOP_AT, Recorder, join, resume_run
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


class EMARecorder(Callback):
    """The whole EMA averages after loading and after each batch (gathering shards is a
    collective: every rank asks)."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.after_batch: dict[int, dict[str, torch.Tensor]] = {}

    def after_load(self, state, logger) -> None:
        self.loaded = whole_averages(state)

    def batch_end(self, state, logger) -> None:  # after EMA's update (algorithms run first)
        self.after_batch[int(state.timestamp.batch)] = whole_averages(state)


def whole_averages(state) -> dict[str, torch.Tensor]:
    (ema,) = (a for a in state.algorithms if isinstance(a, EMA))
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in ema.averages.items()
    }


def ema_run(strategy: Strategy, mds: str, folder: str, **kwargs) -> tuple[Recorder, EMARecorder]:
    """`resume_run` with EMA (its averages well apart from the weights) recorded."""
    ema = EMARecorder()
    recorder = resume_run(
        strategy, mds, folder, algorithms=(EMA(half_life=None, smoothing=0.5),), callbacks=(ema,),
        **kwargs,
    )  # fmt: skip
    return recorder, ema


def rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    torch.set_num_threads(1)
    ports = iter(ports)
    result: dict[str, dict] = {}
    join(rank, world, next(ports))
    export_run(rank, world, out)
    for name, kwargs in (
        ("ema_saved", {"stop_at": STOP_AT}),
        ("ema_from_single", {"load": f"{out}/ema_single_saved"}),
    ):
        join(rank, world, next(ports))
        recorder, ema = ema_run(FSDP("cpu", timeout_s=60), mds, f"{out}/{name}", **kwargs)
        result[name] = {"losses": recorder.losses, "loaded": ema.loaded, "ema": ema.after_batch}
    torch.save(result, Path(out) / f"rank{rank}.pt")
