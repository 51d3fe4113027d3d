"""Small real models and in-memory data for trainer tests."""

from __future__ import annotations

import pytest
import torch

from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM


def tiny_model(vocab_size: int = 64, seq_len: int = 16, **overrides) -> MPTForCausalLM:
    """On meta, so the Trainer initializes it after seeding: two trainers get the same weights.

    `overrides` are further MPTConfig fields (e.g. dropout).
    """
    config = MPTConfig(
        d_model=32,
        n_heads=2,
        n_layers=2,
        max_seq_len=seq_len,
        vocab_size=vocab_size,
        init_device="meta",
        **overrides,
    )
    return MPTForCausalLM(config)


def token_batches(
    n_batches: int, batch_size: int, seq_len: int = 16, vocab: int = 64, seed: int = 0
):
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n_batches):
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


@pytest.fixture
def batches():
    return token_batches(4, 4)
