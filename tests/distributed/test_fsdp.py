"""FSDP2 with two processes (gloo, CPU, fp32): the same global batch gives the same losses as one
process, for every sharding option; sharded checkpoints resume at another world size and
strategy (and full ones into FSDP), continuing the same sample order.

Tolerance: relative 1e-5 on losses. Every strategy computes the same math in fp32, but sums
in a different order: two ranks' half-batch gradients are added by a reduce-scatter or an
all-reduce instead of inside one matmul, so results differ in the last bits (fp32 epsilon is
1.2e-7), and three AdamW steps (whose update divides by sqrt of the second moment) carry
such differences into the next losses at around 1e-7 relative; 1e-5 leaves room without
hiding a real error (a wrong gradient scale, a missing shard or a skipped sample moves the
loss by 1e-3 or more).
"""

import functools
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
import safetensors.torch
import torch

from llmfoundry.checkpoint.catalogue import MODEL_FILE
from llmfoundry.distributed import SingleDevice
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Trainer
from tests.checkpoint.helpers import write_mds
from tests.trainer.conftest import tiny_model

from .sharded_worker import (
    PARITY,
    RESUME_BATCHES,
    STOP_AT,
    Recorder,
    rank_main,
    real_oom_rank,
    resume_run,
)
from .spawn import free_port, run_ranks
from .workers import global_batches

WORLD, LIMIT_S, RTOL = 2, 180, 1e-5


def spawn(main, out, mds: str, n_ports: int) -> list[dict]:
    """Run `main` on two spawned ranks; a hang (ranks waiting on each other) fails the test."""
    ports = [free_port() for _ in range(n_ports)]
    run_ranks(main, WORLD, ports, str(out), mds, limit_s=LIMIT_S)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def single_reference(tmp_path) -> Recorder:
    batches = global_batches()
    recorder = Recorder()
    Trainer(
        model=tiny_model(),
        strategy=SingleDevice("cpu"),
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2),
        callbacks=[recorder],
        run_dir=tmp_path,
    ).fit()
    return recorder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single-process references, then one spawn of two ranks running every distributed case."""
    out = tmp_path_factory.mktemp("fsdp")
    mds = str(write_mds(out / "mds", {"train": 32}))
    single = {
        "parity": single_reference(out),
        "straight": resume_run(SingleDevice("cpu"), mds, str(out / "single_straight")),
        "saved": resume_run(SingleDevice("cpu"), mds, str(out / "single_saved"), stop_at=STOP_AT),
    }
    ranks = spawn(rank_main, out, mds, n_ports=len(PARITY) + 14)
    single["from_fsdp"] = resume_run(
        SingleDevice("cpu"), mds, str(out / "single_from_fsdp"), load=str(out / "fsdp_saved")
    )
    single["llama_from_fsdp"] = resume_run(
        SingleDevice("cpu"),
        mds,
        str(out / "llama_single_from_fsdp"),
        load=str(out / "llama_fsdp_saved"),
        family="llama",
    )
    return single, ranks


AUTO = ["fsdp_auto_oom_in_forward", "fsdp_auto_oom_in_backward"]


@pytest.mark.parametrize("name", [*PARITY, *AUTO])
def test_same_losses_as_one_process(runs, name):
    single, ranks = runs
    reference = single["parity"].losses
    assert len(reference) == 3
    for rank in ranks:
        assert rank[name]["losses"] == pytest.approx(reference, rel=RTOL), name


@pytest.mark.parametrize("name", [n for n, options in PARITY.items() if options is not None])
def test_sharded_initialization_equals_one_process_initialization(runs, name):
    single, ranks = runs
    initial = ranks[0][name]["initial"]
    assert initial.keys() == single["parity"].initial.keys()
    for key, value in single["parity"].initial.items():
        assert torch.equal(initial[key], value), key


@pytest.mark.parametrize("name", AUTO)
def test_auto_microbatching_agrees_when_one_rank_runs_out_of_memory_mid_step(runs, name):
    _, ranks = runs
    # Rank 1 fails inside a block at 2 samples (once); rank 0 learns it at its next collective
    # instead of entering an all-gather or reduce-scatter alone, and halves with it (the losses
    # then equal one process's: test_same_losses_as_one_process).
    assert [r[name]["raised"] for r in ranks] == [0, 1]


@pytest.mark.cuda  # a real out-of-memory error needs CUDA
def test_real_cuda_oom_under_fsdp_is_recovered(tmp_path):
    # One rank: FSDP's own state after a real error (gathered blocks, CUDA events, its per-step
    # trackers) is what the retry resets (llmfoundry/distributed/torch_compat.py).
    run_ranks(real_oom_rank, 1, free_port(), str(tmp_path), limit_s=LIMIT_S)
    result = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert 1 <= result["microbatch"] < 512


def test_bf16_mixed_precision_stays_close_to_fp32(runs):
    single, ranks = runs
    # bf16 keeps 8 bits of mantissa: relative error 2^-8 per operation, a few 1e-3 on a loss.
    assert ranks[0]["fsdp_bf16"]["losses"] == pytest.approx(single["parity"].losses, rel=2e-2)
    assert ranks[0]["fsdp_bf16"]["losses"] != pytest.approx(single["parity"].losses, rel=RTOL)


def test_ranks_read_disjoint_partitions_of_the_global_batch(runs):
    single, ranks = runs
    for step, ids in enumerate(single["straight"].ids):
        both = ranks[0]["fsdp_straight"]["ids"][step] + ranks[1]["fsdp_straight"]["ids"][step]
        assert sorted(both) == sorted(ids)


@pytest.mark.parametrize(
    "resumed", ["ddp_from_fsdp", "fsdp_from_ddp", "fsdp_from_single", "single_from_fsdp"]
)
def test_resume_at_another_world_size_and_strategy(runs, resumed):
    single, ranks = runs
    straight = single["straight"]
    if resumed == "single_from_fsdp":
        losses, ids = single["from_fsdp"].losses, single["from_fsdp"].ids
    else:
        losses = ranks[0][resumed]["losses"]
        ids = [a + b for a, b in zip(*(r[resumed]["ids"] for r in ranks), strict=True)]
    assert len(losses) == RESUME_BATCHES - STOP_AT
    assert losses == pytest.approx(straight.losses[STOP_AT:], rel=RTOL)
    assert [sorted(i) for i in ids] == [sorted(i) for i in straight.ids[STOP_AT:]]


@pytest.mark.parametrize("resumed", ["llama_ddp_from_fsdp", "llama_from_fsdp"])
def test_llama_trains_sharded_and_resumes_at_another_world_size(runs, resumed):
    single, ranks = runs
    straight = ranks[0]["llama_fsdp_straight"]
    assert straight["losses"] != pytest.approx(ranks[0]["fsdp_straight"]["losses"], rel=RTOL)
    if resumed == "llama_from_fsdp":  # two FSDP ranks -> one process
        losses = single[resumed].losses
    else:  # FSDP -> DDP
        losses = ranks[0][resumed]["losses"]
    assert len(losses) == RESUME_BATCHES - STOP_AT
    assert losses == pytest.approx(straight["losses"][STOP_AT:], rel=RTOL)


def test_sigterm_on_one_rank_saves_a_sharded_checkpoint_that_resumes(runs):
    _, ranks = runs
    for rank in ranks:  # both ranks stopped after the batch the signal arrived in
        assert len(rank["fsdp_preempted"]["losses"]) == STOP_AT
        resumed = rank["fsdp_after_preemption"]
        assert resumed["losses"] == pytest.approx(
            rank["fsdp_straight"]["losses"][STOP_AT:], rel=RTOL
        )
        assert resumed["ids"] == rank["fsdp_straight"]["ids"][STOP_AT:]


def test_fsdp_checkpoint_is_sharded(runs, tmp_path_factory):
    _, ranks = runs
    folder = next(tmp_path_factory.getbasetemp().glob("fsdp*")) / "fsdp_saved" / f"ep0-ba{STOP_AT}"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["manifest.json", "rng-rank0.pt", "rng-rank1.pt", "sharded", "state.pt"]
    assert (folder / "sharded" / ".metadata").exists()


def test_convert_sharded_checkpoint_to_one_safetensors_file(runs, tmp_path_factory, tmp_path):
    base = next(tmp_path_factory.getbasetemp().glob("fsdp*"))
    written = tmp_path / "model.safetensors"
    script = Path(__file__).parents[2] / "scripts" / "convert_checkpoint.py"
    argv = [str(script), str(base / "fsdp_saved"), str(written)]
    with mock.patch.object(sys, "argv", argv):  # the CLI, in this process (no second import)
        runpy.run_path(str(script), run_name="__main__")
    merged = safetensors.torch.load_file(written)
    # The one-process run at the same batch holds the same weights (up to summation order).
    single = safetensors.torch.load_file(base / "single_saved" / f"ep0-ba{STOP_AT}" / MODEL_FILE)
    assert merged.keys() == single.keys()
    for name, value in single.items():
        torch.testing.assert_close(merged[name], value, rtol=RTOL, atol=1e-6, msg=name)
