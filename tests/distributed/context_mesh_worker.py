"""Bodies of the four-process tests of context parallelism composed with the other axes
(test_context_mesh.py): cp2 x tp2 with activation checkpointing (selective; full with
microbatches of 2 rows) and cp2 x pp2, for MPT (ALiBi, grouped-query heads) and Llama (RoPE),
on batches of packed documents; cp2 x dp2 with automatic microbatching through out-of-memory
errors inside attention; an evaluation after each; a DCP checkpoint saved at cp2 x dp2 on the
real data pipeline, resumed at tp2 x dp2. One spawn runs every case in a row, a fresh process
group each.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from llmfoundry.algorithms import GradientClipping
from llmfoundry.core.engine import LoggerDestination
from llmfoundry.distributed import FSDP, SingleDevice, Strategy
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Algorithm, Event, Trainer
from tests.trainer.conftest import token_batches

from .sharded_worker import STOP_AT, Recorder, resume_run
from .spawn import join_env
from .tensor_parallel_worker import tp_llama, tp_mpt
from .workers import global_batches, uneven_eval_set

WORLD, CP = 4, 2
MODELS = {"mpt": tp_mpt, "llama": tp_llama}
# Document boundaries of each row of a batch (16 positions; cp2 cuts them into 4 chunks of 4):
# none falls on a chunk's edge, so each rank's queries see keys of documents that began on the
# other rank's chunks.
CUTS = ((5, 11), (3, 9), (7, 13), (2, 14))
# Rows per microbatch the automatic search starts at (each rank's 4 rows) and where the
# injected out-of-memory errors stop: in attention's forward above 2 rows (before the K/V
# all-gather), in its backward above 1 row (before the dK/dV reduce-scatter).
AUTO_ROWS, FORWARD_FITS, BACKWARD_FITS = 8, 2, 1

# name -> (FSDP options, model, Trainer options, batches): the parity runs.
PARITY: dict[str, tuple[dict[str, Any], str, dict[str, Any], str]] = {
    "mpt_cp2_tp2_selective_checkpointing": (
        {"cp": CP, "tp": 2, "activation_checkpointing": "selective"},
        "mpt",
        {},
        "documents",
    ),
    "llama_cp2_tp2_full_checkpointing_microbatch2": (
        {"cp": CP, "tp": 2, "activation_checkpointing": "full"},
        "llama",
        {"device_train_microbatch_size": 2},
        "documents",
    ),
    # One sample per microbatch: 1F1B needs at least pp of them (each rank's 4 rows).
    "mpt_cp2_pp2": ({"cp": CP, "pp": 2}, "mpt", {"device_train_microbatch_size": 1}, "documents"),
    "llama_cp2_pp2": (
        {"cp": CP, "pp": 2},
        "llama",
        {"device_train_microbatch_size": 1},
        "documents",
    ),
    "mpt_cp2_dp2_auto_microbatching": (
        {"cp": CP},
        "mpt",
        {"device_train_microbatch_size": "auto"},
        "auto",
    ),
}


def with_documents(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """`batches` with `sequence_id`: each row's documents cut at `CUTS` (rows cycle through
    them)."""
    for batch in batches:
        rows, length = batch["input_ids"].shape
        cuts = torch.tensor([CUTS[row % len(CUTS)] for row in range(rows)])
        batch["sequence_id"] = (torch.arange(length)[None, None] >= cuts[:, :, None]).sum(1)
    return batches


BATCHES = {
    "documents": lambda: with_documents(global_batches()),
    "auto": lambda: with_documents(token_batches(3, AUTO_ROWS, seed=6)),
}


class Norms(LoggerDestination):
    """Each step's gradient norm (`GradientClipping` logs it)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def log_metrics(self, metrics, step) -> None:
        if "grad/norm" in metrics:
            self.norms.append(float(metrics["grad/norm"]))


class OutOfMemoryInAttention(Algorithm):
    """On rank 1, attention runs out of memory inside a block, where only the context-parallel
    guard stands between it and a collective its peers enter: in the second block's attention
    forward (before its K/V all-gather) for microbatches above `FORWARD_FITS` rows, and in the
    first block's attention backward (before its dK/dV reduce-scatter) above `BACKWARD_FITS`."""

    def __init__(self) -> None:
        self.raised: list[str] = []
        self._rows = 0

    def match(self, event, state):
        return event in (Event.FIT_START, Event.BEFORE_FORWARD) and state.rank == 1

    def apply(self, event, state, logger):
        if event is Event.BEFORE_FORWARD:
            self._rows = state.batch["input_ids"].shape[0]
            return
        blocks = state.model.transformer.blocks
        blocks[1].attn.register_forward_pre_hook(functools.partial(self._raise, "forward"))
        blocks[0].attn.out_proj.register_full_backward_pre_hook(
            functools.partial(self._raise, "backward")
        )

    def _raise(self, where: str, *_: Any) -> None:
        fits = FORWARD_FITS if where == "forward" else BACKWARD_FITS
        if self._rows > fits:
            self.raised.append(f"{where}@{self._rows}")
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")


def parity_run(
    strategy: Strategy, model: str, batches: str, **kwargs: Any
) -> tuple[Recorder, Norms, dict[str, float]]:
    """Three AdamW steps on the shared global batches (this data-parallel rank's slice), the
    gradient norm logged (clipping far above it), then an evaluation on them and on batches of
    5 and 3 rows: the recorded steps, the norms and the eval metrics."""
    every = BATCHES[batches]()
    recorder, norms = Recorder(), Norms()
    rows = every[0]["input_ids"].shape[0]
    own = [
        {key: value.tensor_split(strategy.dp_size)[strategy.dp_rank] for key, value in b.items()}
        for b in every
    ]
    assert own[0]["input_ids"].shape[0] == rows // strategy.dp_size
    state = Trainer(
        model=MODELS[model](),
        strategy=strategy,
        train_dataloader=own,
        eval_dataloaders={
            "train": own,
            "uneven": uneven_eval_set(strategy.dp_rank, strategy.dp_size),
        },
        max_duration=f"{len(every)}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2),
        callbacks=[recorder],
        loggers=[norms],
        algorithms=[GradientClipping(threshold=1e6), *kwargs.pop("algorithms", ())],
        run_dir=os.environ.get("TMPDIR", "/tmp"),
        **kwargs,
    ).fit()
    return recorder, norms, dict(state.eval_metrics)


def fsdp(options: dict[str, Any]) -> FSDP:
    """FSDP with `options`, its mesh axes (cp, tp, pp) given as the parallelism block."""
    axes = {k: v for k, v in options.items() if k in ("cp", "tp", "pp")}
    rest = {k: v for k, v in options.items() if k not in axes}
    return FSDP("cpu", timeout_s=60, parallelism=axes, **rest)


def single_parity_run(model: str, batches: str) -> dict[str, Any]:
    recorder, norms, metrics = parity_run(SingleDevice("cpu"), model, batches)
    return {"losses": recorder.losses, "norms": norms.norms, "eval": metrics}


def rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    ports = iter(ports)
    result: dict[str, dict] = {}
    for name, (options, model, kwargs, batches) in PARITY.items():
        join_env(rank, world, next(ports))
        oom = OutOfMemoryInAttention()
        if kwargs.get("device_train_microbatch_size") == "auto":
            kwargs = {**kwargs, "algorithms": [oom]}
        strategy = fsdp(options)
        recorder, norms, metrics = parity_run(strategy, model, batches, **kwargs)
        result[name] = {
            "losses": recorder.losses, "norms": norms.norms, "eval": metrics, "raised": oom.raised
        }  # fmt: skip
    # A DCP checkpoint saved at cp2 x dp2 on the real data pipeline, resumed at tp2 x dp2 (and
    # in one process by the test); the sample ids show what each rank read.
    for name, options, kwargs in (
        ("cp2_dp2_saved", {"cp": CP}, {"stop_at": STOP_AT}),
        ("tp2_dp2_from_cp2_dp2", {"tp": 2}, {"load": f"{out}/cp2_dp2_saved"}),
    ):
        join_env(rank, world, next(ports))
        strategy = fsdp(options)
        recorder = resume_run(strategy, mds, f"{out}/{name}", model=tp_mpt, **kwargs)
        result[name] = {"losses": recorder.losses, "ids": recorder.ids}
    torch.save(result, Path(out) / f"rank{rank}.pt")
