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
    trainer = make_trainer(tmp_path, n_batches=5, callbacks=[PoisonLoss(2, value), NaNDetector()])
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
