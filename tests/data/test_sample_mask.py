"""Evaluation batches mark repeated samples (sample_mask), so eval metrics count each sample once
on any number of ranks (epochs.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from llmfoundry.data import StreamingTextDataset
from llmfoundry.data.streaming import EpochDataset, StreamingDataLoader
from tests.data.test_streaming_text import token_rows, write_tokens

SAMPLES = 10


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_tokens(tmp_path / "mds" / "val", token_rows(SAMPLES, start=500))
    return tmp_path / "mds"


def masked_union(make, world_size: int) -> tuple[Counter, int]:
    """First token of every unmasked row over all ranks, and how many rows were read."""
    kept, read = Counter(), 0
    for rank in range(world_size):
        for batch in StreamingDataLoader(make((rank, world_size))):
            mask = batch["sample_mask"]
            assert mask.dtype == torch.bool and mask.shape == (len(batch["input_ids"]),)
            kept.update(batch["input_ids"][mask, 0].tolist())
            read += len(mask)
    return kept, read


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_eval_sample_counts_once_on_any_world_size(root: Path, world_size: int):
    def make(data_parallel):
        return StreamingTextDataset(
            str(root), split="val", batch_size=3, evaluation=True, data_parallel=data_parallel
        )

    kept, read = masked_union(make, world_size)
    assert kept == Counter(token_rows(SAMPLES, start=500)[:, 0].tolist())  # each exactly once
    assert read == -(-SAMPLES // world_size) * world_size  # ranks read equal, padded shares


def test_training_batches_carry_no_mask(root: Path):
    dataset = StreamingTextDataset(str(root), split="val", batch_size=4, shuffle=True)
    assert all("sample_mask" not in batch for batch in StreamingDataLoader(dataset))


def test_per_sample_eval_iteration_carries_the_mask(root: Path):
    """Iterated sample by sample (no batch_size), an eval dataset marks repeats as its batches
    do: the same samples and 0-d bool masks as EpochDataset's rows of batches (MemmapTokens')."""
    kept, read = Counter(), 0
    for rank in range(3):
        dataset = StreamingTextDataset(str(root), split="val", evaluation=True,
                                       data_parallel=(rank, 3))  # fmt: skip
        samples = list(dataset)
        rows = list(EpochDataset.__iter__(dataset))
        assert len(samples) == len(rows) and all(
            torch.equal(s[k], r[k])
            for s, r in zip(samples, rows, strict=True)
            for k in ("input_ids", "sample_mask")
        )
        for sample in samples:
            mask = sample["sample_mask"]
            assert mask.dtype == torch.bool and mask.shape == ()
            kept.update([int(sample["input_ids"][0])] if mask else [])
            read += 1
    assert kept == Counter(token_rows(SAMPLES, start=500)[:, 0].tolist()) and read == 12
