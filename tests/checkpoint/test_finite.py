"""The check every save runs before writing (llmfoundry/checkpoint/finite.py), in one process;
with two ranks whose shards differ: tests/distributed/test_fsdp_checkpoints.py."""

import pytest
import torch

from llmfoundry.checkpoint import CheckpointError
from llmfoundry.checkpoint.finite import refuse_non_finite

FINITE = {
    "big": torch.tensor([3e38, -3e38]),  # near float32's limit, still finite
    "half": torch.tensor([65504.0, -65504.0], dtype=torch.float16),
    "ids": torch.tensor([1, 2]),  # not floating point: never judged
    "empty": torch.empty(0),  # (an FSDP rank may hold no elements of a small weight)
}


def test_finite_weights_pass():
    refuse_non_finite("checkpoint ep0-ba1", FINITE)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_or_either_infinity_is_refused_in_one_line_naming_the_first(bad):
    weights = {**FINITE, "w": torch.tensor([1.0, bad]), "v": torch.full((2, 2), bad)}
    with pytest.raises(CheckpointError) as err:
        refuse_non_finite("checkpoint ep0-ba8", weights)
    assert str(err.value) == (
        "refusing to save checkpoint ep0-ba8: weight 'w' (and 1 more) holds NaN or infinity "
        "(training diverged); the earlier checkpoints are kept: resume from the last one with a "
        "lower optimizer.lr, and keep the nan_detector callback on"
    )


def test_the_reduced_flags_decide():
    # A rank whose own part is finite refuses when another rank's is not (the reduce says so).
    def others_bad(flags):
        return flags + torch.tensor([0, 1, 0, 0], dtype=flags.dtype)

    with pytest.raises(CheckpointError, match="weight 'half' holds NaN or infinity"):
        refuse_non_finite("checkpoint ep0-ba8", FINITE, all_reduce_sum=others_bad)
