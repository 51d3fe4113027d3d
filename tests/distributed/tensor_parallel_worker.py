"""Bodies of the four-process tensor-parallel tests (spawned children import them by module
path): one spawn runs every case in a row, a fresh process group each."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from llmfoundry.distributed import FSDP, SingleDevice, Strategy
from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Trainer
from llmfoundry.utils.errors import UserError

from .sharded_worker import STOP_AT, Recorder, resume_run
from .spawn import join_env
from .workers import global_batches, rank_slice

WORLD, TP = 4, 2
# The parity runs: name -> (FSDP options, tied head).
PARITY = {
    "tp2_dp2": ({"tp": TP}, False),
    "tp2_dp2_tied_activation_checkpointing": (
        {"tp": TP, "activation_checkpointing": "full"},
        True,
    ),
}


def tp_llama(tied: bool = False) -> LlamaForCausalLM:
    """Tiny, on meta (the Trainer initializes it after seeding); 4 query and 2 key/value heads,
    so tp=2 splits both."""
    config = LlamaConfig(
        d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=64, max_seq_len=16,
        tie_word_embeddings=tied, init_device="meta",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def parity_run(strategy: Strategy, tied: bool, **kwargs: Any) -> tuple[Recorder, dict[str, float]]:
    """Three AdamW steps on the shared global batches (this data-parallel rank's slice), then
    an evaluation on them: the recorded steps and the eval metrics."""
    batches = global_batches()
    recorder = Recorder()
    own = rank_slice(batches, strategy.dp_rank, strategy.dp_size)
    state = Trainer(
        model=tp_llama(tied),
        strategy=strategy,
        train_dataloader=own,
        eval_dataloaders={"train": own},
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2),
        callbacks=[recorder],
        run_dir=os.environ.get("TMPDIR", "/tmp"),
        **kwargs,
    ).fit()
    return recorder, dict(state.eval_metrics)


def single_parity_run(tied: bool) -> tuple[Recorder, dict[str, float]]:
    return parity_run(SingleDevice("cpu"), tied)


def rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    ports = iter(ports)
    result: dict[str, dict] = {}
    for name, (options, tied) in PARITY.items():
        join_env(rank, world, next(ports))
        recorder, metrics = parity_run(FSDP("cpu", timeout_s=60, **options), tied)
        result[name] = {"losses": recorder.losses, "initial": recorder.initial, "eval": metrics}
    for name, options, kwargs in (
        ("tp2_dp2_saved", {"tp": TP}, {"stop_at": STOP_AT}),
        ("dp4_from_tp2_dp2", {}, {"load": f"{out}/tp2_dp2_saved"}),
    ):
        join_env(rank, world, next(ports))
        recorder = resume_run(
            FSDP("cpu", timeout_s=60, **options), mds, f"{out}/{name}", model=tp_llama, **kwargs
        )
        result[name] = {"losses": recorder.losses, "ids": recorder.ids}
    # Auto-microbatching is refused (an OOM inside a block would strand its tp peers).
    join_env(rank, world, next(ports))
    strategy = FSDP("cpu", timeout_s=60, tp=TP)
    try:
        parity_run(strategy, False, device_train_microbatch_size="auto")
        result["auto_microbatching"] = {"error": ""}
    except UserError as err:
        result["auto_microbatching"] = {"error": str(err)}
    finally:
        strategy.teardown()
    torch.save(result, Path(out) / f"rank{rank}.pt")
