"""The epoch order and its partition (llmfoundry/data/streaming/sampling.py), pure numpy."""

from __future__ import annotations

import numpy as np
import pytest

from llmfoundry.data.streaming import EpochOrder, RankPlan, stream_counts


def order_of(shard_sizes, counts=None, seed=3, epoch=0, shuffle=True, block=16) -> np.ndarray:
    shard_sizes = [np.asarray(s) for s in shard_sizes]
    counts = counts if counts is not None else [int(s.sum()) for s in shard_sizes]
    order = EpochOrder(shard_sizes, counts, seed, epoch, shuffle, block)
    return order.ids(np.arange(len(order)))


def rank_stream(plan: RankPlan, order: np.ndarray) -> list[np.ndarray]:
    """The rank's batches as sample ids (positions wrap around, as the padding does)."""
    out = []
    for k in range(plan.num_batches):
        first, n = plan.span(k)
        out.append(order[np.arange(first, first + n) % len(order)])
    return out


def global_sequence(epoch_size, start, world, batch, order) -> np.ndarray:
    """What all ranks read, step by step, concatenated in rank order within each step."""
    plans = [RankPlan(epoch_size, start, world, r, batch) for r in range(world)]
    streams = [rank_stream(p, order) for p in plans]
    assert len({len(s) for s in streams}) == 1, "ranks disagree on the number of batches"
    steps = [np.concatenate([s[k] for s in streams]) for k in range(len(streams[0]))]
    return np.concatenate(steps) if steps else np.array([], np.int64)


def test_order_is_a_deterministic_permutation_that_changes_per_epoch_and_seed():
    sizes = [[10, 10, 7], [5, 9]]
    a = order_of(sizes)
    assert sorted(a.tolist()) == list(range(41))
    assert np.array_equal(a, order_of(sizes))
    assert not np.array_equal(a, order_of(sizes, epoch=1))
    assert not np.array_equal(a, order_of(sizes, seed=4))


def test_unshuffled_order_is_storage_order():
    assert order_of([[3, 4], [2]], shuffle=False).tolist() == list(range(9))


def test_shuffle_keeps_io_locality_within_blocks():
    sizes = [[10] * 30]  # 30 shards of 10 samples, blocks of 20 samples
    order = order_of(sizes, block=20)
    shard_of = order // 10
    for start in range(0, 300, 20):
        # a block of 20 consecutive samples (after the shard shuffle) straddles at most 3 shards
        assert len(set(shard_of[start : start + 20].tolist())) <= 3
    # and within a block the samples really are mixed, not left in storage order
    assert not all(np.all(np.diff(order[s : s + 20]) == 1) for s in range(0, 300, 20))
    # the shard order itself is shuffled
    first_shards = [int(shard_of[s]) for s in range(0, 300, 20)]
    assert first_shards != sorted(first_shards)


def test_upsampling_takes_whole_copies_plus_a_seeded_subset():
    order = order_of([[4, 6]], counts=[25])  # 2.5 copies of 10 samples
    counts = np.bincount(order, minlength=10)
    assert len(order) == 25 and set(counts.tolist()) == {2, 3} and counts.sum() == 25
    assert (counts == 3).sum() == 5
    other = np.bincount(order_of([[4, 6]], counts=[25], epoch=1), minlength=10)
    assert not np.array_equal(counts, other)  # a different extra subset each epoch


def test_downsampling_picks_distinct_samples():
    order = order_of([[50, 50]], counts=[30])
    assert len(order) == 30 and len(set(order.tolist())) == 30


def test_stream_counts_rules():
    assert stream_counts([10, 30], [None, None], [None, None], [None, None]).tolist() == [10, 30]
    assert stream_counts([10, 30], [None, None], [2.0, 0.5], [None, 7]).tolist() == [20, 7]
    assert stream_counts([10, 30], [1, 3], [None] * 2, [None] * 2, epoch_size=100).tolist() == [
        25,
        75,
    ]
    # proportions default to the total number of samples; rounding still sums exactly
    counts = stream_counts([10, 30, 3], [1, 1, 1], [None] * 3, [None] * 3)
    assert counts.sum() == 43 and max(counts) - min(counts) <= 1
    # epoch_size rescales repeat/choose counts
    assert stream_counts([10, 30], [None] * 2, [None] * 2, [None] * 2, 20).tolist() == [5, 15]
    with pytest.raises(ValueError, match="every stream sets a proportion or none"):
        stream_counts([10, 30], [1, None], [None] * 2, [None] * 2)
    with pytest.raises(ValueError, match="no samples"):
        stream_counts([10, 0], [None] * 2, [None] * 2, [None] * 2)
    with pytest.raises(ValueError, match="epoch_size"):
        stream_counts([10], [None], [None], [None], epoch_size=0)


@pytest.mark.parametrize("n, world, batch", [(103, 4, 3), (100, 8, 4), (7, 3, 5), (5, 8, 2)])
def test_no_divisibility_needed_and_padding_is_minimal(n, world, batch):
    order = order_of([[n]], block=8)
    plans = [RankPlan(n, 0, world, r, batch) for r in range(world)]
    per_rank = [sum(len(b) for b in rank_stream(p, order)) for p in plans]
    assert len(set(per_rank)) == 1 and per_rank[0] == -(-n // world)  # equal, ceil(n / world)
    seen = global_sequence(n, 0, world, batch, order)
    assert set(seen.tolist()) == set(range(n))  # nothing dropped
    assert len(seen) - n == (-n) % world  # fewer than `world` repeats
    assert np.array_equal(seen[:n], order)  # and the global order is the single-rank order


def test_union_over_ranks_is_the_single_rank_order():
    order = order_of([[13, 20, 7]], block=6)
    single = global_sequence(40, 0, 1, 8, order)
    for world, batch in [(2, 4), (4, 2), (8, 1), (3, 5)]:
        assert np.array_equal(global_sequence(40, 0, world, batch, order)[:40], single)


@pytest.mark.parametrize("start", [0, 1, 17, 39, 40, 41, 63])
def test_elastic_resumption_continues_the_same_global_order(start):
    n = 64
    order = order_of([[10] * 6 + [4]], block=12)
    # a run with 4 ranks x 2 consumed `start` samples; a new run on 2 ranks x 4, or on 3 ranks
    for world, batch in [(4, 2), (2, 4), (3, 3), (1, 8)]:
        rest = global_sequence(n, start, world, batch, order)
        remaining = max(n - start, 0)
        assert np.array_equal(rest[:remaining], order[start:])
        assert len(rest) - remaining == (-remaining) % world  # only the documented padding


def test_workers_split_a_rank_by_batch_and_round_robin_restores_it():
    plan = RankPlan(50, 0, 2, 1, 4)
    batches = list(range(plan.num_batches))
    for workers in (1, 2, 3, 5):
        per_worker = [list(plan.worker_batches(w, workers)) for w in range(workers)]
        interleaved = []
        for i in range(max(len(p) for p in per_worker)):
            interleaved += [p[i] for p in per_worker if i < len(p)]
        assert interleaved == batches


def test_rank_plan_validation():
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        RankPlan(10, 0, 2, 2, 1)
    with pytest.raises(ValueError, match="batch_size"):
        RankPlan(10, 0, 2, 0, 0)
    with pytest.raises(ValueError, match="worker 3 is outside 3 workers"):
        RankPlan(10, 0, 1, 0, 1).worker_batches(3, 3)
    assert RankPlan(10, 12, 2, 0, 4).num_batches == 0  # resumed past the end: nothing left


def test_orders_are_lazy_over_blocks_for_big_epochs():
    sizes = [np.full(2_000, 50_000)]  # 100M samples: never materialised
    order = EpochOrder(sizes, [100_000_000], seed=1, epoch=0, shuffle=True, block_size=1 << 16)
    ids = order.ids(np.arange(99_999_000, 99_999_100))
    assert len(set(ids.tolist())) == 100 and ids.max() < 100_000_000
