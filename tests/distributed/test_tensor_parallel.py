"""Tensor + sequence parallel (parallelism.tp) with FSDP on four gloo processes (CPU, fp32), for
Llama and for MPT (its fused Wqkv exchanged by head, ALiBi per local head): the same global
batch gives one process's loss trajectory, from-scratch initialization equals one process's
(and so does an evaluation), and a DCP checkpoint saved at tp=2 x dp=2 resumes at dp=4 and in
one process. Refusals (what a layout does not cover, sizes tp does not divide) run in this
process.

Tolerance: relative 1e-5 on losses, as test_fsdp.py. Tensor parallelism computes the same fp32
math in another order: each row-split matmul's two half sums are added by a reduce-scatter,
the loss's log-sum-exp is combined over the two vocabulary halves, and two data-parallel
ranks' gradients are averaged; measured 5.7e-8 (untied) and 1.7e-7 (tied, activation
checkpointing) relative over three AdamW steps, near fp32's epsilon (1.2e-7), while a wrong
layout (a head split across q/k/v, a missing reduction, an unsharded gradient counted twice)
moves the loss by 1e-3 or more. Initialization and checkpointed state: bit for bit.
"""

import pytest
import torch

from llmfoundry.distributed import SingleDevice
from llmfoundry.distributed.parallelize import check_tensor_parallel
from llmfoundry.models import parallel_plan
from llmfoundry.utils.errors import UserError
from tests.checkpoint.helpers import write_mds
from tests.trainer.conftest import tiny_model

from .sharded_worker import RESUME_BATCHES, STOP_AT, resume_run
from .spawn import free_port, run_ranks
from .tensor_parallel_worker import (
    PARITY,
    RESUMED,
    WORLD,
    rank_main,
    single_parity_run,
    tp_llama,
    tp_mpt,
)

RTOL, LIMIT_S = 1e-5, 600


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One-process references, one spawn of four ranks running every case, then a one-process
    resumption of the tp=2 x dp=2 checkpoint."""
    out = tmp_path_factory.mktemp("tensor_parallel")
    mds = str(write_mds(out / "mds", {"train": 32}))
    single = {model: single_parity_run(model) for _, model in PARITY.values()}
    straight = {
        family: resume_run(SingleDevice("cpu"), mds, str(out / f"{family}_straight"), model=build)
        for family, build in RESUMED.items()
    }
    ports = [free_port() for _ in range(len(PARITY) + 2 * len(RESUMED) + 2)]
    run_ranks(rank_main, WORLD, ports, str(out), mds, limit_s=LIMIT_S)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    from_tp = {
        family: resume_run(
            SingleDevice("cpu"),
            mds,
            str(out / f"{family}_single_from_tp"),
            model=build,
            load=str(out / f"{family}_tp2_dp2_saved"),
        )  # fmt: skip
        for family, build in RESUMED.items()
    }
    return single, straight, from_tp, ranks


@pytest.mark.parametrize("name", PARITY)
def test_tensor_parallel_gives_one_process_losses_initialization_and_eval(runs, name):
    single, _, _, ranks = runs
    reference, metrics, head_norms = single[PARITY[name][1]]
    assert len(reference.losses) == 3
    for rank in ranks:  # every rank reports the same (global) loss
        assert rank[name]["losses"] == pytest.approx(reference.losses, rel=RTOL), name
    initial = ranks[0][name]["initial"]
    assert initial.keys() == reference.initial.keys()
    for key, value in reference.initial.items():
        assert torch.equal(initial[key], value), key
    # Evaluation gathers the vocabulary-sharded logits and counts each sample once.
    assert "eval/train/loss" in metrics
    assert ranks[0][name]["eval"].keys() == metrics.keys()
    assert ranks[0][name]["eval"] == pytest.approx(metrics, rel=RTOL)
    # Qwen3's per-head q/k norms (one weight all of a rank's heads share) train as in one
    # process: the whole state (rank 0's) after three steps.
    assert (len(head_norms) > 0) == name.startswith("qwen3")
    trained = ranks[0][name]["head_norms"]
    assert trained.keys() == head_norms.keys()
    for key, value in head_norms.items():
        torch.testing.assert_close(trained[key], value, rtol=RTOL, atol=0)


@pytest.mark.parametrize("family", RESUMED)
@pytest.mark.parametrize("resumed", ["dp4_from_tp2_dp2", "single_from_tp2_dp2"])
def test_tensor_parallel_checkpoint_resumes_on_another_mesh(runs, family, resumed):
    _, straight, from_tp, ranks = runs
    straight = straight[family]
    saved = ranks[0][f"{family}_tp2_dp2_saved"]
    assert saved["losses"] == pytest.approx(straight.losses[:STOP_AT], rel=RTOL)
    if resumed == "single_from_tp2_dp2":
        losses, ids = from_tp[family].losses, from_tp[family].ids
    else:  # four data-parallel ranks: their samples together are one process's
        name = f"{family}_{resumed}"
        losses = ranks[0][name]["losses"]
        ids = [sum(step, []) for step in zip(*(r[name]["ids"] for r in ranks), strict=True)]
    assert len(losses) == RESUME_BATCHES - STOP_AT
    assert losses == pytest.approx(straight.losses[STOP_AT:], rel=RTOL)
    assert [sorted(i) for i in ids] == [sorted(i) for i in straight.ids[STOP_AT:]]


def test_tensor_parallel_refuses_auto_microbatching_on_every_rank(runs):
    *_, ranks = runs
    for rank in ranks:
        assert rank["auto_microbatching"]["error"].startswith(
            "device_train_microbatch_size=auto with parallelism.tp=2"
        )


def test_tensor_parallel_refuses_a_sequence_it_cannot_split_on_every_rank(runs):
    *_, ranks = runs
    for rank in ranks:
        assert rank["odd_sequence"]["error"].startswith(
            "parallelism.tp=2 splits each sequence over 2 ranks, but this input has 15 positions"
        )


def test_tensor_parallel_refuses_what_it_cannot_split():
    check_tensor_parallel(parallel_plan(tp_llama()), 2)
    with pytest.raises(UserError, match=r"parallelism.tp=4 does not divide .*n_kv_heads=2"):
        check_tensor_parallel(parallel_plan(tp_llama()), 4)
    check_tensor_parallel(parallel_plan(tp_mpt()), 2)
    with pytest.raises(UserError, match=r"parallelism.tp=4 does not divide .*kv_n_heads=2"):
        check_tensor_parallel(parallel_plan(tp_mpt()), 4)
    with pytest.raises(
        UserError, match=r"parallelism.tp=2 with compiled blocks .*model.compile=false"
    ):
        check_tensor_parallel(parallel_plan(tiny_model(compile=True)), 2)
    for unplanned, match in (
        (
            {"qk_ln": True},
            r"does not cover model.qk_ln=true .*turn it off, or use parallelism.tp=1",
        ),
        ({"alibi": False}, r"does not cover model.learned_pos_emb=true"),
        ({"infini": {"segment_len": 8}}, r"does not cover model.infini"),
    ):
        with pytest.raises(UserError, match=match):
            check_tensor_parallel(parallel_plan(tiny_model(**unplanned)), 2)
