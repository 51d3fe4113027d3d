"""Context parallelism composed with the other axes, on four gloo processes (CPU, fp32): cp2 x
tp2 (sequence parallel inside each rank's part of the sequence) with selective and full
activation checkpointing (the latter in microbatches of 2 rows), and cp2 x pp2, for MPT (ALiBi,
grouped-query heads, packed documents) and Llama (RoPE, packed documents); cp2 x dp2 with
automatic microbatching through out-of-memory errors inside attention; an evaluation after each;
a DCP checkpoint saved at cp2 x dp2 resumed at tp2 x dp2 and in one process, the ranks of a cp
group reading the same samples. Every run gives one process's per-step losses and gradient
norms, and its eval metrics.

Tolerance: relative 1e-5, as test_tensor_parallel.py: the same fp32 math in another order
(attention's rows computed on two ranks, the gathered keys' gradients reduce-scattered, the
loss summed over the ranks' parts of each sequence); measured at most 2.0e-7 on the losses,
3.6e-7 on the gradient norms and 8.7e-7 on the eval metrics, while the pipeline stages' keys
made without the documents' ids moved the losses by 5e-3 (Llama) and 5e-2 (MPT).
"""

import pytest
import torch

from llmfoundry.distributed import SingleDevice
from llmfoundry.distributed.parallelize import _refuse_unsplittable_sequence
from llmfoundry.utils.errors import UserError
from tests.checkpoint.helpers import write_mds

from .context_mesh_worker import (
    BACKWARD_FITS,
    FORWARD_FITS,
    PARITY,
    WORLD,
    rank_main,
    single_parity_run,
)
from .sharded_worker import RESUME_BATCHES, STOP_AT, resume_run
from .spawn import free_port, run_ranks
from .tensor_parallel_worker import tp_mpt

RTOL, LIMIT_S = 1e-5, 600


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One-process references, one spawn of four ranks running every case, then a one-process
    resumption of the cp2 x dp2 checkpoint."""
    out = tmp_path_factory.mktemp("context_mesh")
    mds = str(write_mds(out / "mds", {"train": 32}))
    references = {(model, batches) for _, model, _, batches in PARITY.values()}
    single = {key: single_parity_run(*key) for key in sorted(references)}
    straight = resume_run(SingleDevice("cpu"), mds, str(out / "straight"), model=tp_mpt)
    ports = [free_port() for _ in range(len(PARITY) + 2)]
    run_ranks(rank_main, WORLD, ports, str(out), mds, limit_s=LIMIT_S)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    one_from_cp = resume_run(
        SingleDevice("cpu"), mds, str(out / "one_from_cp2"), model=tp_mpt,
        load=str(out / "cp2_dp2_saved"),
    )  # fmt: skip
    return single, straight, one_from_cp, ranks


@pytest.mark.parametrize("name", PARITY)
def test_context_parallel_on_a_mesh_gives_one_process_losses_norms_and_eval(runs, name):
    single, *_, ranks = runs
    _, model, _, batches = PARITY[name]
    reference = single[(model, batches)]
    assert len(reference["losses"]) == len(reference["norms"]) == 3
    for rank in ranks:  # every rank reports the same (global) loss and norm
        assert rank[name]["losses"] == pytest.approx(reference["losses"], rel=RTOL)
        assert rank[name]["norms"] == pytest.approx(reference["norms"], rel=RTOL)
        assert rank[name]["eval"].keys() == reference["eval"].keys()
        assert rank[name]["eval"] == pytest.approx(reference["eval"], rel=RTOL)
    if name.endswith("auto_microbatching"):  # rank 1 ran out in attention, forward then backward
        assert ranks[1][name]["raised"] == [
            f"forward@{2 * FORWARD_FITS}",
            f"backward@{2 * BACKWARD_FITS}",
        ]


def test_a_context_parallel_checkpoint_resumes_on_another_mesh_and_in_one_process(runs):
    _, straight, one_from_cp, ranks = runs
    assert ranks[0]["cp2_dp2_saved"]["losses"] == pytest.approx(straight.losses[:STOP_AT], rel=RTOL)
    for losses in (ranks[0]["tp2_dp2_from_cp2_dp2"]["losses"], one_from_cp.losses):
        assert len(losses) == RESUME_BATCHES - STOP_AT
        assert losses == pytest.approx(straight.losses[STOP_AT:], rel=RTOL)


def test_the_context_parallel_ranks_of_a_group_read_the_same_samples(runs):
    """The data loader's partition is the data-parallel rank's: at cp2 x dp2 ranks 0 and 1 (one
    group) read the same samples, ranks 2 and 3 the others, and together one process's."""
    _, straight, _, ranks = runs
    ids = [rank["cp2_dp2_saved"]["ids"] for rank in ranks]
    assert ids[0] == ids[1] and ids[2] == ids[3]
    together = [sorted(a + b) for a, b in zip(ids[0], ids[2], strict=True)]
    assert together == [sorted(step) for step in straight.ids[:STOP_AT]]


def test_tensor_parallel_refuses_a_context_parallel_part_it_cannot_split():
    """Under cp the tensor-parallel check reads the forward's input, this rank's part of each
    sequence (a pipeline stage's `seq_len` too), and says what to pad the whole one to."""
    refuse = _refuse_unsplittable_sequence
    part = {"input_ids": torch.zeros(2, 10, dtype=torch.long)}  # cp=2's part of 20 positions
    refuse(2, 2, None, (part,), {})
    with pytest.raises(UserError, match=r"^parallelism.tp=4 splits each context-parallel .* this "
                       r"rank 10 of each sequence's 20 positions.*multiple of 16"):  # fmt: skip
        refuse(4, 2, None, (part,), {})
    with pytest.raises(UserError, match="this rank 6 of each sequence's 12 positions"):
        refuse(4, 2, None, (torch.zeros(2, 3, 32),), {"seq_len": 6})
