import copy

import pytest
import torch

from llmfoundry.algorithms import EMA
from llmfoundry.trainer import Callback
from tests.trainer.conftest import token_batches

from .helpers import Metrics, make_trainer


class Snapshots(Callback):
    """Model weights at INIT and after each step (callbacks run after the EMA's own update)."""

    def __init__(self):
        self.weights = []

    def _take(self, state):
        self.weights.append({n: p.detach().clone() for n, p in state.model.named_parameters()})

    def init(self, state, logger):
        self._take(state)

    def batch_end(self, state, logger):
        self._take(state)


def expected_average(snapshots, smoothing):
    average = {n: w.clone() for n, w in snapshots[0].items()}
    for weights in snapshots[1:]:
        for name, w in weights.items():
            average[name] = smoothing * average[name] + (1 - smoothing) * w
    return average


@pytest.mark.parametrize(
    "kwargs,smoothing",
    [
        ({"half_life": None, "smoothing": 0.7}, 0.7),
        ({"half_life": "2ba"}, 0.5**0.5),
        ({"half_life": "128tok"}, 0.5**0.5),  # 4 x 16 = 64 tokens per batch
        ({"half_life": "0.5dur"}, 0.5**0.5),  # 4 batches: half of the run is 2 batches
    ],
)
def test_average_follows_the_half_life_in_any_unit(tmp_path, kwargs, smoothing):
    ema, snapshots, metrics = EMA(**kwargs), Snapshots(), Metrics()
    make_trainer(tmp_path, algorithms=[ema], callbacks=[snapshots], loggers=[metrics]).fit()
    assert metrics.values("algorithms/ema_smoothing") == pytest.approx([smoothing] * 4)
    expected = expected_average(snapshots.weights, smoothing)
    for name, average in ema.averages.items():
        assert average.dtype == torch.float32
        torch.testing.assert_close(average, expected[name], msg=name)


def test_evaluation_uses_the_average_and_restores_the_weights(tmp_path):
    eval_data = token_batches(1, 4, seed=9)
    ema = EMA(half_life="1ba")
    trainer = make_trainer(tmp_path, algorithms=[ema], eval_dataloaders={"v": eval_data})
    trainer.fit()
    training_weights = {n: p.detach().clone() for n, p in trainer.state.model.named_parameters()}
    metrics = trainer.evaluate()
    averaged = copy.deepcopy(trainer.state.model)
    with torch.no_grad():
        for name, param in averaged.named_parameters():
            param.copy_(ema.averages[name])
        expected = averaged.loss(averaged(eval_data[0]["input_ids"]), eval_data[0]["labels"]).item()
        current = trainer.state.model
        with_training = current.loss(
            current(eval_data[0]["input_ids"]), eval_data[0]["labels"]
        ).item()
    assert metrics["eval/v/loss"] == pytest.approx(expected, rel=1e-5)
    assert with_training != pytest.approx(expected, rel=1e-4)  # the swap made a difference
    for name, param in trainer.state.model.named_parameters():
        assert torch.equal(param, training_weights[name]), name


def test_state_dict_round_trip_and_mismatch(tmp_path):
    ema = EMA(half_life="1ba")
    make_trainer(tmp_path, algorithms=[ema]).fit()
    restored = EMA(half_life="1ba")
    restored.load_state_dict(ema.state_dict())  # before INIT: applied when the model is known
    make_trainer(tmp_path, batches=token_batches(1, 4), max_duration="0ba", algorithms=[restored])
    for name, average in ema.averages.items():
        assert torch.equal(restored.averages[name], average)
    bad = {"averages": {"not.a.param": torch.zeros(1)}}
    with pytest.raises(ValueError, match="EMA does not match the model"):
        restored.load_state_dict(bad)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"half_life": "10ba", "smoothing": 0.9}, "exactly one of"),
        ({"half_life": None}, "exactly one of"),
        ({"half_life": None, "smoothing": 1.0}, r"in \[0, 1\)"),
        ({"half_life": "0ba"}, "positive"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EMA(**kwargs)
