import functools
import logging
import math

import pytest
import torch

from llmfoundry.optim import (
    DecoupledAdamW,
)
from llmfoundry.trainer import Callback, Trainer

from .conftest import tiny_model, token_batches


def trainer_for(tmp_path, batches, **kwargs):
    kwargs.setdefault("max_duration", f"{len(batches)}ba")
    kwargs.setdefault("optimizer", functools.partial(torch.optim.SGD, lr=0.1))
    kwargs.setdefault("precision", "fp32")  # exact comparisons; auto is bf16 on a GPU
    return Trainer(model=tiny_model(), train_dataloader=batches, run_dir=tmp_path, **kwargs)


def masked_batches():
    """Labels with -100 in unequal amounts, so per-microbatch token counts differ."""
    batches = token_batches(2, 4, seed=3)
    for batch in batches:
        batch["labels"][0, :12] = -100
        batch["labels"][3, 5:] = -100
    return batches


def test_microbatches_weighted_by_loss_tokens_equal_one_large_batch(tmp_path):
    full = trainer_for(tmp_path, masked_batches())
    micro = trainer_for(tmp_path, masked_batches(), device_train_microbatch_size=1)
    full.fit()
    micro.fit()
    for (name, a), (_, b) in zip(
        full.state.model.named_parameters(), micro.state.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert full.state.train_loss == pytest.approx(micro.state.train_loss, rel=1e-6)


def test_unweighted_mean_of_microbatch_means_would_differ(tmp_path):
    """Guard for the test above: the masked batches really do have unequal token counts."""
    batch = masked_batches()[0]
    counts = (batch["labels"][:, 1:] != -100).sum(dim=1)
    assert len(set(counts.tolist())) > 1


def test_batch_without_loss_tokens_is_an_error(tmp_path):
    batches = token_batches(1, 2)
    batches[0]["labels"][:] = -100
    with pytest.raises(ValueError, match="no loss tokens"):
        trainer_for(tmp_path, batches).fit()


def test_timestamp_counts_and_token_based_duration(tmp_path):
    batches = token_batches(3, 4)  # 4 x 16 = 64 tokens per batch
    trainer = trainer_for(tmp_path, batches, max_duration="130tok")
    state = trainer.fit()
    # 130 tokens are passed during the third batch.
    assert (state.timestamp.batch, state.timestamp.sample, state.timestamp.token) == (3, 12, 192)
    assert state.timestamp.epoch == 1


def test_multiple_epochs_and_stop_mid_epoch(tmp_path):
    state = trainer_for(tmp_path, token_batches(3, 2), max_duration="2ep").fit()
    assert (state.timestamp.epoch, state.timestamp.batch) == (2, 6)
    state = trainer_for(tmp_path, token_batches(3, 2), max_duration="4ba").fit()
    assert (state.timestamp.epoch, state.timestamp.batch, state.timestamp.batch_in_epoch) == (
        1,
        4,
        1,
    )


def test_eval_metrics_interval_and_subset(tmp_path, caplog):
    class CountEvals(Callback):
        calls = []

        def eval_end(self, state, logger):
            self.calls.append((state.timestamp.batch, state.eval_name))

    trainer = trainer_for(
        tmp_path,
        token_batches(4, 2),
        eval_dataloaders={"a": token_batches(3, 2, seed=5), "b": token_batches(1, 2, seed=6)},
        eval_interval="2ba",
        eval_first=True,
        eval_subset_num_batches=2,
        callbacks=[CountEvals()],
    )
    with caplog.at_level(logging.WARNING, logger="llmfoundry.trainer.trainer"):
        state = trainer.fit()
    assert CountEvals.calls == [(0, "a"), (0, "b"), (2, "a"), (2, "b"), (4, "a"), (4, "b")]
    # Said once, for the set the subset cut short ("b" has 1 batch: all of it was evaluated).
    subset = [r.getMessage() for r in caplog.records if "eval_subset_num_batches" in r.getMessage()]
    assert subset == [
        "eval/a: evaluated 2 of 3 batches (eval_subset_num_batches=2): its metrics are of that "
        "subset; eval_subset_num_batches=null evaluates the whole set"
    ]
    metrics = state.eval_metrics
    assert set(metrics) == {
        f"eval/{n}/{m}" for n in "ab" for m in ("loss", "perplexity", "accuracy")
    }
    assert metrics["eval/a/perplexity"] == pytest.approx(math.exp(metrics["eval/a/loss"]))
    assert 0.0 <= metrics["eval/a/accuracy"] <= 1.0


def test_eval_loss_matches_model_loss(tmp_path):
    data = token_batches(1, 4, seed=9)
    trainer = trainer_for(tmp_path, token_batches(1, 2), eval_dataloaders={"v": data})
    metrics = trainer.evaluate()
    model = trainer.state.model
    with torch.no_grad():
        expected = model.loss(model(data[0]["input_ids"]), data[0]["labels"]).item()
    assert metrics["eval/v/loss"] == pytest.approx(expected, rel=1e-5)


def test_decoupled_weight_decay_follows_schedule_not_lr():
    param = torch.nn.Parameter(torch.ones(3))
    opt = DecoupledAdamW([param], lr=1e-3, weight_decay=0.1)
    param.grad = torch.zeros(3)
    opt.param_groups[0]["lr"] = 0.5e-3  # schedule at half the initial lr
    before = param.detach().clone()
    opt.step()
    # decay factor 1 - 0.1 * 0.5 = 0.95, the zero gradient adds no Adam update
    torch.testing.assert_close(param.detach(), before * 0.95)
    with pytest.raises(ValueError, match="lr must be positive"):
        DecoupledAdamW([param], lr=0)


def test_training_is_deterministic(tmp_path):
    a = trainer_for(tmp_path, token_batches(3, 2)).fit()
    b = trainer_for(tmp_path, token_batches(3, 2)).fit()
    assert a.train_loss == b.train_loss
    for (name, x), (_, y) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert torch.equal(x, y), name


def test_a_microbatch_s_logits_are_not_held_through_the_next_forward_or_the_step(tmp_path):
    """state.outputs (a [rows, seq, vocab] tensor) is dropped after each microbatch's backward:
    held, it would sit beside the next microbatch's logits and through the optimizer step."""

    class Seen(Callback):
        def __init__(self) -> None:
            self.outputs: list[tuple[str, bool]] = []

        def run_event(self, event, state, logger):
            if event.value in ("before_forward", "after_backward", "after_train_batch"):
                self.outputs.append((event.value, state.outputs is not None))

    seen = Seen()
    trainer = trainer_for(
        tmp_path, token_batches(1, 4), callbacks=[seen], device_train_microbatch_size=2
    )
    trainer.fit()
    assert seen.outputs == [
        ("before_forward", False),
        ("after_backward", True),  # the callbacks of the microbatch still see its logits
        ("before_forward", False),
        ("after_backward", True),
        ("after_train_batch", False),
    ]
