"""Evaluation on every mesh (llmfoundry/eval/forward.py): tensor parallel (tp=2 x dp=2),
pipeline parallel (pp=2 x dp=2), both (tp=2 x pp=2), FSDP (dp=4), and context parallel with
each (cp=2 x tp=2, cp=2 x pp=2), four gloo processes on CPU in fp32, give one process's
answers on every rank: continuation scores, the ICL tasks of each kind (llmfoundry/eval/icl.py),
and greedy and sampled generation (one process's by the KV-cached decoder).

Tolerance: 1e-5 absolute on summed log-probabilities, the same fp32 math in another order (a
tensor-parallel matmul's partial sums, a reduce-scatter): measured at most 2.4e-6.
A real error (a padded position seen, a stage skipped, the wrong rows kept, a cp rank's
logits put at another's positions) moves them by 1e-2 or more, and flips choices and tokens,
which must be identical.
"""

import pytest
import torch

from .mesh_eval_worker import GENERATIONS, MESHES, WORLD, one_process, rank_main, write_tasks
from .spawn import free_port, run_ranks

LIMIT_S, ATOL = 300, 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mesh-eval")
    write_tasks(folder)
    ports = [free_port() for _ in MESHES]
    assert run_ranks(rank_main, WORLD, ports, str(folder), limit_s=LIMIT_S) == [0] * WORLD
    ranks = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    return one_process(folder), ranks


@pytest.mark.parametrize("mesh", list(MESHES))
def test_scores_answers_and_generations_equal_one_process_on_every_rank(runs, mesh):
    single, ranks = runs
    # Right and wrong answers (the question's is one process's 32 tokens).
    assert [single["icl"][task][0] for task in ("mc", "lambada", "qa")] == [0.5, 0.5, 1.0]
    for rank in ranks:
        got = rank[mesh]
        assert [greedy for _, greedy in got["scores"]] == [g for _, g in single["scores"]]
        logprobs = [lp for lp, _ in single["scores"]]
        assert [lp for lp, _ in got["scores"]] == pytest.approx(logprobs, abs=ATOL)
        assert got["icl"] == single["icl"]
        for name in GENERATIONS:
            assert got[name] == single[name], name


def test_a_reduction_that_fails_raises_on_every_rank(runs):
    """Under a pipeline only the last stage reduces: its error reaches the other stages, which
    would otherwise wait for its result until the collective timeout."""
    _, ranks = runs
    raised, sent = (
        "no token to draw",
        "the last pipeline stage failed: ValueError('no token to draw')",
    )
    for mesh in MESHES:
        # The pp axis is the mesh's outermost: ranks 2 and 3 hold the last stage.
        expected = [sent, sent, raised, raised] if "pp" in mesh else [raised] * WORLD
        assert [rank[mesh]["failure"] for rank in ranks] == expected
