"""How algorithm/callback state laid out like the parameters finds its way back from the shards
(llmfoundry/checkpoint/sharded.py); with DTensors under FSDP: tests/distributed/
test_fsdp_checkpoints.py."""

import pytest
import torch

from llmfoundry.checkpoint.sharded import (
    IN_SHARDS,
    fit_layout,
    load_sharded_state,
    shard_targets,
    sharded_state,
    split_shards,
)


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


def test_optimizer_groups_a_pipeline_checkpoint_by_index_lost_take_this_runs_values():
    """Shards saved before issue 32 kept the groups by index, and DCP wrote one stage's: on the
    other stage a group's saved parameter names match none of its own, so torch loads it with
    its parameters alone (KeyError 'initial_lr' at the first step). Its state still loads (keyed
    by name); its hyperparameters are this run's."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    groups = [
        {"params": list(model[0].parameters()), "weight_decay": 0.1},
        {"params": list(model[1].parameters()), "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    saved = sharded_state(model, optimizer, by_name=False)["optimizer"]
    saved["param_groups"][0]["params"] = ["other_stage.weight", "other_stage.bias"]
    exp_avg = {k: v["exp_avg"].clone() for k, v in saved["state"].items()}
    for state in optimizer.state.values():
        state["exp_avg"].zero_()
    load_sharded_state(model, optimizer, {"optimizer": saved}, by_name=False)
    first, second = optimizer.param_groups
    assert first["initial_lr"] == first["lr"] == 1e-3 and first["weight_decay"] == 0.1
    assert second["initial_lr"] == 1e-3 and second["weight_decay"] == 0.0
    assert torch.equal(optimizer.state[model[0].weight]["exp_avg"], exp_avg["0.weight"])
