import logging

import pytest
import torch

from llmfoundry.algorithms import LossSpikeGuard
from llmfoundry.trainer import Callback, Event
from tests.trainer.conftest import token_batches

from .helpers import At, Metrics, make_trainer


def spike_at(batches, factor=50.0):
    """Scale the logits of the chosen batches: a real, large loss (and large gradients)."""

    def scale(state):
        if state.timestamp.batch in batches:
            state.outputs = state.outputs * factor

    return At(Event.BEFORE_LOSS, scale)


class StepChanges(Callback):
    """Whether each batch's optimizer step changed the weights."""

    def __init__(self):
        self.changed, self._before = [], None

    def batch_start(self, state, logger):
        self._before = [p.detach().clone() for p in state.model.parameters()]

    def batch_end(self, state, logger):
        after = list(state.model.parameters())
        self.changed.append(
            any(not torch.equal(a, b) for a, b in zip(after, self._before, strict=True))
        )


def guard(**kwargs):
    kwargs = {"window": 10, "min_history": 3, "num_std": 3.0, "min_ratio": 1.5, **kwargs}
    return LossSpikeGuard(**kwargs)


def test_a_spike_is_skipped_and_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="llmfoundry")
    changes, metrics, spike_guard = StepChanges(), Metrics(), guard()
    state = make_trainer(
        tmp_path,
        batches=token_batches(6, 4),
        algorithms=[spike_guard, spike_at({4})],
        callbacks=[changes],
        loggers=[metrics],
    ).fit()
    assert changes.changed == [True, True, True, True, False, True]
    assert metrics.values("algorithms/loss_spike_skipped") == [1.0]
    assert metrics.values("algorithms/loss_spike")[0] > 3 * max(spike_guard.history)
    assert len(spike_guard.history) == 5 and spike_guard.consecutive == 0
    assert "loss spike at batch 4" in caplog.text
    assert state.timestamp.batch == 6  # the skipped batch still counts


def test_no_judging_until_the_window_has_history(tmp_path):
    changes = StepChanges()
    make_trainer(
        tmp_path,
        batches=token_batches(3, 4),
        algorithms=[guard(), spike_at({1})],
        callbacks=[changes],
    ).fit()
    assert changes.changed == [True, True, True]


def test_non_finite_loss_is_always_skipped(tmp_path):
    changes = StepChanges()
    make_trainer(
        tmp_path,
        batches=token_batches(2, 4),
        algorithms=[guard(), spike_at({0}, factor=float("nan"))],
        callbacks=[changes],
    ).fit()
    assert changes.changed == [False, True]


def test_consecutive_spikes_stop_the_run(tmp_path):
    trainer = make_trainer(
        tmp_path,
        batches=token_batches(8, 4),
        algorithms=[guard(max_consecutive=2), spike_at({4, 5})],
    )
    with pytest.raises(RuntimeError, match="spiked 2 batches in a row .* diverging run"):
        trainer.fit()
    assert trainer.state.timestamp.batch == 5


def test_state_dict_round_trip():
    a = guard()
    a.history.extend([3.0, 2.9, 2.8])
    a.consecutive = 1
    b = guard()
    b.load_state_dict(a.state_dict())
    assert list(b.history) == [3.0, 2.9, 2.8] and b.consecutive == 1
    assert b.threshold() == pytest.approx(max(2.9 + 3 * 0.1, 1.5 * 2.9))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"min_history": 1}, "min_history"),
        ({"min_history": 20, "window": 10}, "min_history"),
        ({"num_std": 0}, "num_std"),
        ({"min_ratio": 0.9}, "min_ratio"),
        ({"max_consecutive": 0}, "max_consecutive"),
    ],
)
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        guard(**kwargs)
