"""Bodies of the four-process pipeline-parallel tests (spawned children import them by path).

One spawn runs every distributed case in a row (a fresh process group each).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from llmfoundry.algorithms import GradientClipping
from llmfoundry.distributed import FSDP, Strategy, unwrap_model
from llmfoundry.trainer import Callback

from .checkpoint_worker import KillAt
from .sharded_worker import STOP_AT, parity_run, resume_run, tiny_llama
from .spawn import join_env
from .tensor_parallel_worker import tp_llama, tp_mpt
from .workers import global_batches, rank_slice, uneven_eval_set

WORLD = 4
# name -> the parallelism (mesh) of the parity runs: two stages, each sharded over two processes.
PARITY = {
    "pp2_fsdp2_1f1b": {"pp": 2, "pp_schedule": "1f1b"},
    "pp2_fsdp2_gpipe": {"pp": 2, "pp_schedule": "gpipe"},
}
# Gradient-norm clipping tight enough to bind at every step: the norm must span both stages.
CLIP = 0.05

# The tp=2 x pp=2 runs: family -> model (as the one-process references of the test).
TP_X_PP = {"llama": tp_llama, "mpt": tp_mpt}

# name -> the checkpoint it resumes (None: uninterrupted), at pp=2 x dp=2 (`resumed_by_pp`).
RESUMED_BY_PP = {
    "pp2_from_pp2": "pp2_fsdp2_saved",
    "pp2_fsdp2_straight": None,
    # The one-process run's whole checkpoint (model.safetensors) after STOP_AT: each stage
    # loads its own modules' weights and optimizer state.
    "pp2_from_single": f"single_straight/ep0-ba{STOP_AT}",
}
# Runs killed (every rank, SIGKILL) at the end of batch KILL_AT, saving every 2 batches (so the
# kill loses batch 3), then resumed from their save folder: name -> their parallelism (mesh).
CRASHED = {"pp2": {"pp": 2}, "tp2_pp2": {"tp": 2, "pp": 2}}
KILL_AT = 3
MICROBATCH = 1  # 1F1B: at least pp microbatches of each rank's 2 (pp2) or 4 (tp2 x pp2) samples
# Copies of rank_main's pp2 save folder ("pp2_fsdp2_saved"), its checkpoint damaged so (the
# test's DAMAGE), each resumed by a pp2 run that must fail on every rank with the same line.
DAMAGED = ("shard_flipped", "rng_flipped", "metadata_truncated", "manifest_deleted")


class StageWeights(Callback):
    """The whole weights of this process's stage as training starts, and its gradient-free
    parameters' names (every process of the stage gathers its shards)."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}

    def fit_start(self, state, logger) -> None:
        for name, tensor in unwrap_model(state.model).state_dict().items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            self.initial[name] = whole.detach().clone()


def eval_sets(strategy: Strategy) -> dict[str, list[dict[str, torch.Tensor]]]:
    """An evaluation at the end, on this data-parallel rank's slice of the training batches
    and of batches whose sizes pp does not divide."""
    return {
        "train": rank_slice(global_batches(), strategy.dp_rank, strategy.dp_size),
        "uneven": uneven_eval_set(strategy.dp_rank, strategy.dp_size),
    }


def rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    ports = iter(ports)
    result: dict[str, dict] = {}
    for name, options in PARITY.items():
        join_env(rank, world, next(ports))
        strategy = FSDP("cpu", timeout_s=60, parallelism=options)
        weights = StageWeights()
        # One sample per microbatch: each data-parallel rank's two samples are two microbatches.
        recorder = parity_run(
            strategy, strategy.dp_rank, strategy.dp_size, device_train_microbatch_size=1,
            callbacks=[weights], eval_dataloaders=eval_sets(strategy),
        )  # fmt: skip
        result[name] = {
            "losses": recorder.losses, "initial": weights.initial, "eval": recorder.eval_metrics
        }  # fmt: skip
    join_env(rank, world, next(ports))
    strategy = FSDP("cpu", timeout_s=60, parallelism={"pp": 2})
    recorder = parity_run(
        strategy, strategy.dp_rank, strategy.dp_size, device_train_microbatch_size=1,
        algorithms=[GradientClipping(threshold=CLIP)],
    )  # fmt: skip
    result["pp2_fsdp2_clipped"] = {"losses": recorder.losses}
    join_env(rank, world, next(ports))  # Llama: an untied head, on the last stage only
    strategy = FSDP("cpu", timeout_s=60, parallelism={"pp": 2})
    recorder = parity_run(
        strategy, strategy.dp_rank, strategy.dp_size, device_train_microbatch_size=1,
        model=tiny_llama(),
    )  # fmt: skip
    result["llama_pp2_fsdp2"] = {"losses": recorder.losses}
    for family, build in TP_X_PP.items():  # two stages, each split over two processes
        join_env(rank, world, next(ports))
        strategy = FSDP("cpu", timeout_s=60, parallelism={"tp": 2, "pp": 2})
        recorder = parity_run(
            strategy, strategy.dp_rank, strategy.dp_size, device_train_microbatch_size=1,
            model=build(), eval_dataloaders=eval_sets(strategy),
        )  # fmt: skip
        result[f"{family}_tp2_pp2"] = {"losses": recorder.losses, "eval": recorder.eval_metrics}
    for name, options, kwargs in (
        ("pp2_fsdp2_saved", {"pp": 2, "pp_schedule": "gpipe"}, {"stop_at": STOP_AT}),
        ("fsdp4_from_pp2", {}, {"load": f"{out}/pp2_fsdp2_saved"}),
    ):
        join_env(rank, world, next(ports))
        recorder = resume_run(
            FSDP("cpu", timeout_s=60, parallelism=options), mds, f"{out}/{name}", **kwargs
        )
        result[name] = {"losses": recorder.losses, "ids": recorder.ids}
    result |= resumed_by_pp(rank, world, ports, out, mds)
    torch.save(result, Path(out) / f"rank{rank}.pt")


def resumed_by_pp(rank: int, world: int, ports: Iterator[int], out: str, mds: str) -> dict:
    """The pp2 run saved after STOP_AT (rank_main's "pp2_fsdp2_saved") resumed by the same
    layout, and that run uninterrupted (`RESUMED_BY_PP`)."""
    result = {}
    for name, load in RESUMED_BY_PP.items():
        join_env(rank, world, next(ports))
        strategy = FSDP("cpu", timeout_s=60, parallelism={"pp": 2, "pp_schedule": "gpipe"})
        recorder = resume_run(strategy, mds, f"{out}/{name}", load=load and f"{out}/{load}")
        result[name] = {"losses": recorder.losses, "ids": recorder.ids}
    return result


def crashed_rank_main(rank: int, world: int, port: int, out: str, mds: str, name: str) -> None:
    """Run `name` of CRASHED, saving every 2 batches, until every rank kills itself (SIGKILL)
    at the end of batch KILL_AT: a crash, its batch 3 lost."""
    join_env(rank, world, port)
    strategy = FSDP("cpu", timeout_s=60, parallelism=CRASHED[name])
    resume_run(
        strategy, mds, f"{out}/{name}_crashed", save_interval="2ba",
        callbacks=(KillAt(KILL_AT),), device_train_microbatch_size=MICROBATCH,
    )  # fmt: skip


def resumed_rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    """Each CRASHED run resumed from its save folder (as autoresume does), and uninterrupted."""
    ports = iter(ports)
    result: dict[str, dict] = {}
    for name, options in CRASHED.items():
        for run, load in ((f"{name}_crashed", f"{out}/{name}_crashed"), (f"{name}_straight", None)):
            join_env(rank, world, next(ports))
            recorder = resume_run(
                FSDP("cpu", timeout_s=60, parallelism=options), mds, f"{out}/{run}", load=load,
                save_interval="2ba", device_train_microbatch_size=MICROBATCH,
            )  # fmt: skip
            result[run] = {"losses": recorder.losses, "ids": recorder.ids}
    torch.save(result, Path(out) / f"resumed_rank{rank}.pt")


def damaged_rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    """A pp2 run resuming from each DAMAGED save folder; the error each rank ended with."""
    result = {}
    for damage, port in zip(DAMAGED, ports, strict=True):
        join_env(rank, world, port)
        folder = f"{out}/damaged_{damage}"
        strategy = FSDP("cpu", timeout_s=60, parallelism={"pp": 2, "pp_schedule": "gpipe"})
        try:
            resume_run(strategy, mds, folder, load=folder)
            result[damage] = ""
        except Exception as err:  # noqa: BLE001 - whatever each rank ended with is the result
            strategy.teardown()  # the group the failed run's strategy created
            result[damage] = f"{type(err).__name__}: {err}"
    torch.save(result, Path(out) / f"damaged_rank{rank}.pt")
