"""The sample order of an epoch and its partition over nodes, ranks and workers (pure numpy).

Global order (one epoch), a function of (seed, epoch, streams, epoch size, shuffle, block size,
canonical nodes ``C``, global batch ``G``) only, never of the number of nodes or ranks, so a run
can resume on another world size:

1. Stream mix (:func:`stream_counts`). Stream ``k`` with ``n_k`` samples contributes ``c_k``
   samples: ``c_k // n_k`` whole copies of every sample, plus a seeded random subset of
   ``c_k % n_k`` samples (a different subset each epoch). That covers up-sampling
   (``repeat=2.5``), down-sampling (``choose=1000``) and mixing by ``proportion``.
2. Units. Every (stream, shard, copy) with at least one chosen sample is a *unit*: a run of
   sample ids that live in one shard. Whole copies of a shard are separate units, so the
   repeats of a sample land far apart in the epoch instead of next to each other.
3. Shard shuffle. The units are permuted with ``rng(seed, epoch)`` and concatenated: a
   *sequence* of ``L`` sample ids in which neighbours share a shard.
4. Spans (:class:`SpanLayout`). The sequence is cut into ``C`` contiguous spans, one per
   canonical node, of nearly equal length: with ``K = L // G`` full steps and a tail of
   ``t = L % G`` samples, span ``c`` holds ``K * m_c + t_c`` samples, where
   ``m_c = floor((c+1) G / C) - floor(c G / C)`` is the canonical node's share of a step and
   ``t_c`` the same split of ``t``. A node reading span ``c`` needs only the shards in it, plus
   the one a cut falls into, which the neighbouring span reads as well: at most ``C - 1``
   shards per epoch are fetched twice (at most ``(S + C - 1) / S`` of an ``S``-shard dataset: 1.031
   at 1,000 shards on 32 nodes, 1.103 at 300). Cutting at shard boundaries instead would leave the
   spans uneven by up to a shard, which the node that runs out first would have to make up
   with another node's samples (the same shard fetched twice) or with repeats.
5. Block shuffle. Each span is cut into blocks of ``block_size`` samples from its start and
   each block is permuted with its own ``rng(seed, epoch, block)`` (blocks numbered across the
   spans). A block covers about ``block_size / samples_per_shard + 1`` shards, so at any moment
   a reader needs only those few shards (I/O locality, a small cache), yet their samples are
   fully mixed. Blocks are made lazily, one at a time: memory is O(block_size + units), never
   O(L).
6. Interleaving. Global position ``p`` is offset ``o = p % G`` of step ``b = p // G``. In a
   full step (``b < K``) it belongs to the canonical node ``c`` with
   ``floor(c G / C) <= o < floor((c+1) G / C)`` and reads that span at
   ``b * m_c + o - floor(c G / C)``; in the tail step likewise with ``t`` for ``G``. So every
   global batch is the concatenation over ``c = 0 .. C-1`` of each span's next ``m_c``
   samples. With ``C = 1`` the global order is the sequence itself, whatever ``G``.

Without shuffling the sequence is the streams' samples in storage order (copies, then the
subset), still cut into spans and interleaved.

Partition (:class:`RankPlan`). ``W`` ranks on ``N`` nodes, ``R = W / N`` consecutive ranks per
node; node ``n`` holds the canonical nodes ``n C / N ... (n+1) C / N - 1`` (``N`` divides
``C``, or ``C = 1``: epochs.py refuses other node counts). A run that has consumed ``start``
samples of the epoch continues with global positions ``start, start+1, ...``; the remaining
``L - start`` positions are padded with repeats to ``T = ceil((L - start) / W) * W`` (fewer
than ``W`` repeats, none dropped) and every rank gets ``T / W`` samples, in batches of ``B``.
Step ``k`` is positions ``start + k*G ... start + (k+1)*G - 1`` (``G = B * W``) and rank ``r``
takes the ``r``-th slice of ``B`` of it: node ``n``'s part, offsets ``[n G / N, (n+1) G / N)``,
is exactly its canonical nodes' chunks (``floor((n C / N) G / C) = n G / N``), so a node reads
only its own spans. The last step, with ``t'`` real positions and ``v`` samples per rank, is
split by node: node ``n`` takes the real positions ``[floor(n t' / N), floor((n+1) t' / N))``
of it (its canonical nodes' tail chunks), fills the rest of its ``R * v`` slots by repeating
its own last samples of the epoch (in shards it has just read), and its ranks split that in
order. On one node, and with ``C = 1`` on any number (every node then reads every shard), the
ranks split the last step as one node and the repeats wrap around to the epoch's first
positions.

Hence the concatenation over ranks of each step's batches, without the repeats, is exactly the
global order whatever ``N`` and ``R`` are, and a state saved after ``s`` samples resumes the
identical remaining order on any node count dividing ``C`` with any number of ranks per node;
each node stays within its spans whenever ``s`` is a whole number of steps (the trainer saves
between steps). The global order depends on ``G``: a resumption with another global batch
finishes the epoch in the layout the state recorded (exact, but nodes then read across span
boundaries until the next epoch). DataLoader worker ``w`` of ``K`` takes its rank's batches
``w, w+K, w+2K, ...``; PyTorch collects workers' batches round-robin, which restores the rank's
batch order exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from llmfoundry.utils.errors import UserError

__all__ = ["EpochOrder", "RankPlan", "SpanLayout", "stream_counts"]

# Distinct first words of the seed sequences, so no two random draws ever share a stream.
_SHARD_SHUFFLE, _SUBSET, _BLOCK_SHUFFLE = 0, 1, 2


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(list(words)))


def _apportion(total: int, weights: np.ndarray) -> np.ndarray:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder, stable)."""
    exact = weights / weights.sum() * total
    counts = np.floor(exact).astype(np.int64)
    rest = int(total - counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:rest]] += 1
    return counts


def stream_counts(
    sizes: Sequence[int],
    proportion: Sequence[float | None],
    repeat: Sequence[float | None],
    choose: Sequence[int | None],
    epoch_size: int | None = None,
) -> np.ndarray:
    """How many samples each stream contributes to one epoch.

    Either every stream has a ``proportion`` (of ``epoch_size``, default: all streams' samples)
    or none has; otherwise a stream contributes ``choose`` samples, ``round(repeat * size)``, or
    all its samples, and a given ``epoch_size`` rescales those counts to sum to it.
    """
    sizes_arr = np.asarray(sizes, dtype=np.int64)
    if len(sizes_arr) == 0:
        raise ValueError("no streams given")
    if np.any(sizes_arr <= 0):
        empty = [i for i, n in enumerate(sizes) if n <= 0]
        raise UserError(f"stream(s) {empty} have no samples; remove them or write data to them")
    if epoch_size is not None and (isinstance(epoch_size, bool) or epoch_size <= 0):
        raise UserError(f"epoch_size must be a positive integer, got {epoch_size!r}")
    with_prop = [p is not None for p in proportion]
    if any(with_prop):
        if not all(with_prop):
            raise UserError(
                "either every stream sets a proportion or none does; streams "
                f"{[i for i, p in enumerate(with_prop) if not p]} have none"
            )
        bad = [i for i, (r, c) in enumerate(zip(repeat, choose, strict=True)) if r or c]
        if bad:
            raise UserError(f"stream(s) {bad} set proportion with repeat/choose; pick one")
        total = int(epoch_size) if epoch_size is not None else int(sizes_arr.sum())
        return _apportion(total, np.asarray(proportion, dtype=np.float64))
    counts = np.array(
        [
            c if c is not None else (round(r * n) if r is not None else n)
            for n, r, c in zip(sizes, repeat, choose, strict=True)
        ],
        dtype=np.int64,
    )
    if counts.sum() <= 0:
        raise UserError(f"the streams contribute no samples per epoch (counts {counts.tolist()})")
    if epoch_size is not None:
        counts = _apportion(int(epoch_size), counts.astype(np.float64))
    return counts


class EpochOrder:
    """Global sample order of one epoch: position ``0 <= p < len(self)`` -> sample id.

    Sample ids number all shards of all streams consecutively (stream 0's shards first).

    Args:
        shard_sizes: per stream, the number of samples in each of its shards.
        counts: per stream, samples it contributes this epoch (:func:`stream_counts`).
        seed, epoch: the randomness; equal arguments give an equal order on every machine.
        shuffle: shuffle shards and blocks; otherwise storage order.
        block_size: samples per shuffle block (I/O locality vs mixing).
        canonical_nodes, global_batch: the spans and their interleaving (:class:`SpanLayout`);
            one canonical node is the plain sequence, whatever the global batch.
    """

    def __init__(
        self,
        shard_sizes: Sequence[Sequence[int]],
        counts: Sequence[int],
        seed: int,
        epoch: int,
        shuffle: bool,
        block_size: int,
        canonical_nodes: int = 1,
        global_batch: int = 1,
    ) -> None:
        if block_size <= 0:
            raise UserError(f"shuffle_block_size must be positive, got {block_size}")
        if seed < 0 or epoch < 0:
            raise UserError(f"seed and epoch must be non-negative, got {seed}, {epoch}")
        self.seed, self.epoch, self.shuffle, self.block_size = seed, epoch, shuffle, block_size
        units: list[tuple[int, int] | np.ndarray] = []  # (first id, length) or explicit ids
        base = 0
        for k, (sizes, count) in enumerate(zip(shard_sizes, counts, strict=True)):
            sizes = np.asarray(sizes, dtype=np.int64)
            starts = base + np.concatenate([[0], np.cumsum(sizes)[:-1]])
            n = int(sizes.sum())
            whole, part = divmod(int(count), n)
            for _ in range(whole):
                units.extend((int(s), int(z)) for s, z in zip(starts, sizes, strict=True) if z)
            if part:
                subset = np.sort(_rng(_SUBSET, seed, epoch, k).choice(n, part, replace=False))
                subset += base
                cuts = np.searchsorted(subset, starts[1:])
                units.extend(piece for piece in np.split(subset, cuts) if len(piece))
            base += n
        if shuffle:
            perm = _rng(_SHARD_SHUFFLE, seed, epoch).permutation(len(units))
            units = [units[i] for i in perm]
        self._units = units
        lengths = np.array([u[1] if isinstance(u, tuple) else len(u) for u in units], np.int64)
        self._ends = np.cumsum(lengths)
        self._starts = self._ends - lengths
        self._len = int(self._ends[-1]) if len(units) else 0
        self.layout = SpanLayout(self._len, canonical_nodes, global_batch)
        spans = self.layout.span_starts
        # Blocks are numbered across the spans: span c's j-th block is block _first_block[c] + j.
        self._first_block = np.concatenate([[0], np.cumsum(-(-np.diff(spans) // block_size))])
        # Per span, its last two blocks: each reader moves forward through the spans it reads.
        self._blocks: dict[int, OrderedDict[int, np.ndarray]] = {}

    def __len__(self) -> int:
        return self._len

    def _block(self, span: int, b: int) -> np.ndarray:
        """Sample ids of block ``b`` of ``span`` (sequence positions [lo, lo + block_size) of
        the span, cut at the span's end), shuffled."""
        recent = self._blocks.setdefault(span, OrderedDict())
        cached = recent.get(b)
        if cached is not None:
            recent.move_to_end(b)
            return cached
        spans = self.layout.span_starts
        lo = int(spans[span]) + (b - int(self._first_block[span])) * self.block_size
        hi = min(lo + self.block_size, int(spans[span + 1]))
        pieces = []
        i = int(np.searchsorted(self._ends, lo, side="right"))
        while i < len(self._units) and self._starts[i] < hi:
            unit, unit_lo = self._units[i], int(self._starts[i])
            a, z = max(lo, unit_lo) - unit_lo, min(hi, int(self._ends[i])) - unit_lo
            pieces.append(
                np.arange(unit[0] + a, unit[0] + z, dtype=np.int64)
                if isinstance(unit, tuple)
                else unit[a:z]
            )
            i += 1
        ids = np.concatenate(pieces)
        if self.shuffle:
            ids = ids[_rng(_BLOCK_SHUFFLE, self.seed, self.epoch, b).permutation(len(ids))]
        recent[b] = ids
        if len(recent) > 2:  # readers move forward; the previous block suffices
            recent.popitem(last=False)
        return ids

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """Sample ids at global ``positions`` (taken modulo the epoch length: padding repeats
        the sample at ``position - len(self)``)."""
        if self._len == 0:
            raise ValueError("the epoch is empty")
        span, offset = self.layout.locate(np.asarray(positions, dtype=np.int64) % self._len)
        blocks = self._first_block[span] + offset // self.block_size
        within = offset % self.block_size
        out = np.empty_like(offset)
        # Positions come in long consecutive runs: deduplicating the runs' blocks first makes
        # np.unique sort a handful of values instead of every position.
        for b in np.unique(blocks[np.diff(blocks, prepend=-1) != 0]):
            mask = blocks == b
            out[mask] = self._block(int(span[mask][0]), int(b))[within[mask]]
        return out


@dataclass(frozen=True)
class SpanLayout:
    """Where each global position of an epoch reads in the sample sequence (module docstring).

    Args:
        epoch_size: samples in the epoch.
        canonical_nodes: ``C``, the number of spans.
        global_batch: ``G``, samples per step over all ranks, which the spans take turns in.
    """

    epoch_size: int
    canonical_nodes: int
    global_batch: int

    def __post_init__(self) -> None:
        if self.canonical_nodes < 1 or self.global_batch < 1:
            raise UserError(
                f"canonical_nodes ({self.canonical_nodes}) and the global batch "
                f"({self.global_batch}) must be positive"
            )

    @cached_property
    def _cuts(self) -> tuple[int, int, np.ndarray, np.ndarray]:
        """(full steps K, tail t, chunk starts within a step, chunk starts within the tail)."""
        full, tail = divmod(self.epoch_size, self.global_batch)
        c = np.arange(self.canonical_nodes + 1, dtype=np.int64)
        step = c * self.global_batch // self.canonical_nodes
        return full, tail, step, c * tail // self.canonical_nodes

    @cached_property
    def span_starts(self) -> np.ndarray:
        """The ``C + 1`` sequence positions where the spans start (the last: the epoch's end)."""
        full, _, step, tail = self._cuts
        return full * step + tail

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global positions (``< epoch_size``) -> (span, offset within the span)."""
        full, _, step, tail = self._cuts
        positions = np.asarray(positions, dtype=np.int64)
        batch, within = np.divmod(positions, self.global_batch)
        in_tail = batch >= full
        within = np.where(in_tail, positions - full * self.global_batch, within)
        span = np.where(
            in_tail,
            np.searchsorted(tail, within, side="right") - 1,
            np.searchsorted(step, within, side="right") - 1,
        )
        chunk = step[span + 1] - step[span]
        offset = np.where(
            in_tail,
            full * chunk + within - tail[span],
            batch * chunk + within - step[span],
        )
        return span, offset

    def position(self, span: int, offsets: np.ndarray) -> np.ndarray:
        """The inverse of :meth:`locate`: global positions of ``offsets`` within ``span``."""
        full, _, step, tail = self._cuts
        offsets = np.asarray(offsets, dtype=np.int64)
        chunk = int(step[span + 1] - step[span])
        batch, within = np.divmod(offsets, max(chunk, 1))
        return np.where(
            offsets < full * chunk,
            batch * self.global_batch + step[span] + within,
            full * self.global_batch + tail[span] + offsets - full * chunk,
        )


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of the epoch after ``start`` samples were consumed (module docstring).

    Args:
        epoch_size: samples in the epoch (``len(EpochOrder)``).
        start: global samples already consumed in this epoch (all ranks together).
        world_size, rank: the ranks sharing the epoch.
        batch_size: samples per rank per step (the DataLoader's batch size).
        nodes: machines the ranks are on, ``world_size / nodes`` consecutive ranks each; the
            last step is split by node so that each node reads its own spans' samples. 1: the
            ranks split it as one machine.
        layout_batch: the global batch the epoch's spans are laid out with (default
            ``batch_size * world_size``): it says which samples are a node's own to repeat.
    """

    epoch_size: int
    start: int
    world_size: int
    rank: int
    batch_size: int
    nodes: int = 1
    layout_batch: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.start < 0:
            raise ValueError(f"samples consumed must be >= 0, got {self.start}")
        if self.nodes < 1 or self.world_size % self.nodes:
            raise UserError(f"{self.world_size} ranks cannot be split over {self.nodes} nodes")

    @cached_property  # span() needs it for every batch
    def num_samples(self) -> int:
        """Samples this rank reads: ``ceil(remaining / world_size)``, equal on every rank."""
        remaining = max(self.epoch_size - self.start, 0)
        return -(-remaining // self.world_size)

    @cached_property
    def num_batches(self) -> int:
        """Batches this rank reads; all but possibly the last have ``batch_size`` samples."""
        return -(-self.num_samples // self.batch_size)

    def _check(self, k: int) -> None:
        if not 0 <= k < self.num_batches:
            raise IndexError(f"batch {k} out of range for {self.num_batches} batches")

    def span(self, k: int) -> tuple[int, int]:
        """Rank batch ``k`` as (first global position, length), for batches whose positions
        are consecutive: all of them on one node; on several, all but the last."""
        self._check(k)
        if self.nodes > 1 and k == self.num_batches - 1:
            raise ValueError("the last batch on several nodes may have two runs; use positions()")
        full = self.num_samples // self.batch_size
        step = self.batch_size * self.world_size
        if k < full:
            return self.start + k * step + self.rank * self.batch_size, self.batch_size
        tail = self.num_samples - full * self.batch_size
        return self.start + full * step + self.rank * tail, tail

    def positions(self, k: int) -> np.ndarray:
        """Global positions of rank batch ``k``; ``epoch_size + q`` repeats position ``q``."""
        self._check(k)
        if self.nodes == 1 or k < self.num_batches - 1:
            first, length = self.span(k)
            return np.arange(first, first + length, dtype=np.int64)
        # The last step: node n reads its floor-share of the step's real positions, then
        # repeats its own last samples of the epoch (still in its cache) to fill its slots.
        size = self.num_samples - k * self.batch_size  # this rank's samples in the last step
        step_start = self.start + k * self.batch_size * self.world_size
        real = self.epoch_size - step_start
        per_node = self.world_size // self.nodes
        node, local = divmod(self.rank, per_node)
        lo, hi = node * real // self.nodes, (node + 1) * real // self.nodes
        slots = np.arange(local * size, (local + 1) * size, dtype=np.int64)
        pad = slots >= hi - lo
        out = step_start + lo + slots
        out[pad] = self.epoch_size + self._last_own(node, slots[pad] - (hi - lo))
        return out

    def _last_own(self, node: int, i: np.ndarray) -> np.ndarray:
        """Global positions of node ``node``'s ``i``-th last samples of the epoch (cyclically;
        0: its last); a node with none: the epoch's first. A node's samples are the span of a
        layout with one span per node (its canonical nodes' spans together)."""
        layout = SpanLayout(
            self.epoch_size, self.nodes, self.layout_batch or self.batch_size * self.world_size
        )
        owned = int(layout.span_starts[node + 1] - layout.span_starts[node])
        if owned == 0:
            return i % max(self.epoch_size, 1)
        return layout.position(node, owned - 1 - i % owned)

    def worker_batches(self, worker: int, num_workers: int) -> range:
        """The rank batches DataLoader worker ``worker`` of ``num_workers`` produces, in order."""
        if not 0 <= worker < num_workers:
            raise ValueError(f"worker {worker} is outside {num_workers} workers")
        return range(worker, self.num_batches, num_workers)
