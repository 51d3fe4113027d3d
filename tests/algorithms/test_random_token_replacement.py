import pytest
import torch

from llmfoundry.algorithms import RandomTokenReplacement
from llmfoundry.trainer import Event
from tests.trainer.conftest import token_batches

from .helpers import At, Metrics, make_trainer


def trained_batches(tmp_path, algorithm, batches):
    seen, metrics = [], Metrics()
    make_trainer(
        tmp_path,
        batches=batches,
        loggers=[metrics],
        algorithms=[algorithm, At(Event.BEFORE_TRAIN_BATCH, lambda s: seen.append(dict(s.batch)))],
    ).fit()
    return seen, metrics


def test_replaces_inputs_not_labels(tmp_path):
    originals = token_batches(3, 8, vocab=64)
    seen, metrics = trained_batches(
        tmp_path,
        RandomTokenReplacement(probability=0.25, vocab_size=64, seed=1),
        [dict(b) for b in originals],
    )
    changed = [
        (s["input_ids"] != o["input_ids"]).float().mean().item()
        for s, o in zip(seen, originals, strict=True)
    ]
    # A replaced token can draw its own id back (1 in 64), so slightly under the probability.
    assert all(0.15 < fraction < 0.35 for fraction in changed)
    for batch, original in zip(seen, originals, strict=True):
        assert torch.equal(batch["labels"], original["labels"])
        assert batch["input_ids"].max() < 64
    assert metrics.values("algorithms/replaced_fraction") == pytest.approx([0.25] * 3, abs=0.1)


def test_same_seed_same_noise_and_ranks_differ(tmp_path):
    first, _ = trained_batches(
        tmp_path, RandomTokenReplacement(0.5, 64, seed=3), token_batches(1, 8)
    )
    again, _ = trained_batches(
        tmp_path, RandomTokenReplacement(0.5, 64, seed=3), token_batches(1, 8)
    )
    assert torch.equal(first[0]["input_ids"], again[0]["input_ids"])
    rank0, rank1 = RandomTokenReplacement(0.5, 64, seed=3), RandomTokenReplacement(0.5, 64, seed=3)
    trainer = make_trainer(tmp_path, algorithms=[rank0])
    trainer.state.rank = 1
    rank1.apply(Event.INIT, trainer.state, trainer.logger)
    assert not torch.equal(rank0.generator.get_state(), rank1.generator.get_state())


def test_probability_zero_changes_nothing_and_bad_settings(tmp_path):
    originals = token_batches(1, 4)
    seen, _ = trained_batches(
        tmp_path, RandomTokenReplacement(0.0, 64), [dict(b) for b in originals]
    )
    assert torch.equal(seen[0]["input_ids"], originals[0]["input_ids"])
    with pytest.raises(ValueError, match="probability"):
        RandomTokenReplacement(probability=1.5)
    with pytest.raises(ValueError, match="vocab_size"):
        RandomTokenReplacement(vocab_size=0)
