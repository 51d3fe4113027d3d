"""Bodies of the two-process FSDP checkpoint tests (test_fsdp_checkpoints.py): a run whose
sharded checkpoint the HF export reads; EMA saved and resumed across world sizes; background
(async) saves, and a kill during one; diverged (NaN) FSDP and DDP runs whose saves are refused.

One spawn runs every training in a row (a fresh process group each), since starting two
processes costs more than training the tiny model.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import safetensors.torch
import torch
from torch.distributed.tensor import DTensor

from llmfoundry.algorithms import EMA
from llmfoundry.callbacks import CheckpointSaver, HFCheckpointer
from llmfoundry.checkpoint import sharded
from llmfoundry.checkpoint.state import model_state_dict
from llmfoundry.distributed import DDP, FSDP, Strategy
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Callback, Trainer
from tests.trainer.conftest import tiny_model

from .sharded_worker import STOP_AT, Recorder, diverged_run, resume_run
from .spawn import join_env
from .workers import KillAt, global_batches, rank_slice

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
HF_RUN = "fsdp_hf"  # that run's hf_checkpointer folder (huggingface/ba3 at the end)


class GatherAtEnd(Callback):
    """At FIT_END, the whole weights of the live sharded model (a collective), written by rank 0:
    what the sharded checkpoint holds, obtained without reading it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fit_end(self, state, logger) -> None:
        weights = model_state_dict(state.model)
        if state.rank == 0:
            safetensors.torch.save_file({k: v.contiguous() for k, v in weights.items()}, self.path)


def export_run(rank: int, world: int, out: str) -> None:
    """Three AdamW steps under FSDP, saved at the end as a sharded checkpoint whose run
    config names its model and tokenizer, and exported at the end by hf_checkpointer."""
    Trainer(
        model=tiny_model(),
        strategy=FSDP("cpu", timeout_s=60),
        train_dataloader=rank_slice(global_batches(), rank, world),
        max_duration="3ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2),
        callbacks=[
            CheckpointSaver(f"{out}/{EXPORT_RUN}"),
            GatherAtEnd(Path(out) / GATHERED),
            HFCheckpointer(f"{out}/{HF_RUN}"),
        ],
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
    ports = iter(ports)
    result: dict[str, dict] = {}
    join_env(rank, world, next(ports))
    export_run(rank, world, out)
    for name, kwargs in (
        ("ema_saved", {"stop_at": STOP_AT}),
        ("ema_from_single", {"load": f"{out}/ema_single_saved"}),
    ):
        join_env(rank, world, next(ports))
        recorder, ema = ema_run(FSDP("cpu", timeout_s=60), mds, f"{out}/{name}", **kwargs)
        result[name] = {"losses": recorder.losses, "loaded": ema.loaded, "ema": ema.after_batch}
    for name, options, kwargs in (
        ("sync_every_batch", {}, {"save_interval": "1ba"}),
        ("async_every_batch", {"async_save": True}, {"save_interval": "1ba"}),
        ("sync_from_async", {}, {"load": f"{out}/async_every_batch/ep0-ba{STOP_AT}"}),
    ):
        join_env(rank, world, next(ports))
        strategy = FSDP("cpu", timeout_s=60, **options)
        recorder, ema = ema_run(strategy, mds, f"{out}/{name}", **kwargs)
        result[name] = {"losses": recorder.losses, "ema": ema.after_batch}
    for name, make, poisoned in (("fsdp_diverged", FSDP, 1), ("ddp_diverged", DDP, None)):
        join_env(rank, world, next(ports))
        error = diverged_run(make("cpu", timeout_s=60), mds, f"{out}/{name}", poisoned)
        result[name] = {"error": error}
    torch.save(result, Path(out) / f"rank{rank}.pt")


def slow_background_saves() -> None:
    """Async saves whose background write, after the first, takes a minute longer (a slow
    store), so the run is killed while one is in flight (this process's `save_shards`)."""
    save_shards = sharded.save_shards
    saves = 0

    def slow_save_shards(strategy, path, model, optimizer, objects=None):
        nonlocal saves
        future = save_shards(strategy, path, model, optimizer, objects)
        if not isinstance(future, Future):  # the rank exits 1, not killed: the test fails
            raise TypeError(f"save_shards with FSDP(async_save=True) returned {future!r}")
        saves += 1
        if saves == 1:
            return future
        slow: Future = Future()

        def finish_later() -> None:
            future.result()
            time.sleep(60)
            slow.set_result(None)

        threading.Thread(target=finish_later, daemon=True).start()
        return slow

    sharded.save_shards = slow_save_shards


def killed_rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    """Saves after every batch in the background; killed at the end of batch 3, while the
    save of batch 2 is still being written."""
    join_env(rank, world, ports[0])
    slow_background_saves()
    strategy = FSDP("cpu", timeout_s=60, async_save=True)
    resume_run(strategy, mds, f"{out}/async_killed", save_interval="1ba", callbacks=(KillAt(3),))
