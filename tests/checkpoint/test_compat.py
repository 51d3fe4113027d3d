"""The changed-recipe check on its own: which keys refuse, which warn, which pass quietly."""

import logging

import pytest
import torch

from llmfoundry.checkpoint import CheckpointError
from llmfoundry.checkpoint.compat import check_resume, keep_hyperparameters

SAVED = {
    "run_name": "a",
    "max_duration": "100ba",
    "global_train_batch_size": 16,
    "model": {"_target_": "MPT", "d_model": 64, "resid_pdrop": 0.0},
    "optimizer": {"_target_": "AdamW", "lr": 1e-3},
    "loggers": {"console": {"log_interval": 1}},
}


def changed(**parts):
    new = {**SAVED}
    for key, value in parts.items():
        group, _, name = key.partition("__")
        new[group] = {**new[group], name: value} if name else value
    return new


def test_same_config_or_bookkeeping_changes_pass_quietly(caplog):
    check_resume(SAVED, SAVED, (), "ckpt")
    check_resume(SAVED, changed(run_name="b", max_duration="200ba", loggers={}), (), "ckpt")
    check_resume({}, SAVED, (), "ckpt")  # a checkpoint saved without a config
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("new", "ignored", "message"),
    [
        (changed(model__d_model=128), (), "model.d_model: 64 -> 128"),
        (changed(optimizer___target_="Lion"), (), "optimizer._target_: 'AdamW' -> 'Lion'"),
        (changed(model__d_model=128, optimizer___target_="Lion"), ("optimizer",), "add model to"),
    ],
)
def test_architecture_or_optimizer_class_is_refused(new, ignored, message):
    with pytest.raises(CheckpointError, match="cannot continue with this config") as err:
        check_resume(SAVED, new, ignored, "ckpt")
    assert message in str(err.value)


LLAMA = {
    "_target_": "llmfoundry.models.llama.LlamaConfig",
    **{"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 128, "n_kv_heads": None},
}


def test_a_llama_resume_is_held_to_the_llama_architecture(caplog):
    saved = {**SAVED, "model": LLAMA}
    # Null n_kv_heads / ffn_hidden_size mean the resolved values an imported checkpoint records.
    resolved = {**LLAMA, "n_kv_heads": 4, "ffn_hidden_size": 256}
    check_resume(saved, {**SAVED, "model": resolved}, (), "ckpt")
    assert caplog.text == ""
    for key, value, message in [
        ("n_kv_heads", 2, "model.n_kv_heads: 4 -> 2"),
        ("rope_theta", 10.0, "model.rope_theta: 500000.0 -> 10.0"),
        ("rope_scaling", {"factor": 8.0}, "model.rope_scaling.factor: <absent> -> 8.0"),
        ("_target_", "llmfoundry.models.mpt.MPTConfig", "model._target_"),
    ]:
        with pytest.raises(CheckpointError, match="cannot continue") as err:
            check_resume(saved, {**SAVED, "model": {**LLAMA, key: value}}, (), "ckpt")
        assert message in str(err.value)


def test_a_key_added_later_is_its_old_behaviour_in_older_checkpoints(caplog):
    """A checkpoint written before scheduler.composer_lag existed ran without the lag: resuming
    it with the option off is no change of recipe, turning it on is one."""
    caplog.set_level(logging.WARNING)
    saved = {**SAVED, "scheduler": {"_target_": "Cosine", "t_warmup": "2ba"}}
    check_resume(saved, changed(scheduler={**saved["scheduler"], "composer_lag": False}), (), "c")
    assert caplog.text == ""
    check_resume(saved, changed(scheduler={**saved["scheduler"], "composer_lag": True}), (), "c")
    assert "scheduler.composer_lag: False -> True" in caplog.text


def test_ignored_parts_opt_out_and_legal_changes_warn(caplog):
    caplog.set_level(logging.WARNING)
    new = changed(model__d_model=128, optimizer___target_="Lion", global_train_batch_size=32)
    check_resume(SAVED, new, ("model", "optimizer"), "ckpt")
    assert "global_train_batch_size: 16 -> 32" in caplog.text
    assert "model.d_model: 64 -> 128" in caplog.text  # still said, not refused


def test_loaded_optimizer_state_keeps_the_new_hyperparameters():
    param = torch.nn.Parameter(torch.ones(2))
    old = torch.optim.AdamW([param], lr=1e-3, weight_decay=0.1)
    param.grad = torch.ones(2)
    old.step()
    new = torch.optim.AdamW([param], lr=5e-4, weight_decay=0.0)
    with keep_hyperparameters(new):
        new.load_state_dict(old.state_dict())
    assert new.param_groups[0]["lr"] == 5e-4 and new.param_groups[0]["weight_decay"] == 0.0
    assert torch.equal(new.state[param]["exp_avg"], old.state[param]["exp_avg"])


def test_a_changed_initial_lr_keeps_the_schedule_position():
    param = torch.nn.Parameter(torch.ones(2))
    old = torch.optim.AdamW([{"params": [param], "initial_lr": 1e-3, "lr": 1e-3 * 0.25}])
    new = torch.optim.AdamW([{"params": [param], "initial_lr": 2e-3, "lr": 2e-3}])
    with keep_hyperparameters(new):
        new.load_state_dict(old.state_dict())
    assert new.param_groups[0]["initial_lr"] == 2e-3
    assert new.param_groups[0]["lr"] == pytest.approx(2e-3 * 0.25)
