import functools

import pytest
import torch

from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Algorithm, Callback, Event, LoggerDestination, Trainer

from .conftest import tiny_model, token_batches


class Recorder(Algorithm):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def match(self, event, state):
        return event in (Event.BEFORE_FORWARD, Event.AFTER_FORWARD)

    def apply(self, event, state, logger):
        self.log.append((self.name, event.value))


class EventLog(Callback):
    def __init__(self, log, name="callback"):
        self.log, self.name = log, name

    def run_event(self, event, state, logger):
        self.log.append((self.name, event.value))


class LogDestination(LoggerDestination):
    def __init__(self, log):
        self.log = log

    def run_event(self, event, state, logger):
        self.log.append(("logger", event.value))


def make_trainer(tmp_path, log, **kwargs):
    return Trainer(
        model=tiny_model(),
        train_dataloader=token_batches(2, 4),
        eval_dataloaders={"val": token_batches(1, 4, seed=1)},
        max_duration="2ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-3),
        run_dir=tmp_path,
        **kwargs,
    )


def test_order_algorithms_callbacks_loggers_and_reverse_after(tmp_path):
    log = []
    trainer = make_trainer(
        tmp_path,
        log,
        algorithms=[Recorder("a1", log), Recorder("a2", log)],
        callbacks=[EventLog(log)],
        loggers=[LogDestination(log)],
    )
    log.clear()
    trainer.engine.run_event(Event.BEFORE_FORWARD)
    trainer.engine.run_event(Event.AFTER_FORWARD)
    assert log == [
        ("a1", "before_forward"),
        ("a2", "before_forward"),
        ("callback", "before_forward"),
        ("logger", "before_forward"),
        ("a2", "after_forward"),
        ("a1", "after_forward"),
        ("callback", "after_forward"),
        ("logger", "after_forward"),
    ]


def test_fit_fires_events_in_documented_order(tmp_path):
    log = []
    trainer = make_trainer(tmp_path, log, callbacks=[EventLog(log)], eval_interval="2ba")
    trainer.fit()
    events = [event for _, event in log]
    train_batch = [
        "before_dataloader",
        "after_dataloader",
        "batch_start",
        "before_train_batch",
        "before_forward",
        "after_forward",
        "before_loss",
        "after_loss",
        "before_backward",
        "after_backward",
        "after_train_batch",
        "batch_end",
        "batch_checkpoint",
    ]
    evaluation = [
        "eval_before_all",
        "eval_start",
        "eval_batch_start",
        "eval_before_forward",
        "eval_after_forward",
        "eval_batch_end",
        "eval_end",
        "eval_after_all",
    ]
    # max_duration (2ba) is reached on the epoch's last batch: evaluation (every 2ba) runs
    # after it, then the epoch closes without asking the dataloader for more.
    expected = (
        ["init", "fit_start", "epoch_start"]
        + train_batch * 2
        + evaluation
        + ["epoch_end", "epoch_checkpoint", "fit_end"]
    )
    assert events == expected
    assert set(Event) <= {*map(Event, events), Event.BEFORE_LOAD, Event.AFTER_LOAD}


def test_after_event_property():
    assert Event.AFTER_LOSS.is_after and Event.EVAL_AFTER_FORWARD.is_after
    assert not Event.BATCH_END.is_after and not Event.BEFORE_LOSS.is_after
    assert torch.is_tensor(torch.zeros(1))


def test_a_misspelt_event_method_is_an_error_at_construction(tmp_path):
    class Typo(Callback):
        def batch_ended(self, state, logger):
            raise AssertionError("never called")

    class Fine(Callback):
        def batch_end(self, state, logger):
            pass

        def _helper(self, state, logger):
            pass

        def summary(self, text):  # not handler-shaped: allowed
            return text

        def save(self, state, logger):  # handler-shaped but nothing like an event: allowed
            pass

    make = functools.partial(make_trainer, tmp_path, None)
    make(callbacks=[Fine()])
    with pytest.raises(ValueError, match=r"Typo.batch_ended.*did you mean 'batch_end'"):
        make(callbacks=[Typo()])

    class BadDestination(LoggerDestination):
        def fit_ended(self, state, logger):
            pass

    with pytest.raises(ValueError, match=r"BadDestination.fit_ended.*did you mean 'fit_end'"):
        make(loggers=[BadDestination()])

    class Unknown(Callback):
        def before_optimizer_step(self, state, logger):
            pass

    with pytest.raises(ValueError, match=r"Unknown.before_optimizer_step.*matches no event"):
        make(callbacks=[Unknown()])
