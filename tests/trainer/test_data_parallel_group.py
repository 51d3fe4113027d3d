"""The trainer counts, reduces and weights over the data-parallel group, not the world.

`TwoDevicesOneBatch` is one process standing in for a mesh of two processes that form one
data-parallel rank (a tensor-parallel pair: both read the same batch). A sum over the world
doubles a count (the peer holds the same one); a sum over the data-parallel group leaves it.
Training through it must count, lose and step exactly as one device does.
"""

import functools

import pytest
import torch

from llmfoundry.callbacks import NaNDetector
from llmfoundry.distributed import SingleDevice
from llmfoundry.trainer import Callback, Trainer

from .conftest import tiny_model, token_batches

_DP_GROUP = object()


class TwoDevicesOneBatch(SingleDevice):
    world_size = 2
    dp_size = 1
    dp_group = _DP_GROUP

    def __init__(self) -> None:
        super().__init__("cpu")
        self.reduced: list[tuple[str, int]] = []  # (group, elements) of each all_reduce_sum

    def all_reduce_sum(self, tensor, group=None):
        self.reduced.append(("dp" if group is _DP_GROUP else "world", tensor.numel()))
        return tensor if group is _DP_GROUP else tensor.mul_(2)


def fit(tmp_path, strategy, **kwargs):
    batches = token_batches(3, 4, seed=5)
    trainer = Trainer(
        model=tiny_model(),
        strategy=strategy,
        train_dataloader=batches,
        eval_dataloaders={"v": token_batches(1, 4, seed=6)},
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=tmp_path,
        **kwargs,
    )
    return trainer.fit()


def test_counts_losses_and_weights_use_the_data_parallel_group(tmp_path):
    one = fit(tmp_path / "one", SingleDevice("cpu"), device_train_microbatch_size=2)
    strategy = TwoDevicesOneBatch()
    two = fit(tmp_path / "two", strategy, device_train_microbatch_size=2)
    assert (two.timestamp.sample, two.timestamp.token) == (one.timestamp.sample, 3 * 4 * 16)
    assert (two.dp_size, two.world_size) == (1, 2)
    assert two.train_loss == pytest.approx(one.train_loss, rel=1e-6)  # same steps, same weights
    assert two.eval_metrics == pytest.approx(one.eval_metrics, rel=1e-6)
    # Only the preemption flag is agreed over the world; counts, losses and eval totals are not.
    assert {r for r in strategy.reduced if r[0] == "world"} == {("world", 1)}
    assert ("dp", 4) in strategy.reduced  # samples, tokens, flag, loss tokens


class NaNAtSecondBatch(Callback):
    def after_loss(self, state, logger):
        if state.timestamp.batch == 1:
            state.loss = state.loss * float("nan")


def test_nan_detector_names_the_samples_of_the_data_parallel_ranks(tmp_path):
    callbacks = [NaNAtSecondBatch(), NaNDetector(check_every=1)]
    with pytest.raises(FloatingPointError, match=r"at batch 2 .* samples 4 to 7 of the run"):
        fit(tmp_path, TwoDevicesOneBatch(), callbacks=callbacks)
