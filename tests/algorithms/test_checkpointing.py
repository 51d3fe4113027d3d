"""Algorithm state (EMA averages, spike window, noise generator) survives a checkpoint."""

import torch

from llmfoundry.algorithms import EMA, LossSpikeGuard, RandomTokenReplacement
from llmfoundry.checkpoint.state_dict import load_checkpoint, save_checkpoint

from .helpers import make_trainer


def algorithms():
    return [
        EMA(half_life="2ba"),
        LossSpikeGuard(window=4, min_history=2),
        RandomTokenReplacement(0.1, 64),
    ]


def test_algorithm_state_round_trips_through_a_checkpoint(tmp_path):
    trained = make_trainer(tmp_path / "a", algorithms=algorithms())
    trained.fit()
    path = save_checkpoint(str(tmp_path / "ckpt"), trained.state, trained.logger)
    fresh = make_trainer(tmp_path / "b", algorithms=algorithms())
    load_checkpoint(path, fresh.state, fresh.logger)
    ema, guard, noise = trained.state.algorithms
    ema2, guard2, noise2 = fresh.state.algorithms
    for name, average in ema.averages.items():
        assert torch.equal(ema2.averages[name], average), name
    assert list(guard2.history) == list(guard.history) and len(guard.history) == 4
    assert torch.equal(noise2.generator.get_state(), noise.generator.get_state())
