"""Exact resumption on the real data pipeline (MDS shards, StreamingTextDataset, loader).

Train 14 batches straight; train to batch k, stop, resume in a fresh trainer from the saved
checkpoint, train on: every step's loss is bitwise identical and every step reads the same
samples, so none is seen twice or skipped. The run has everything that could break it: dropout
(global torch RNG), an algorithm with its own generator, AdamW state, a warmup-cosine schedule,
a shuffled dataset over three epochs (6 batches each), and evaluation right after a checkpoint.
"""

import functools

import pytest
import torch

from llmfoundry.algorithms import RandomTokenReplacement
from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.data import StreamingTextDataset
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.optim import CosineWithWarmup, DecoupledAdamW
from llmfoundry.trainer import Callback, Trainer

from . import helpers
from .helpers import SEQ_LEN, VOCAB, StepRecorder

BATCHES, EPOCH_SAMPLES, BATCH_SIZE = 14, 24, 4


@pytest.fixture(scope="module")
def mds(tmp_path_factory):
    return helpers.write_mds(tmp_path_factory.mktemp("mds"), {"train": EPOCH_SAMPLES, "val": 8})


class StopAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def batch_end(self, state, logger):
        state.stop_training = state.stop_training or state.timestamp.batch == self.batch


def run(tmp_path, mds, folder, *, callbacks=(), save_interval=None, composer_lag=False, **kwargs):
    def loader(split: str, **kwargs) -> StreamingDataLoader:
        return StreamingDataLoader(
            StreamingTextDataset(
                str(mds), split=split, batch_size=BATCH_SIZE, max_seq_len=SEQ_LEN, **kwargs
            )
        )

    recorder = StepRecorder()
    trainer = Trainer(
        model=helpers.model(dropout=0.1),
        train_dataloader=loader("train", shuffle=True, shuffle_seed=5, shuffle_block_size=8),
        eval_dataloaders={"val": loader("val", evaluation=True)},
        eval_interval="4ba",
        max_duration=f"{BATCHES}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=3e-3, weight_decay=1e-2),
        scheduler=CosineWithWarmup(t_warmup="3ba", alpha_f=0.1, composer_lag=composer_lag),
        algorithms=[RandomTokenReplacement(probability=0.1, vocab_size=VOCAB, seed=1)],
        callbacks=[recorder, *callbacks, CheckpointSaver(str(folder), save_interval)],
        run_dir=tmp_path,
        **kwargs,
    )
    trainer.fit()
    return recorder.steps, trainer.state


@pytest.fixture(scope="module")
def straight(tmp_path_factory, mds):
    tmp_path = tmp_path_factory.mktemp("straight")
    return (*run(tmp_path, mds, tmp_path / "ckpt", save_interval="1ep"), tmp_path / "ckpt")


def assert_same_weights(a, b):
    for (name, x), (_, y) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name


def test_straight_run_reads_each_sample_once_per_epoch(straight):
    steps, state, _ = straight
    assert [s["batch"] for s in steps] == list(range(1, BATCHES + 1))
    epochs = [sum((s["ids"] for s in steps[i : i + 6]), []) for i in (0, 6)]
    for ids in epochs:
        assert sorted(ids) == list(range(EPOCH_SAMPLES))
    assert epochs[0] != epochs[1]  # set_epoch reached the dataset: a new shuffle each epoch
    assert state.timestamp.epoch == 2 and state.timestamp.batch_in_epoch == 2


@pytest.mark.parametrize(
    "stop_at",
    [
        3,  # mid-epoch
        6,  # after the epoch's last batch, before it rolls over
        8,  # mid-epoch 1, with an evaluation right after the checkpoint
    ],
)
def test_stop_and_resume_is_bitwise_identical(tmp_path, mds, straight, stop_at):
    expected, final, _ = straight
    folder = tmp_path / "ckpt"
    first, _ = run(tmp_path, mds, folder, callbacks=[StopAt(stop_at)])
    assert len(first) == stop_at
    second, state = run(tmp_path, mds, folder, load_path=str(folder))
    assert first + second == expected  # same batches, same sample ids, same loss bits
    assert_same_weights(state, final)


def test_resume_from_an_epoch_end_checkpoint(tmp_path, mds, straight):
    """Checkpoints taken at EPOCH_CHECKPOINT (the epoch already rolled over) resume exactly."""
    expected, final, folder = straight
    steps, state = run(tmp_path, mds, tmp_path / "ckpt", load_path=str(folder / "ep1-ba6"))
    assert steps == expected[6:]
    assert_same_weights(state, final)


def test_unrestored_rng_would_show(tmp_path, mds, straight):
    """Guard for the tests above: without the RNG states, dropout makes the losses differ."""
    expected, _, _ = straight
    folder = tmp_path / "ckpt"
    run(tmp_path, mds, folder, callbacks=[StopAt(3)])
    second, _ = run(tmp_path, mds, folder, load_path=str(folder), load_ignore_keys=["rng"])
    assert [s["ids"] for s in second] == [s["ids"] for s in expected[3:]]
    assert [s["loss"] for s in second] != [s["loss"] for s in expected[3:]]


def test_resume_with_composers_lr_timing_is_bitwise_identical(tmp_path, mds, straight):
    """scheduler.composer_lag (the lr one batch behind, as Composer) is a function of the
    saved timestamp too: stopped at an epoch's end and resumed, the run equals a straight one."""
    expected, _, _ = straight
    lagged, final = run(tmp_path / "straight", mds, tmp_path / "unused", composer_lag=True)
    assert [s["loss"] for s in lagged][3:] != [s["loss"] for s in expected][3:]  # it is on
    folder = tmp_path / "ckpt"
    first, _ = run(tmp_path, mds, folder, callbacks=[StopAt(6)], composer_lag=True)
    second, state = run(tmp_path, mds, folder, load_path=str(folder), composer_lag=True)
    assert first + second == lagged
    assert_same_weights(state, final)
