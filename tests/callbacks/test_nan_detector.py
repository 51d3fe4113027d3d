import math

import pytest
import torch

from llmfoundry.callbacks import NaNDetector
from llmfoundry.trainer import Callback

from .conftest import make_trainer


class PoisonLoss(Callback):
    """Turns the loss of one batch (0-based index) into `value`, as a diverged step would."""

    def __init__(self, batch, value=math.nan):
        self.batch, self.value = batch, value

    def after_loss(self, state, logger):
        if state.timestamp.batch == self.batch:
            state.loss = state.loss * self.value


def parameters_finite(trainer):
    return all(torch.isfinite(p).all() for p in trainer.state.model.parameters())


@pytest.mark.parametrize("value, shown", [(math.nan, "nan"), (math.inf, "inf")])
def test_non_finite_loss_raises_naming_the_batch_before_the_step(tmp_path, value, shown):
    detector = NaNDetector(check_every=1)  # reads every batch's verdict before its step
    trainer = make_trainer(tmp_path, n_batches=5, callbacks=[PoisonLoss(2, value), detector])
    with pytest.raises(
        FloatingPointError,
        match=rf"loss is {shown} at batch 3 \(epoch 0, batch 3 of the epoch, samples 8 to 11",
    ):
        trainer.fit()
    assert trainer.state.timestamp.batch == 2
    assert parameters_finite(trainer)  # the poisoned step was never applied


def test_without_the_detector_the_run_silently_goes_nan(tmp_path):
    """Guard for the test above: the poisoned loss really does ruin the weights."""
    trainer = make_trainer(tmp_path, n_batches=4, callbacks=[PoisonLoss(2)])
    state = trainer.fit()
    assert state.timestamp.batch == 4
    assert math.isnan(state.train_loss)
    assert not parameters_finite(trainer)


def test_finite_run_is_untouched(tmp_path):
    assert make_trainer(tmp_path, n_batches=3, callbacks=[NaNDetector()]).fit().timestamp.batch == 3


def test_checked_every_few_batches_it_names_the_first_non_finite_batch(tmp_path):
    """The default reads the device's verdict every `check_every` batches: batch 3 went NaN,
    batch 4's look (before its step) names batch 3 and says which steps were taken."""
    trainer = make_trainer(
        tmp_path, n_batches=6, callbacks=[PoisonLoss(2), NaNDetector(check_every=4)]
    )
    with pytest.raises(
        FloatingPointError,
        match=r"loss is nan at batch 3 \(epoch 0, batch 3 of the epoch, samples 8 to 11 of the "
        r"run\); the optimizer steps of batches 3 to 4 were taken .* resume from a checkpoint "
        r"saved before batch 3",
    ):
        trainer.fit()
    assert trainer.state.timestamp.batch == 3  # raised at batch 4, before its step
    assert not parameters_finite(trainer)  # batch 3's step was taken: the weights went NaN


def test_a_late_non_finite_loss_is_caught_at_the_end_of_training(tmp_path):
    trainer = make_trainer(
        tmp_path, n_batches=3, callbacks=[PoisonLoss(2), NaNDetector(check_every=10)]
    )
    with pytest.raises(FloatingPointError, match="loss is nan at batch 3"):
        trainer.fit()
    with pytest.raises(ValueError, match="check_every must be >= 1"):
        NaNDetector(check_every=0)
