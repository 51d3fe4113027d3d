"""Scoring on every mesh (llmfoundry/eval/forward.py): tensor parallel (tp=2 x dp=2), pipeline
parallel (pp=2 x dp=2), both (tp=2 x pp=2) and FSDP (dp=4), four gloo processes on CPU in
fp32, give one process's answers on every rank.

Tolerance: 1e-5 absolute on summed log-probabilities, the same fp32 math in another order (a
tensor-parallel matmul's partial sums, a reduce-scatter): measured at most 1.9e-6. A real
error (a padded position seen, a stage skipped, the wrong rows kept) moves them by 1e-2 or
more, and flips choices and tokens.
"""

from pathlib import Path

import pytest
import torch

from .mesh_eval_worker import MESHES, WORLD, one_process, rank_main
from .spawn import free_port, run_ranks

LIMIT_S, ATOL = 300, 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh-eval")
    ports = [free_port() for _ in MESHES]
    assert run_ranks(rank_main, WORLD, ports, str(out), limit_s=LIMIT_S) == [0] * WORLD
    ranks = [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return one_process(), ranks


@pytest.mark.parametrize("mesh", list(MESHES))
def test_continuations_score_as_on_one_process_on_every_rank(runs, mesh):
    single, ranks = runs
    for rank in ranks:
        got = rank[mesh]["scores"]
        assert [greedy for _, greedy in got] == [greedy for _, greedy in single["scores"]]
        assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in single["scores"]], abs=ATOL)
