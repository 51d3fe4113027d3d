"""Expert parallelism on four gloo processes (CPU, fp32) against one process, in one spawn: the MoE
layer's dispatch and combine (ep4, ep2 x efsdp2: outputs, input and weight gradients); then
three training steps and an evaluation of a tiny Mixtral (four experts in each block) at ep2 x
dp2, ep4 with every 2nd block checkpointed, ep4 over dp_shard 2 x cp 2, ep2 x tp2 with full
activation checkpointing and ep2 x pp2 (losses, gradient norms, eval metrics); and a DCP
checkpoint saved at ep2 x dp2 resumed at ep4 and in one process (ep1).

Tolerance: relative 1e-5, the same fp32 math in another order (an expert's weight gradient
summed over the ranks' tokens, the norm over two meshes); measured at most 1.2e-7 on the
losses, 1.9e-7 on the gradient norms and 3.6e-8 on the eval metrics (the resumed losses
equal), while FSDP dividing the experts' gradient twice at efsdp=1 moved the ep2 x tp2 norm by
1.5e-4 (on this test's first model, a Llama with these MoE blocks; the losses by far less:
AdamW's steps hardly see a gradient's scale).
"""

import dataclasses

import pytest
import torch

from llmfoundry.distributed import FSDP, SingleDevice
from llmfoundry.distributed.expert import Dispatch, check_expert_parallel
from llmfoundry.models import parallel_plan
from llmfoundry.utils.errors import UserError
from tests.checkpoint.helpers import write_mds

from .expert_worker import (
    LAYER,
    LAYER_EP,
    PARITY,
    WORLD,
    layer_inputs,
    layer_run,
    moe_layer,
    parity_run,
    rank_main,
    tiny_mixtral,
)
from .sharded_worker import RESUME_BATCHES, STOP_AT, resume_run, tiny_llama
from .spawn import free_port, run_ranks

RTOL, ATOL, LIMIT_S = 1e-5, 1e-6, 600


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One-process references, one spawn of four ranks running every case, then a one-process
    resumption of the ep2 x dp2 checkpoint."""
    out = tmp_path_factory.mktemp("expert_parallel")
    mds = str(write_mds(out / "mds", {"train": 32}))
    single = parity_run(SingleDevice("cpu"))
    straight = resume_run(SingleDevice("cpu"), mds, str(out / "straight"), model=tiny_mixtral)
    ports = [free_port() for _ in range(len(LAYER_EP) + len(PARITY) + 2)]
    run_ranks(rank_main, WORLD, ports, str(out), mds, limit_s=LIMIT_S)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    one_from_ep2 = resume_run(
        SingleDevice("cpu"), mds, str(out / "one_from_ep2"), model=tiny_mixtral,
        load=str(out / "ep2_dp2_saved"),
    )  # fmt: skip
    return single, straight, one_from_ep2, ranks


@pytest.mark.parametrize("ep", LAYER_EP)
def test_the_moe_layer_split_over_ep_ranks_computes_what_one_process_does(runs, ep):
    """Each ep group's tokens through the whole layer in one process: every rank's outputs and
    input gradients are its rows'; its experts' weight gradients are the one process's for
    those experts (every token of the group routed to them counts); the router's, summed over
    the group, the one process's."""
    *_, ranks = runs
    inputs = layer_inputs()
    per_rank = LAYER.n_experts // ep
    for group in range(WORLD // ep):
        members = range(group * ep, (group + 1) * ep)
        whole = layer_run(moe_layer(), torch.cat([inputs[r] for r in members], dim=1))
        router = sum(ranks[r][f"layer_ep{ep}"]["grad.router.gate.weight"] for r in members)
        torch.testing.assert_close(router, whole["grad.router.gate.weight"], rtol=RTOL, atol=ATOL)
        for index, rank in enumerate(members):
            got = ranks[rank][f"layer_ep{ep}"]
            rows = slice(index * inputs[0].shape[1], (index + 1) * inputs[0].shape[1])
            for key in ("out", "x_grad"):
                torch.testing.assert_close(got[key], whole[key][:, rows], rtol=RTOL, atol=ATOL)
            held = slice(index * per_rank, (index + 1) * per_rank)
            for name in ("w_gate", "w_up", "w_down"):
                key = f"grad.experts.{name}"
                assert got[key].shape[0] == per_rank
                torch.testing.assert_close(got[key], whole[key][held], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", PARITY)
def test_expert_parallel_training_gives_one_process_losses_norms_and_eval(runs, name):
    single, *_, ranks = runs
    assert len(single["losses"]) == len(single["norms"]) == 3
    for rank in ranks:  # every rank reports the same (global) loss and norm
        assert rank[name]["losses"] == pytest.approx(single["losses"], rel=RTOL)
        assert rank[name]["norms"] == pytest.approx(single["norms"], rel=RTOL)
        assert rank[name]["eval"].keys() == single["eval"].keys()
        assert rank[name]["eval"] == pytest.approx(single["eval"], rel=RTOL)


def test_an_expert_parallel_checkpoint_resumes_on_another_mesh_and_in_one_process(runs):
    _, straight, one_from_ep2, ranks = runs
    assert ranks[0]["ep2_dp2_saved"]["losses"] == pytest.approx(straight.losses[:STOP_AT], rel=RTOL)
    for losses in (ranks[0]["ep4_from_ep2_dp2"]["losses"], one_from_ep2.losses):
        assert len(losses) == RESUME_BATCHES - STOP_AT
        assert losses == pytest.approx(straight.losses[STOP_AT:], rel=RTOL)


def test_models_expert_parallelism_cannot_split_are_refused_in_one_line():
    """Before any collective, every rank alike: no experts, compiled blocks, an expert count
    ep does not divide."""
    dense = tiny_llama()
    with pytest.raises(UserError, match=r"^parallelism.ep=2: this model has no experts to split"):
        check_expert_parallel(dense, parallel_plan(dense), 2)
    model = tiny_mixtral()
    plan = parallel_plan(model)
    check_expert_parallel(model, plan, 4)
    with pytest.raises(UserError, match=r"^parallelism.ep=3 does not divide the model's 4 experts"):
        check_expert_parallel(model, plan, 3)
    with pytest.raises(UserError, match=r"^parallelism.ep=2 with compiled blocks"):
        check_expert_parallel(model, dataclasses.replace(plan, compile=True), 2)
    with pytest.raises(UserError, match=r"^parallelism.ep=4 with .*checkpointing=selective is"):
        check_expert_parallel(model, plan, 4, "selective")


def test_the_received_copies_are_put_in_local_expert_order():
    """Two peers, two local experts each: what arrives is peer-major (peer 0's copies for its
    experts 0 and 1, then peer 1's); the experts need expert-major, each peer's in order."""
    counts = torch.tensor([1, 0, 2, 1])  # this rank's copies for the four global experts
    dispatch = Dispatch(counts, torch.tensor([[2, 1], [0, 3]]), group=None)  # [peer, expert]
    assert (dispatch.send_splits, dispatch.receive_splits) == ([1, 3], [3, 3])
    assert dispatch.local_counts.tolist() == [2, 4]
    dispatch = Dispatch(counts, torch.tensor([[1, 1], [2, 1]]), group=None)
    arrived = ["p0e0", "p0e1", "p1e0a", "p1e0b", "p1e1"]
    assert [arrived[i] for i in dispatch.order] == ["p0e0", "p1e0a", "p1e0b", "p0e1", "p1e1"]
    assert dispatch.order[dispatch.inverse].tolist() == list(range(5))


def test_expert_parallelism_refuses_auto_microbatching(monkeypatch):
    """An out-of-memory error inside a block would leave the ep peers waiting in its
    all-to-all, past the agreements FSDP makes before each block: refused in one line."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    strategy = FSDP("cpu", parallelism={"ep": 2})  # (no process group joined)
    with pytest.raises(UserError, match=r"^device_train_microbatch_size=auto with parallelism"
                       r".ep=2: .* its expert-parallel peers waiting; set a fixed "):  # fmt: skip
        strategy.guard_collectives(None)
