"""Context parallelism (parallelism.cp, llmfoundry/distributed/context.py) with FSDP on four gloo
processes (CPU, fp32): cp=2 x dp=2 for MPT (ALiBi, grouped-query heads, packed documents) and
Llama (RoPE, packed documents), and cp=4 for MPT, give one process's per-step losses, gradient
norms and eval metrics on every rank; a sequence length 2 cp does not divide and
infini-attention are refused on every rank, before any collective (auto-microbatching under
cp, and cp with tp and pp: test_context_mesh.py).

Tolerance: relative 1e-5, as the other parity tests. The same fp32 math in another order: the
gradient of a key summed over the ranks whose queries read it (a reduce-scatter), the losses
of the rows' parts summed over ranks, parameter gradients averaged over dp_shard x cp:
measured at most 8.8e-7 relative on losses and gradient norms over the three steps, the first
step's gradients within 1.3e-7 absolute of one process's. AdamW runs with eps=1e-6: its first
update is g / (|g| + eps) per element, so an element whose gradient is as small as eps moves
by a share of the learning rate that its fp32 rounding decides. With eps=1e-8 one of MPT's
Wqkv gradients (1.17e-8 in one process, 1.23e-8 here) made a 1e-4 weight difference and the
third step's gradient norm 1.9e-5 relative apart. A real error (a key at the wrong position, a
document boundary or ALiBi distance off by one, a loss counted twice) moves the first loss by
1e-3 or more.
"""

import pytest
import torch

from .context_parallel_worker import PARITY, WORLD, rank_main, single_parity_run
from .spawn import free_port, run_ranks

RTOL, LIMIT_S = 1e-5, 300


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One-process references, then one spawn of four ranks running every case."""
    out = tmp_path_factory.mktemp("context_parallel")
    single = {model: single_parity_run(model) for _, model in PARITY.values()}
    ports = [free_port() for _ in range(len(PARITY) + 2)]
    assert run_ranks(rank_main, WORLD, ports, str(out), limit_s=LIMIT_S) == [0] * WORLD
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return single, ranks


@pytest.mark.parametrize("name", PARITY)
def test_context_parallel_gives_one_process_losses_gradients_and_eval(runs, name):
    single, ranks = runs
    reference, metrics = single[PARITY[name][1]]
    assert len(reference.losses) == 3 and len(reference.grad_norms) == 3
    for rank in ranks:  # every rank reports the same (global) numbers
        assert rank[name]["losses"] == pytest.approx(reference.losses, rel=RTOL)
        assert rank[name]["grad_norms"] == pytest.approx(reference.grad_norms, rel=RTOL)
        assert "eval/train/loss" in metrics
        assert rank[name]["eval"] == pytest.approx(metrics, rel=RTOL)


def test_context_parallel_refuses_on_every_rank(runs):
    _, ranks = runs
    for rank in ranks:
        assert rank["odd_length"].startswith(
            "parallelism.cp=2 splits each sequence into 4 chunks (two per rank), but this batch's "
            "sequences have 14 positions, not a multiple of 4"
        )
        assert rank["infini"].startswith("parallelism.cp=2: model.infini's memory runs through")
