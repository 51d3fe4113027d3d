"""Expert parallelism on four gloo processes (CPU, fp32) against one process: the MoE layer's
dispatch and combine (ep4, ep2 x efsdp2), then trainings.

Tolerance: relative 1e-5, the same fp32 math in another order (an expert's weight gradient
summed over the ranks' tokens).
"""

import pytest
import torch

from llmfoundry.distributed.expert import Dispatch

from .expert_worker import LAYER, LAYER_EP, WORLD, layer_inputs, layer_run, moe_layer, rank_main
from .spawn import free_port, run_ranks

RTOL, ATOL, LIMIT_S = 1e-5, 1e-6, 600


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn of four ranks running every case."""
    out = tmp_path_factory.mktemp("expert_parallel")
    ports = [free_port() for _ in range(len(LAYER_EP))]
    run_ranks(rank_main, WORLD, ports, str(out), limit_s=LIMIT_S)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("ep", LAYER_EP)
def test_the_moe_layer_split_over_ep_ranks_computes_what_one_process_does(runs, ep):
    """Each ep group's tokens through the whole layer in one process: every rank's outputs and
    input gradients are its rows'; its experts' weight gradients are the one process's for
    those experts (every token of the group routed to them counts); the router's, summed over
    the group, the one process's."""
    inputs = layer_inputs()
    per_rank = LAYER.n_experts // ep
    for group in range(WORLD // ep):
        ranks = range(group * ep, (group + 1) * ep)
        whole = layer_run(moe_layer(), torch.cat([inputs[r] for r in ranks], dim=1))
        router = sum(runs[r][f"layer_ep{ep}"]["grad.router.gate.weight"] for r in ranks)
        torch.testing.assert_close(router, whole["grad.router.gate.weight"], rtol=RTOL, atol=ATOL)
        for index, rank in enumerate(ranks):
            got = runs[rank][f"layer_ep{ep}"]
            rows = slice(index * inputs[0].shape[1], (index + 1) * inputs[0].shape[1])
            for key in ("out", "x_grad"):
                torch.testing.assert_close(got[key], whole[key][:, rows], rtol=RTOL, atol=ATOL)
            held = slice(index * per_rank, (index + 1) * per_rank)
            for name in ("w_gate", "w_up", "w_down"):
                key = f"grad.experts.{name}"
                assert got[key].shape[0] == per_rank
                torch.testing.assert_close(got[key], whole[key][held], rtol=RTOL, atol=ATOL)


def test_the_received_copies_are_put_in_local_expert_order():
    """Two peers, two local experts each: what arrives is peer-major (peer 0's copies for
    experts 0 and 1, then peer 1's); the experts need expert-major, each peer's in order."""
    counts = torch.tensor([1, 0, 2, 1])  # this rank's copies for the four global experts
    received = torch.tensor([[2, 1], [0, 3]])  # [peer, local expert]
    dispatch = Dispatch(counts, received, group=None)
    assert (dispatch.send_splits, dispatch.receive_splits) == ([1, 3], [3, 3])
    assert dispatch.local_counts.tolist() == [2, 4]
    received = torch.tensor([[1, 1], [2, 1]])
    dispatch = Dispatch(counts, received, group=None)
    arrived = ["p0e0", "p0e1", "p1e0a", "p1e0b", "p1e1"]
    assert [arrived[i] for i in dispatch.order] == ["p0e0", "p1e0a", "p1e0b", "p0e1", "p1e1"]
    assert dispatch.order[dispatch.inverse].tolist() == list(range(5))
