"""StreamingDataset: MDS shards from object stores or local disk, in a deterministic, elastic order.

- Random access: ``ds[i]`` for ``0 <= i < ds.num_samples`` (sample ids number the shards of
  all streams in order) downloads the sample's shard if it is not local yet.
- Iteration: this rank's and DataLoader worker's share of the epoch, in the global order of
  sampling.py, with shards predownloaded ahead of the reader by a background thread.
- Epochs and resumption: call ``set_epoch(e)`` before iterating epoch ``e``; a checkpoint
  stores ``state_dict(num_samples)`` where ``num_samples`` counts the global samples consumed
  in the current epoch (all ranks together); ``load_state_dict`` makes the next iteration of
  that epoch continue with exactly the remaining global order, on any world size.
- Cache sharing, locking and eviction: cache.py and eviction.py.

Runtime state (open shard readers) is per process and rebuilt after the dataset is copied into
a DataLoader worker, so a dataset object can be built once and handed to any DataLoader.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, default_collate

from llmfoundry.data.mds import is_hash
from llmfoundry.data.streaming.cache import ShardCache
from llmfoundry.data.streaming.checks import check_int
from llmfoundry.data.streaming.eviction import CacheLimiter
from llmfoundry.data.streaming.predownload import Predownloader
from llmfoundry.data.streaming.reader_pool import ShardReaderPool
from llmfoundry.data.streaming.sampling import EpochOrder, RankPlan, stream_counts
from llmfoundry.data.streaming.stream import Stream
from llmfoundry.data.streaming.world import World

__all__ = ["StreamingDataset"]

DEFAULT_BLOCK_SIZE = 1 << 18
_STATE_CHECKED = ("shuffle", "shuffle_seed", "shuffle_block_size", "epoch_size", "num_samples")


class StreamingDataset(IterableDataset):
    """Samples of one or more MDS datasets, streamed from a remote or read locally.

    Args:
        remote: URL (``s3://b/ds``, ``gs://``, ``az://``, ...) or local path of the dataset.
        local: cache folder for ``remote`` (default: a per-remote folder in the temp dir), or
            the dataset folder when ``remote`` is None. See stream.py for the cases.
        split: sub-folder to read (``"train"``); None reads ``remote``/``local`` itself.
        streams: several sources mixed in one epoch (instead of remote/local).
        shuffle: shuffle shards and samples within blocks (sampling.py); else storage order.
        shuffle_seed: the shuffle's seed (non-negative); epoch ``e`` uses (seed, e).
        shuffle_block_size: samples per shuffle block (default 262144): larger mixes more but
            needs more shards local at once.
        batch_size: samples per rank per step, as the DataLoader batches them. Needed for the
            exact global order with DataLoader workers (each worker makes whole batches);
            None hands out single samples.
        epoch_size: samples per epoch over all ranks (up- or down-samples); default: every
            stream's samples once (or as its proportion/repeat/choose says).
        cache_limit: bytes (or ``"10gb"``) of downloaded shards to keep; least recently used
            ones are evicted. Shards without a remote copy are never evicted. It should hold
            the shards of a shuffle block plus the predownload window for every reader sharing
            the cache, or shards are evicted before use and fetched twice.
        predownload: samples to download ahead of the reader (default 8 batches, at least 64).
        validate_hash: check downloads against this hash of index.json (``"xxh64"``, ...).
        keep_zip: keep compressed shards after decompressing them.
        download_retry: download attempts after a failed one (exponential backoff).
        storage_options: fsspec options for the remote (``{"client_kwargs": {...}}``, ...).
        allow_unsafe: allow reading ``pkl`` columns (pickle runs code from the file).
        data_parallel: (rank, size) of this process among the data-parallel readers, from the
            trainer's strategy; default torchrun's RANK and WORLD_SIZE (world.py).
    """

    def __init__(
        self,
        remote: str | None = None,
        local: str | None = None,
        split: str | None = None,
        *,
        streams: Sequence[Stream] | None = None,
        shuffle: bool = False,
        shuffle_seed: int = 9176,
        shuffle_block_size: int | None = None,
        batch_size: int | None = None,
        epoch_size: int | None = None,
        cache_limit: int | str | None = None,
        predownload: int | None = None,
        validate_hash: str | None = None,
        keep_zip: bool = False,
        download_retry: int = 2,
        storage_options: Mapping[str, Any] | None = None,
        allow_unsafe: bool = False,
        data_parallel: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if streams is not None:
            if remote is not None or local is not None:
                raise ValueError("pass either remote/local or streams, not both")
            streams = list(streams)
            if not streams or not all(isinstance(s, Stream) for s in streams):
                raise ValueError("streams must be a non-empty list of Stream objects")
        else:
            if remote is None and local is None:
                raise ValueError(
                    "give remote (a URL like s3://bucket/mds or a local MDS folder) or local"
                )
            streams = [Stream(remote=remote, local=local)]
        check_int("shuffle_seed", shuffle_seed, minimum=0)
        check_int("shuffle_block_size", shuffle_block_size, minimum=1, optional=True)
        check_int("batch_size", batch_size, minimum=1, optional=True)
        check_int("epoch_size", epoch_size, minimum=1, optional=True)
        check_int("predownload", predownload, minimum=0, optional=True)
        check_int("download_retry", download_retry, minimum=0)
        if validate_hash is not None and not is_hash(validate_hash):
            raise ValueError(f"validate_hash={validate_hash!r} is not a known hash name")

        self.streams = streams
        self.split = split
        self.shuffle = bool(shuffle)
        self.shuffle_seed = shuffle_seed
        self.shuffle_block_size = shuffle_block_size or DEFAULT_BLOCK_SIZE
        self.batch_size = batch_size
        self.predownload = (
            predownload if predownload is not None else max(8 * (batch_size or 1), 64)
        )
        self.allow_unsafe = allow_unsafe
        self.data_parallel = data_parallel
        World.detect(data_parallel)  # a bad (rank, size) fails here, not at the first batch
        self.caches: list[ShardCache] = [
            s.open(
                split,
                validate_hash=validate_hash,
                keep_zip=keep_zip,
                storage_options=dict(storage_options) if storage_options else None,
                retries=download_retry,
            )
            for s in streams
        ]
        self.limiter = CacheLimiter(self.caches, cache_limit) if cache_limit is not None else None

        self._shard_sizes = [np.array([s.samples for s in c.shards], np.int64) for c in self.caches]
        flat = np.concatenate(self._shard_sizes)
        self._shard_ends = np.cumsum(flat)
        self._shard_starts = self._shard_ends - flat
        self.num_samples = int(self._shard_ends[-1]) if len(flat) else 0
        self.stream_sizes = [int(s.sum()) for s in self._shard_sizes]
        self.stream_counts = stream_counts(
            self.stream_sizes,
            [s.proportion for s in streams],
            [s.repeat for s in streams],
            [s.choose for s in streams],
            epoch_size,
        )
        self.epoch_size = int(self.stream_counts.sum())
        self._epoch = 0
        self._resume: tuple[int, int] | None = None  # (epoch, samples consumed)
        self._runtime: tuple[int, ShardReaderPool] | None = None

    # -- per-process state ------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_runtime"] = None  # open files and maps stay with their process
        return state

    def _readers(self) -> ShardReaderPool:
        if self._runtime is None or self._runtime[0] != os.getpid():
            readers = ShardReaderPool(self.caches, self.limiter, self.allow_unsafe)
            self._runtime = (os.getpid(), readers)
        return self._runtime[1]

    # -- random access ------------------------------------------------------------------------

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sample ids -> (global shard numbers, indices within those shards)."""
        shards = np.searchsorted(self._shard_ends, ids, side="right")
        return shards, ids - self._shard_starts[shards]

    def _check_index(self, index: int) -> int:
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"sample index must be an integer, got {type(index).__name__}")
        if not -self.num_samples <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range for {self.num_samples} samples")
        return int(index) % self.num_samples

    def get_item(self, index: int) -> dict[str, Any]:
        """The decoded sample ``index`` (``{column: value}``), fetching its shard if needed."""
        i = self._check_index(index)
        shard = int(np.searchsorted(self._shard_ends, i, side="right"))
        return self._readers().get(shard).get(i - int(self._shard_starts[shard]))

    def __getitem__(self, index: int) -> Any:
        return self.get_item(index)

    def get_batch(self, ids: np.ndarray) -> Any:
        """The samples ``ids`` collated into one batch (subclasses read whole batches faster)."""
        return default_collate([self[int(i)] for i in ids])

    # -- epochs and resumption ------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration reads (its shuffle is seeded by (seed, epoch))."""
        check_int("epoch", epoch, minimum=0)
        self._epoch = epoch
        if self._resume is not None and self._resume[0] != epoch:
            self._resume = None

    def _start(self) -> int:
        if self._resume is not None and self._resume[0] == self._epoch:
            return self._resume[1]
        return 0

    def state_dict(self, num_samples: int, from_beginning: bool = True) -> dict[str, Any]:
        """Position after ``num_samples`` global samples of the current epoch.

        ``from_beginning=False`` counts from where this epoch was resumed instead of its start.
        """
        check_int("num_samples", num_samples, minimum=0)
        consumed = num_samples if from_beginning else self._start() + num_samples
        return {
            "epoch": self._epoch,
            "sample_in_epoch": consumed,
            "shuffle": self.shuffle,
            "shuffle_seed": self.shuffle_seed,
            "shuffle_block_size": self.shuffle_block_size,
            "epoch_size": self.epoch_size,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the next iteration of its epoch yields the remaining order."""
        missing = [k for k in ("epoch", "sample_in_epoch", *_STATE_CHECKED) if k not in state]
        if missing:
            raise ValueError(f"dataset state is missing {missing}; was it made by state_dict()?")
        changed = {
            k: (state[k], getattr(self, k)) for k in _STATE_CHECKED if state[k] != getattr(self, k)
        }
        if changed:
            detail = ", ".join(
                f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in changed.items()
            )
            raise ValueError(
                f"cannot resume: the data order changed since the checkpoint ({detail}); "
                "resume with the same data and shuffle settings, or start a fresh run"
            )
        check_int("epoch", state["epoch"], minimum=0)
        check_int("sample_in_epoch", state["sample_in_epoch"], minimum=0)
        self._epoch = int(state["epoch"])
        self._resume = (self._epoch, int(state["sample_in_epoch"]))

    # -- iteration ------------------------------------------------------------------------

    def _plan(self, world: World) -> RankPlan:
        return RankPlan(
            self.epoch_size, self._start(), world.world_size, world.rank, self.batch_size or 1
        )

    def __len__(self) -> int:
        """Samples this rank reads in a full epoch: ``ceil(epoch_size / world_size)``."""
        world = World.detect(self.data_parallel)
        return RankPlan(self.epoch_size, 0, world.world_size, world.rank, 1).num_samples

    def num_batches(self) -> int:
        """Batches this rank reads in a full epoch (needs ``batch_size``)."""
        if self.batch_size is None:
            raise ValueError("num_batches() needs the dataset's batch_size")
        world = World.detect(self.data_parallel)
        return RankPlan(
            self.epoch_size, 0, world.world_size, world.rank, self.batch_size
        ).num_batches

    def batches(self) -> Iterator[np.ndarray]:
        """Sample ids of this process's batches of the current epoch, in order.

        Shards of the next ``predownload`` samples are downloaded in the background meanwhile.
        """
        world = World.detect(self.data_parallel)
        order = EpochOrder(
            self._shard_sizes,
            self.stream_counts,
            self.shuffle_seed,
            self._epoch,
            self.shuffle,
            self.shuffle_block_size,
        )
        plan = self._plan(world)
        ids = _batch_ids(order, plan, world)
        if not any(c.evictable for c in self.caches) or self.predownload == 0:
            yield from ids
            return
        yield from self._predownloading(ids)

    def _predownloading(self, ids: Iterator[np.ndarray]) -> Iterator[np.ndarray]:
        readers = self._readers()
        worker = Predownloader(readers.fetch)
        ahead: deque[np.ndarray] = deque()
        ahead_samples = 0
        try:
            for batch in ids:
                shards, _ = self.locate(batch)
                for shard in dict.fromkeys(shards.tolist()):  # unique, in order of first use
                    worker.request(shard)
                ahead.append(batch)
                ahead_samples += len(batch)
                while ahead and ahead_samples - len(ahead[0]) >= self.predownload:
                    ahead_samples -= len(ahead[0])
                    yield ahead.popleft()
            while ahead:
                yield ahead.popleft()
        finally:
            worker.close()

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches():
            for i in batch:
                yield self[int(i)]


def _batch_ids(order: EpochOrder, plan: RankPlan, world: World) -> Iterator[np.ndarray]:
    """Ids of the rank batches of ``plan`` that ``world``'s worker makes, a chunk at a time."""
    ks = plan.worker_batches(world.worker, world.num_workers)
    per_chunk = max(1, 4096 // plan.batch_size)  # amortise the lookup over many small batches
    for first in range(0, len(ks), per_chunk):
        starts, lengths = np.array([plan.span(k) for k in ks[first : first + per_chunk]]).T
        ends = np.cumsum(lengths)
        # Each batch's positions are consecutive: start, start + 1, ..., start + length - 1.
        ids = order.ids(np.arange(ends[-1]) + np.repeat(starts - (ends - lengths), lengths))
        lo = 0
        for hi in ends.tolist():
            yield ids[lo:hi]
            lo = hi
