"""The epoch order and its partition (llmfoundry/data/streaming/sampling.py), pure numpy."""

from __future__ import annotations

import numpy as np
import pytest

from llmfoundry.data.streaming import EpochOrder, RankPlan, SpanLayout, World, stream_counts
from llmfoundry.data.streaming.epochs import batch_ids


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


# -- canonical nodes: spans of the sequence, one per canonical node -------------------------

# Two streams, 8 + 3 shards; stream 1 up-sampled 100 / 69 (one copy plus a seeded subset).
MIXED = [[37] * 7 + [11], [23] * 3]
MIXED_COUNTS = [270, 100]


def canonical_order(canonical: int, global_batch: int, sizes=MIXED, counts=MIXED_COUNTS, block=16):
    shard_sizes = [np.asarray(s) for s in sizes]
    return EpochOrder(shard_sizes, counts, 3, 0, True, block, canonical, global_batch)


def shard_of(ids: np.ndarray, sizes=MIXED) -> np.ndarray:
    ends = np.cumsum(np.concatenate([np.asarray(s) for s in sizes]))
    return np.searchsorted(ends, ids, side="right")


def run_positions(
    epoch_size: int, start: int, nodes: int, per_node: int, batch: int, layout=None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(what all ranks read step by step, concatenated in rank order; what each node reads)."""
    world = nodes * per_node
    plans = [
        RankPlan(epoch_size, start, world, r, batch, nodes=nodes, layout_batch=layout)
        for r in range(world)
    ]
    assert len({p.num_batches for p in plans}) == 1, "ranks disagree on the number of batches"
    batches = [[p.positions(k) for k in range(p.num_batches)] for p in plans]
    empty = np.array([], np.int64)
    steps = [np.concatenate([b[k] for b in batches]) for k in range(plans[0].num_batches)]
    by_node = [
        np.concatenate(
            [x for b in batches[n * per_node : (n + 1) * per_node] for x in b] or [empty]
        )
        for n in range(nodes)
    ]
    return (np.concatenate(steps) if steps else empty), by_node


def real(positions: np.ndarray, epoch_size: int) -> np.ndarray:
    return positions[positions < epoch_size]


# (nodes, ranks per node, batch per rank): all with a global batch of 24
LAYOUTS_24 = [(1, 1, 24), (1, 4, 6), (2, 3, 4), (3, 2, 4), (4, 6, 1), (6, 2, 2), (12, 2, 1)]


@pytest.mark.parametrize("canonical", [2, 6, 12])
@pytest.mark.parametrize("counts", [MIXED_COUNTS, [150, 40]])  # up-sampled, down-sampled
def test_every_sample_once_and_one_order_on_every_node_count_dividing_c(canonical, counts):
    order = canonical_order(canonical, 24, counts=counts)
    n = len(order)
    assert n == sum(counts)
    one_sequence = np.sort(canonical_order(1, 24, counts=counts).ids(np.arange(n)))
    reference = None
    for nodes, per_node, batch in LAYOUTS_24:
        if canonical % nodes:
            continue
        seq, _ = run_positions(n, 0, nodes, per_node, batch)
        assert np.array_equal(real(seq, n), np.arange(n))  # every position once, in order
        assert len(seq) - n == (-n) % (nodes * per_node)  # fewer repeats than ranks
        ids = order.ids(real(seq, n))
        # the same samples as the one-sequence epoch: the mix's copies and subset, nothing else
        assert np.array_equal(np.sort(ids), one_sequence)
        if reference is None:
            reference = ids
        assert np.array_equal(ids, reference), (nodes, per_node, batch)


def test_a_global_batch_that_c_does_not_divide_splits_each_step_by_floor():
    order = canonical_order(4, 6)  # 4 spans take 1, 2, 1, 2 samples of each step of 6
    n = len(order)
    reference = None
    for nodes, per_node, batch in [(2, 1, 3), (1, 2, 3), (1, 1, 6), (2, 3, 1)]:
        seq, by_node = run_positions(n, 0, nodes, per_node, batch)
        assert np.array_equal(real(seq, n), np.arange(n))
        if nodes == 2:  # node 0: spans 0 and 1, node 1: spans 2 and 3
            spans = [set(order.layout.locate(p % n)[0].tolist()) for p in by_node]
            assert spans == [{0, 1}, {2, 3}]
        ids = order.ids(real(seq, n))
        reference = ids if reference is None else reference
        assert np.array_equal(ids, reference)


@pytest.mark.parametrize("nodes, per_node, batch", [(8, 2, 2), (4, 2, 4), (2, 3, 5), (1, 4, 8)])
def test_each_node_reads_only_its_own_spans(nodes, per_node, batch):
    canonical = 8
    # every sample once (copies of a shard are separate units, which may land in two spans)
    order = canonical_order(canonical, nodes * per_node * batch, counts=[270, 69])
    n = len(order)
    _, by_node = run_positions(n, 0, nodes, per_node, batch)
    shard_sets = []
    for node, positions in enumerate(by_node):
        span, _ = order.layout.locate(positions % n)  # repeats included
        group = canonical // nodes
        assert set(span.tolist()) <= set(range(node * group, (node + 1) * group))
        shard_sets.append(set(shard_of(order.ids(positions)).tolist()))
    # a node's shards are its spans' shards: only a shard a cut falls into has two readers
    assert sum(map(len, shard_sets)) <= 11 + canonical - 1
    assert set().union(*shard_sets) == set(range(11))


def test_a_node_needs_a_few_shards_at_a_time_within_its_span():
    sizes = [[10] * 40]
    order = canonical_order(4, 16, sizes=sizes, counts=[400], block=20)
    spans = order.layout.span_starts
    assert np.array_equal(np.diff(spans), [100] * 4)
    for span in range(4):
        # the span's sequence positions p * 16 + c * 4 + (0..3): read in steps of 4 samples
        positions = (np.arange(100) // 4) * 16 + span * 4 + np.arange(100) % 4
        assert np.array_equal(order.layout.locate(positions)[0], [span] * 100)
        shards = shard_of(order.ids(positions), sizes)
        for first in range(0, 100, 20):  # a block of 20 samples touches at most 3 shards
            assert len(set(shards[first : first + 20].tolist())) <= 3
        assert not np.all(np.diff(order.ids(positions)[:20]) == 1)  # and is shuffled


@pytest.mark.parametrize("start", [0, 24, 72, 13, 367, 370])
def test_resumption_on_another_node_count_continues_the_same_order(start):
    order = canonical_order(12, 24)
    n = len(order)
    full = order.ids(np.arange(n))
    for nodes, per_node, batch in [(4, 3, 2), (3, 2, 4), (12, 1, 2), (1, 1, 24), (6, 4, 1)]:
        seq, _ = run_positions(n, start, nodes, per_node, batch)
        assert np.array_equal(order.ids(real(seq, n)), full[start:])
        assert len(seq) - (n - start) == (-(n - start)) % (nodes * per_node)


def test_resumption_with_another_global_batch_finishes_in_the_recorded_layout():
    order = canonical_order(4, 16)  # the epoch started with global batches of 16
    n = len(order)
    full = order.ids(np.arange(n))
    seq, _ = run_positions(n, 48, 2, 3, 4, layout=16)  # resumed with 24 per step
    assert np.array_equal(order.ids(real(seq, n)), full[48:])


def test_4096_ranks_read_one_order_on_every_node_count():
    sizes = [[37] * 300 + [11]]
    n = 37 * 300 + 11
    order = canonical_order(512, 4096, sizes=sizes, counts=[n], block=64)
    reference = None
    for nodes, per_node in [(512, 8), (256, 16), (64, 64)]:
        seq, by_node = run_positions(n, 0, nodes, per_node, 1)
        assert np.array_equal(real(seq, n), np.arange(n))
        ids = order.ids(real(seq, n))
        if reference is None:
            assert np.array_equal(np.sort(ids), np.arange(n))
            reference = ids
            pairs = sum(len(set(shard_of(order.ids(p), sizes).tolist())) for p in by_node)
            assert pairs <= 301 + 512 - 1  # each of the 511 cuts adds at most one reader
        assert np.array_equal(ids, reference)


@pytest.mark.parametrize("shards", [300, 1000])
def test_32_nodes_fetch_each_shard_about_once(shards):
    sizes = [[12] * (shards - 1) + [5]]  # data_prep's shards: equal, but for the last
    n = 12 * (shards - 1) + 5
    order = canonical_order(32, 32 * 8 * 2, sizes=sizes, counts=[n], block=64)
    _, by_node = run_positions(n, 0, 32, 8, 2)
    pairs = sum(len(set(shard_of(order.ids(p), sizes).tolist())) for p in by_node)
    assert pairs <= shards + 31  # was 32 * shards: every node read every shard
    assert pairs / shards <= {300: 1.104, 1000: 1.031}[shards]


def test_one_canonical_node_is_the_order_and_partition_from_before():
    # Recorded with the partition before canonical nodes (git f6f2a44): two streams, the
    # second up-sampled by a subset, resumed after 5 samples on 3 ranks x 2.
    before = [15, 17, 18, 16, 16, 18, 0, 17, 3, 4, 1, 2, 21, 19, 22, 20, 12, 23, 13, 24, 6, 5]
    before += [14, 7, 8, 9, 10, 11]
    spans_before = [
        [(5, 2), (11, 2), (17, 2), (23, 2)],
        [(7, 2), (13, 2), (19, 2), (25, 2)],
        [(9, 2), (15, 2), (21, 2), (27, 2)],
    ]
    for global_batch in (1, 6, 7, 100):
        order = EpochOrder([np.array([5, 7, 3]), np.array([4, 6])], [15, 13], 3, 1, True, 4,
                           1, global_batch)  # fmt: skip
        assert order.ids(np.arange(28)).tolist() == before
    plans = [RankPlan(28, 5, 3, r, 2) for r in range(3)]
    assert [[p.span(k) for k in range(p.num_batches)] for p in plans] == spans_before
    assert [[p.positions(k).tolist() for k in range(4)] for p in plans][2][3] == [27, 28]


def test_span_layout_cuts_nearly_equal_spans_and_maps_positions_onto_them():
    for n, c, g in [(370, 12, 24), (370, 5, 24), (10, 8, 3), (3, 8, 16), (100, 1, 7)]:
        layout = SpanLayout(n, c, g)
        lengths = np.diff(layout.span_starts)
        assert lengths.sum() == n and lengths.max() - lengths.min() <= n // g + 1
        span, offset = layout.locate(np.arange(n))
        # a bijection onto the spans' positions, each span read front to back
        flat = layout.span_starts[span] + offset
        assert np.array_equal(np.sort(flat), np.arange(n))
        for s in range(c):
            assert np.array_equal(offset[span == s], np.arange(lengths[s]))
            assert np.array_equal(
                layout.position(s, np.arange(lengths[s])), np.flatnonzero(span == s)
            )
    assert np.array_equal(SpanLayout(50, 1, 7).locate(np.arange(50))[1], np.arange(50))
    with pytest.raises(ValueError, match="must be positive"):
        SpanLayout(10, 0, 4)


def test_the_last_step_on_several_nodes_pads_each_node_from_its_own_samples():
    # 370 samples on 4 nodes x 3 ranks, 2 per step: 31 per rank, so 15 full steps of 24, then
    # one per rank: 10 real positions for 12 slots.
    n, nodes, per_node, batch = 370, 4, 3, 2
    plans = [RankPlan(n, 0, 12, r, batch, nodes=nodes) for r in range(12)]
    last = [p.positions(p.num_batches - 1) for p in plans]
    by_node = [np.concatenate(last[k * per_node : (k + 1) * per_node]) for k in range(nodes)]
    assert [real(x, n).tolist() for x in by_node] == [
        [360, 361], [362, 363, 364], [365, 366], [367, 368, 369]
    ]  # fmt: skip
    # the repeats are the node's own last samples, in shards it has just read
    assert [(x[x >= n] - n).tolist() for x in by_node] == [[361], [], [366], []]
    with pytest.raises(ValueError, match="use positions"):
        plans[0].span(plans[0].num_batches - 1)
    with pytest.raises(ValueError, match="12 ranks cannot be split over 5 nodes"):
        RankPlan(n, 0, 12, 0, 2, nodes=5)


@pytest.mark.parametrize("n", [1, 3, 5, 9])
def test_epochs_smaller_than_a_step_still_read_every_sample_once(n):
    # 4 nodes x 2 ranks: some nodes have no sample of their own and repeat the epoch's first
    for start in range(n + 1):
        seq, _ = run_positions(n, start, 4, 2, 1)
        assert np.array_equal(real(seq, n), np.arange(start, n))
        assert len(seq) - (n - start) == (-(n - start)) % 8


def test_workers_restore_a_multi_node_ranks_batches():
    order = canonical_order(4, 12)
    plan = RankPlan(len(order), 0, 6, 5, 2, nodes=2)
    expected = [plan.positions(k).tolist() for k in range(plan.num_batches)]
    for workers in (1, 2, 3):
        per_worker = [
            [p.tolist() for _, p in batch_ids(order.ids, plan, World(5, 6, 2, 3, w, workers))]
            for w in range(workers)
        ]
        interleaved = []
        for i in range(max(len(p) for p in per_worker)):
            interleaved += [p[i] for p in per_worker if i < len(p)]
        assert interleaved == expected
