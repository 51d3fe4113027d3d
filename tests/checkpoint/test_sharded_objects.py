"""How algorithm/callback state laid out like the parameters finds its way back from the shards
(llmfoundry/checkpoint/sharded.py); with DTensors under FSDP: tests/distributed/
test_fsdp_checkpoints.py."""

import pytest
import torch

from llmfoundry.checkpoint.sharded import IN_SHARDS, fit_layout, shard_targets, split_shards


def test_whole_tensors_stay_in_state_pt():
    tree = {"EMA": {"averages": {"w": torch.ones(2)}}, "Other": {"n": 3}}
    assert split_shards(tree) == (tree, {})


def test_shard_targets_are_the_loading_objects_own_tensors_at_the_marked_places():
    live = torch.zeros(3)
    saved = {
        "EMA": {"averages": {"w": IN_SHARDS}, "n": 1},
        "Old": {"x": IN_SHARDS},
    }
    current = {"EMA": {"averages": {"w": live}, "n": 2}}
    targets = shard_targets(saved, current)
    assert targets == {"EMA": {"averages": {"w": live}}} and targets["EMA"]["averages"]["w"] is live
    live.fill_(7.0)  # as DCP fills it in place
    loaded = fit_layout(saved["EMA"], current["EMA"], targets["EMA"])
    assert loaded["n"] == 1 and torch.equal(loaded["averages"]["w"], torch.full((3,), 7.0))


def test_a_sharded_tensor_without_a_place_in_this_run_is_a_clear_error():
    saved, current = {"w": IN_SHARDS, "gone": IN_SHARDS}, {"w": torch.zeros(1)}
    targets = shard_targets(saved, current)
    assert list(targets) == ["w"]
    with pytest.raises(ValueError, match="add 'algorithms' or 'callbacks' to load_ignore_keys"):
        fit_layout(saved, current, targets)
