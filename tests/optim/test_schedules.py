"""Learning-rate schedules: shape, warmups in any Time unit, their configs, and the trainer."""

import functools
import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from llmfoundry.optim import (
    ConstantWithWarmup,
    CosineWithWarmup,
    DecoupledAdamW,
    InverseSqrtWithWarmup,
    LinearWithWarmup,
)
from llmfoundry.trainer import Callback, State, Time, Trainer
from tests.trainer.conftest import tiny_model, token_batches

CONF = Path(__file__).resolve().parents[2] / "conf"


def at(schedule, max_duration="100ba", **counters):
    state = State(
        model=None,
        optimizer=None,
        scheduler=None,
        max_duration=Time.parse(max_duration),
        run_dir=Path("."),
        device=torch.device("cpu"),
    )
    for key, value in counters.items():
        setattr(state.timestamp, key, value)
    return schedule(state)


def test_linear_and_cosine_end_at_alpha_f():
    linear = LinearWithWarmup(t_warmup="10ba", alpha_f=0.2)
    assert at(linear, batch=10) == pytest.approx(1.0)
    assert at(linear, batch=55) == pytest.approx(0.6)
    assert at(linear, batch=100) == pytest.approx(0.2)
    cosine = CosineWithWarmup(t_warmup="0ba", alpha_f=0.0)
    assert at(cosine, batch=0) == pytest.approx(1.0)
    assert at(cosine, batch=25) == pytest.approx(0.5 * (1 + 2**-0.5))
    assert at(cosine, batch=100) == pytest.approx(0.0, abs=1e-12)


def test_warmup_in_tokens_with_duration_in_batches():
    # 100 batches of 1000 tokens; warmup over the first 20000 tokens (20 batches).
    schedule = LinearWithWarmup(t_warmup="20000tok", alpha_f=0.0)
    assert at(schedule, batch=5, token=5000) == pytest.approx(0.25)
    assert at(schedule, batch=20, token=20000) == pytest.approx(1.0)
    assert at(schedule, batch=60, token=60000) == pytest.approx(0.5)


def test_inverse_sqrt_is_continuous_and_floored():
    schedule = InverseSqrtWithWarmup(t_warmup="25ba", alpha_f=0.2)
    assert at(schedule, batch=24) == pytest.approx(24 / 25)
    assert at(schedule, batch=25) == pytest.approx(1.0)
    assert at(schedule, batch=100) == pytest.approx(0.5)
    assert at(schedule, batch=100, max_duration="10000ba") == pytest.approx(0.5)
    assert at(InverseSqrtWithWarmup(t_warmup="1ba", alpha_f=0.2), batch=100) == pytest.approx(0.2)


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: CosineWithWarmup(alpha_f=1.5), "alpha_f must be in"),
        (lambda: InverseSqrtWithWarmup(t_warmup="0ba"), "must be non-zero"),
        (lambda: ConstantWithWarmup(t_warmup="ten"), "cannot parse time"),
    ],
)
def test_bad_schedule_settings(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize(
    "name,cls",
    [
        ("constant_with_warmup", ConstantWithWarmup),
        ("linear_with_warmup", LinearWithWarmup),
        ("cosine_with_warmup", CosineWithWarmup),
        ("inverse_sqrt_with_warmup", InverseSqrtWithWarmup),
    ],
)
def test_every_scheduler_config_builds_its_schedule(name, cls):
    node = OmegaConf.load(CONF / "scheduler" / f"{name}.yaml")
    schedule = instantiate(node)
    assert type(schedule) is cls
    assert schedule.t_warmup == Time.parse(node.t_warmup)
    assert 0.0 <= at(schedule, batch=1) <= 1.0


def test_trainer_follows_a_token_warmup_then_decay(tmp_path):
    seen = []

    class LR(Callback):
        def batch_end(self, state, logger):
            seen.append(state.optimizer.param_groups[0]["lr"])

    # 32 tokens per batch: warmup over 64 tokens = 2 batches, then linear decay to 0 at 6 batches.
    Trainer(
        model=tiny_model(),
        train_dataloader=token_batches(6, 2),
        max_duration="6ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1.0),
        run_dir=tmp_path,
        scheduler=LinearWithWarmup(t_warmup="64tok"),
        callbacks=[LR()],
    ).fit()
    # The lr of each step is set from the time before that step.
    assert seen == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])


def test_warmup_then_cosine_midpoint_and_warmup_as_fraction_of_run():
    cosine = CosineWithWarmup(t_warmup="10ba", alpha_f=0.1)
    assert at(cosine, batch=0) == 0.0
    assert at(cosine, batch=5) == pytest.approx(0.5)
    assert at(cosine, batch=10) == pytest.approx(1.0)
    assert at(cosine, batch=55) == pytest.approx(0.1 + 0.9 * 0.5)
    assert at(cosine, batch=100) == pytest.approx(0.1)
    assert at(LinearWithWarmup(t_warmup="0ba", alpha_f=0.0), batch=25) == pytest.approx(0.75)
    assert at(ConstantWithWarmup(t_warmup="4ba"), batch=2) == pytest.approx(0.5)
    assert at(ConstantWithWarmup(t_warmup="4ba"), batch=50) == 1.0
    assert at(InverseSqrtWithWarmup(t_warmup="10ba"), batch=40) == pytest.approx(0.5)
    # warmup given as a fraction of the run
    assert at(CosineWithWarmup(t_warmup="0.1dur", alpha_f=0.0), batch=5) == pytest.approx(0.5)
    assert at(CosineWithWarmup(t_warmup="0.1dur", alpha_f=0.0), batch=55) == pytest.approx(0.5)


def _composer_lrs(decay):
    """Composer's lr of batches 1..8 (t_warmup 2ba, 8 batches) by hand: its scheduler steps after
    each batch, before its timestamp counts it, so batch k trains at t = max(k - 2, 0) batches:
    warmup 0, 0, 1/2; then the decay at 0/6 .. 4/6 of the 6 post-warmup batches."""
    return [0.0, 0.0, 0.5] + [decay(done / 6) for done in range(5)]


def _cosine(x):
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x))


def _linear(x):
    return 1.0 - 0.9 * x


@pytest.mark.parametrize(
    ("cls", "decay", "t_warmup", "max_duration", "per_epoch"),
    [
        (CosineWithWarmup, _cosine, "2ba", "8ba", 8),
        (LinearWithWarmup, _linear, "2ba", "8ba", 8),
        # 32 tokens and 2 samples a batch; a run of 2 epochs of 4 batches (the lag crosses the
        # epoch end); warmup as a fraction of the run.
        (CosineWithWarmup, _cosine, "64tok", "8ba", 8),
        (LinearWithWarmup, _linear, "4sp", "2ep", 4),
        (CosineWithWarmup, _cosine, "0.25dur", "256tok", 8),
    ],
)
def test_composer_lag_gives_composers_lr_sequence(
    tmp_path, cls, decay, t_warmup, max_duration, per_epoch
):
    """With composer_lag the trainer sets Composer's lr at every batch (batches 1 and 2 both at
    t=0, the warmup's end a batch later), in any unit; without it, one batch ahead."""
    seen = {True: [], False: []}
    for lag in seen:

        class LR(Callback):
            def batch_end(self, state, logger, lrs=seen[lag]):
                lrs.append(state.optimizer.param_groups[0]["lr"])

        Trainer(
            model=tiny_model(),
            train_dataloader=token_batches(per_epoch, 2),
            max_duration=max_duration,
            optimizer=functools.partial(DecoupledAdamW, lr=1.0),
            run_dir=tmp_path / str(lag),
            scheduler=cls(t_warmup=t_warmup, alpha_f=0.1, composer_lag=lag),
            callbacks=[LR()],
        ).fit()
    composer = _composer_lrs(decay)
    assert seen[True] == pytest.approx(composer, abs=1e-12)
    assert seen[False] == pytest.approx(composer[1:] + [decay(5 / 6)], abs=1e-12)


def test_composer_lag_rounds_a_fractional_warmup_down_as_composer_does():
    """Composer converts t_warmup=0.3dur of an 8ba run to int(2.4) = 2ba: its batch 4 (t = 2
    batches with the lag) is past warmup, where a 2.4ba warmup would still be at 2/2.4."""
    assert at(CosineWithWarmup("0.3dur", alpha_f=0.1), "8ba", batch=2) == pytest.approx(2 / 2.4)
    composer = CosineWithWarmup("0.3dur", alpha_f=0.1, composer_lag=True)
    assert at(composer, "8ba", batch=3) == pytest.approx(1.0)
    assert at(composer, "8ba", batch=2) == pytest.approx(0.5)
    assert at(composer, "80tok", batch=3, token=30) == pytest.approx(20 / 24)  # int(24.0) tok
