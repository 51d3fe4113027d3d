"""Learning-rate schedules: shape, warmups in any Time unit, their configs, and the trainer."""

import functools
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
