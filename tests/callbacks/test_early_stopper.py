import copy
import logging

import pytest

from llmfoundry.callbacks import EarlyStopper
from llmfoundry.loggers import ConsoleLogger
from llmfoundry.trainer import Timestamp
from tests.trainer.conftest import token_batches

from .conftest import make_trainer


def run(tmp_path, stopper, n_batches=10, lr=0.05, **kwargs):
    """Train on the same 4 batches over and over, evaluating on them after every batch: the
    eval loss falls steadily with lr > 0 and stays exactly flat with lr = 0."""
    data = token_batches(4, 4)
    kwargs.setdefault("eval_interval", "1ba")
    trainer = make_trainer(
        tmp_path,
        lr=lr,
        train_dataloader=data,
        max_duration=f"{n_batches}ba",
        eval_dataloaders={"val": copy.deepcopy(data)},
        callbacks=[stopper],
        **kwargs,
    )
    return trainer.fit()


def test_improving_metric_never_stops(tmp_path):
    state = run(tmp_path, EarlyStopper(monitor="eval/val/loss", patience="2ba"))
    assert state.timestamp.batch == 10
    assert not state.stop_training


@pytest.mark.parametrize("patience", ["3ba", "192tok", "12sp", "0.3dur"])
def test_stops_when_patience_runs_out_in_any_unit(tmp_path, caplog, patience):
    caplog.set_level(logging.INFO, logger="llmfoundry")
    # min_delta larger than any change: the first eval (batch 1) stays the best, and 3 batches
    # (= 192 tokens = 12 samples = 0.3 of 10 batches) later the run stops.
    stopper = EarlyStopper(monitor="eval/val/loss", min_delta=100.0, patience=patience)
    state = run(tmp_path, stopper)
    assert state.stop_training
    assert state.timestamp.batch == 4
    assert stopper.best_timestamp.batch == 1
    out = caplog.text
    assert "early stopping after batch 4: eval/val/loss" in out
    assert f"best {stopper.best:.6g} at batch 1" in out


def test_flat_metric_stops(tmp_path):
    state = run(tmp_path, EarlyStopper(monitor="eval/val/loss", patience="2ba"), lr=0.0)
    assert state.timestamp.batch == 3


def test_patience_in_epochs(tmp_path):
    # 4 batches per epoch: best at batch 1, one epoch later is batch 5.
    state = run(tmp_path, EarlyStopper(monitor="eval/val/loss", patience="1ep"), lr=0.0)
    assert state.timestamp.batch == 5


def test_max_comparison_wants_the_metric_to_rise(tmp_path):
    # The eval loss falls (see test_improving_metric_never_stops): under "max" that is no
    # improvement, so patience runs out.
    stopper = EarlyStopper(monitor="eval/val/loss", comparison="max", patience="2ba")
    assert run(tmp_path, stopper).timestamp.batch == 3


def test_train_loss_monitor_checks_every_batch(tmp_path):
    data = token_batches(1, 4) * 6  # one batch repeated: with lr 0 the loss is exactly flat
    stopper = EarlyStopper(monitor="loss/train", patience="2ba")
    trainer = make_trainer(
        tmp_path, lr=0.0, train_dataloader=data, max_duration="6ba", callbacks=[stopper]
    )
    assert trainer.fit().timestamp.batch == 3


def test_state_dict_resumes_patience(tmp_path):
    stopper = EarlyStopper(monitor="loss/train", patience="5ba")
    stopper.best = 1.0
    stopper.best_timestamp = Timestamp(batch=3, sample=12, token=192)
    restored = EarlyStopper(monitor="loss/train", patience="5ba")
    restored.load_state_dict(stopper.state_dict())
    assert restored.best == 1.0 and restored.best_timestamp == stopper.best_timestamp
    # Resumed at batch 6 with no improvement: patience (best at 3 + 5) runs out at batch 8.
    trainer = make_trainer(
        tmp_path,
        lr=0.0,
        train_dataloader=token_batches(1, 4) * 10,
        max_duration="10ba",
        callbacks=[restored],
    )
    trainer.state.timestamp = Timestamp(batch=6, sample=24, token=384)
    # The loss of random tokens is far above 1.0, so it never improves on the restored best.
    assert trainer.fit().timestamp.batch == 8


def test_bad_configuration_is_reported_clearly(tmp_path):
    with pytest.raises(ValueError, match="monitor 'loss/train' or an eval metric"):
        EarlyStopper(monitor="val_loss")
    with pytest.raises(ValueError, match="'min' .* or 'max'"):
        EarlyStopper(comparison="lowest")
    with pytest.raises(ValueError, match="min_delta"):
        EarlyStopper(min_delta=-1.0)
    with pytest.raises(ValueError, match="cannot parse time"):
        EarlyStopper(patience="soon")
    with pytest.raises(ValueError, match="eval sets are: val; monitor one of them"):
        run(tmp_path, EarlyStopper(monitor="eval/test/loss"))
    with pytest.raises(
        ValueError, match=r"not an eval metric of this run \(available: eval/val/accuracy"
    ):
        run(tmp_path, EarlyStopper(monitor="eval/val/bleu"))


@pytest.mark.parametrize("monitor", ["eval/val/loss", "loss/train"])
def test_stop_message_follows_the_metrics_it_refers_to(tmp_path, caplog, monitor):
    caplog.set_level(logging.INFO, logger="llmfoundry")
    stopper = EarlyStopper(monitor=monitor, min_delta=100.0, patience="2ba")
    state = run(tmp_path, stopper, loggers=[ConsoleLogger(log_interval="1ba")])
    assert state.timestamp.batch == 3
    lines = caplog.messages
    stop = next(i for i, line in enumerate(lines) if line.startswith("early stopping"))
    metrics = "[eval @ batch 3]" if monitor.startswith("eval/") else "[batch 3]"
    shown = next(i for i, line in enumerate(lines) if line.startswith(metrics))
    assert shown < stop, lines
