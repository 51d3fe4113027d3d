"""Evaluation's scores of vocabulary-sharded logits (a tensor-parallel head's DTensor, two gloo
ranks) equal those of the whole logits, without gathering them: each position's loss, and its
prediction taken across the shards, the first index on ties (as argmax of the whole row)."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from llmfoundry.core.loss import next_token_scores

from .spawn import free_port, join_env, run_ranks

WORLD, VOCAB = 2, 16


def logits_and_labels() -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits with, in row 0 of the first sample, a maximum tied across the two halves
    of the vocabulary (columns 3 and 11) and, in row 1, one only in the second half."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, VOCAB, generator=gen)
    logits[0, 0, [3, 11]] = 9.0
    logits[0, 1, 13] = 9.0
    labels = torch.randint(0, VOCAB, (2, 6), generator=gen)
    labels[1, 3] = -100
    return logits, labels


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    join_env(rank, world, port)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (world,))
        logits, labels = logits_and_labels()
        sharded = distribute_tensor(logits, mesh, [Shard(2)])
        losses, predicted = next_token_scores(sharded, labels)
        torch.save({"losses": losses, "predicted": predicted}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_scores_equal_the_whole_logits_scores(tmp_path):
    assert run_ranks(rank_main, WORLD, free_port(), str(tmp_path)) == [0] * WORLD
    logits, labels = logits_and_labels()
    want_losses, want_predicted = next_token_scores(logits, labels)
    assert want_predicted[0, 0] == 3 and want_predicted[0, 1] == 13
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(got["losses"], want_losses)
        assert torch.equal(got["predicted"], want_predicted)
