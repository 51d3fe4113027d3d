"""StreamingDataset: MDS shards from object stores or local disk, in a deterministic, elastic order.

- Random access: ``ds[i]`` for ``0 <= i < ds.num_samples`` (sample ids number the shards of
  all streams in order) downloads the sample's shard if it is not local yet.
- Iteration: this rank's and DataLoader worker's share of the epoch, in the global order of
  sampling.py, with shards predownloaded ahead of the reader by a background thread. The
  order is cut into ``canonical_nodes`` spans and each node reads only its own, so a node
  downloads about its share of the shards.
- Epochs and resumption: call ``set_epoch(e)`` before iterating epoch ``e``; a checkpoint
  stores ``state_dict(num_samples)`` where ``num_samples`` counts the global samples consumed
  in the current epoch (all ranks together); ``load_state_dict`` makes the next iteration of
  that epoch continue with exactly the remaining global order, on any number of ranks per node
  and any node count that divides ``canonical_nodes``.
- Cache sharing, locking and eviction: cache.py and eviction.py.

Runtime state (open shard readers) is per process and rebuilt after the dataset is copied into
a DataLoader worker, so a dataset object can be built once and handed to any DataLoader.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from llmfoundry.core.metrics import SAMPLE_MASK
from llmfoundry.data.mds import is_hash
from llmfoundry.data.streaming.cache import ShardCache
from llmfoundry.data.streaming.checks import check_int
from llmfoundry.data.streaming.epochs import EpochDataset
from llmfoundry.data.streaming.eviction import CacheLimiter, working_set_bytes
from llmfoundry.data.streaming.pins import Pins
from llmfoundry.data.streaming.predownload import Predownloader
from llmfoundry.data.streaming.reader_pool import ShardReaderPool
from llmfoundry.data.streaming.sampling import EpochOrder, stream_counts
from llmfoundry.data.streaming.stream import Stream
from llmfoundry.data.streaming.world import World, _env_int
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.files import join_url

__all__ = ["StreamingDataset"]

log = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 1 << 18
_STREAM_KEYS = ("remote", "local", "proportion", "repeat", "choose")


class StreamingDataset(EpochDataset):
    """Samples of one or more MDS datasets, streamed from a remote or read locally.

    Args:
        remote: URL (``s3://b/ds``, ``gs://``, ``az://``, ...) or local path of the dataset.
        local: cache folder for ``remote``, the user's own (default: a folder per user, endpoint
            and remote in the temp dir, stream.py), or the dataset folder when ``remote`` is
            None; with ``streams`` given as a mapping, the folder their caches go under
            (``local/<name>``). See stream.py for the cases.
        split: sub-folder to read (``"train"``); None reads ``remote``/``local`` itself.
        streams: several sources mixed in one epoch instead of ``remote``: Stream objects, or
            the config's ``{name: {remote, local, proportion | repeat | choose}}``.
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
            ones are evicted. Shards without a remote copy are never evicted, nor shards a
            reader sharing the cache still has to read (its predownload window and the rest of
            its shuffle block): a limit below what the machine reads at once (a block's shards
            plus the window, :meth:`working_set`) is exceeded rather than fetching shards
            twice, and a warning at start gives the size that works.
        predownload: samples to download ahead of the reader (default 8 batches, at least 64).
        validate_hash: the hash of index.json (``"xxh64"``, ...) that downloads, and local
            shards on their first use in each process, are checked against; None: the fastest
            one the index lists (cache.py).
        keep_zip: keep compressed shards after decompressing them.
        download_retry: download attempts after a failed one (exponential backoff).
        storage_options: fsspec options for the remote (``{"client_kwargs": {...}}``, ...).
        allow_unsafe: allow reading ``pkl`` columns (pickle runs code from the file).
        data_parallel: (rank, size) of this process among the data-parallel readers, from the
            trainer's strategy; default torchrun's RANK and WORLD_SIZE (world.py).
        evaluation: read every sample of the split once in storage order (``shuffle``,
            ``epoch_size``, ``canonical_nodes`` and the streams' shares shape training only);
            batches carry ``sample_mask`` (epochs.py).
        canonical_nodes: spans the epoch is cut into, one per canonical node (sampling.py):
            a run resumes on any node count that divides it. None (default): the node count
            of the first launch, recorded in the data state.
    """

    state_checked = ("shuffle", "shuffle_seed", "shuffle_block_size", "epoch_size", "num_samples")

    def __init__(
        self,
        remote: str | None = None,
        local: str | None = None,
        split: str | None = None,
        *,
        streams: Sequence[Stream] | Mapping[str, Mapping[str, Any]] | None = None,
        shuffle: bool = False,
        shuffle_seed: int = 17,
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
        evaluation: bool = False,
        canonical_nodes: int | None = None,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            data_parallel=data_parallel,
            evaluation=evaluation,
            canonical_nodes=canonical_nodes,
        )
        for name, value in (("remote", remote), ("local", local), ("split", split)):
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise UserError(f"{name} must be a path or URL string, got {value!r}")
        for name, value in (("shuffle", shuffle), ("keep_zip", keep_zip)):
            if not isinstance(value, bool):
                raise UserError(f"{name} must be true or false, got {value!r}")
        if not isinstance(allow_unsafe, bool):
            raise UserError(f"allow_unsafe must be true or false, got {allow_unsafe!r}")
        if isinstance(streams, Mapping):
            if remote is not None:
                raise UserError(
                    "set remote or streams, not both: with streams in the data config add "
                    "data.remote=null (its default is the demo dataset) and set "
                    "tokenizer=<path or URL of tokenizer.json>"
                )
            streams, local = _config_streams(streams, local), None
        if streams is not None:
            if remote is not None or local is not None:
                raise UserError("pass either remote/local or streams, not both")
            streams = list(streams)
            if not streams or not all(isinstance(s, Stream) for s in streams):
                raise UserError("streams must be a non-empty list of Stream objects")
            if evaluation:  # every sample of each stream's split once
                streams = [Stream(remote=s.remote, local=s.local, split=s.split) for s in streams]
        else:
            if remote is None and local is None:
                raise UserError(
                    "remote is required: a local MDS folder (e.g. data/demo/mds) or a URL "
                    "(s3://bucket/mds) with train/ and val/ sub-folders; or set streams"
                )
            streams = [Stream(remote=remote, local=local)]
        if evaluation:
            shuffle, epoch_size = False, None
        check_int("shuffle_seed", shuffle_seed, minimum=0)
        check_int("shuffle_block_size", shuffle_block_size, minimum=1, optional=True)
        check_int("epoch_size", epoch_size, minimum=1, optional=True)
        check_int("predownload", predownload, minimum=0, optional=True)
        check_int("download_retry", download_retry, minimum=0)
        if validate_hash is not None and not is_hash(validate_hash):
            raise UserError(
                f"validate_hash={validate_hash!r} is not a hash name; use one listed in the "
                "index (e.g. xxh64, sha1) or null"
            )
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise UserError("storage_options must be a mapping of fsspec options")

        self.remote = None if remote is None else os.fspath(remote)
        self.storage_options = dict(storage_options) if storage_options else None
        self.streams = streams
        self.split = split
        self.shuffle = shuffle
        self.shuffle_seed = shuffle_seed
        self.shuffle_block_size = shuffle_block_size or DEFAULT_BLOCK_SIZE
        self.predownload = (
            predownload if predownload is not None else max(8 * (batch_size or 1), 64)
        )
        self.allow_unsafe = allow_unsafe
        self.caches: list[ShardCache] = [
            s.open(
                split,
                validate_hash=validate_hash,
                keep_zip=keep_zip,
                storage_options=self.storage_options,
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
        self._runtime: tuple[int, ShardReaderPool] | None = None
        if self.limiter is not None and self.limiter.caches and _env_int("LOCAL_RANK", 0) == 0:
            self._check_cache_limit()  # once per machine, by its local rank 0

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

    def _check_cache_limit(self) -> None:
        """Say at start when cache_limit cannot hold what this machine reads at once."""
        assert self.limiter is not None
        need = self.working_set()
        if need > self.limiter.limit:
            log.warning(
                "cache_limit=%d bytes is below what this machine reads at once: %d bytes "
                "(%.1f MiB) of shards, a shuffle block's shards plus the predownload window of "
                "its %d reader(s); the cache will grow past the limit to hold them. Set "
                "cache_limit to at least %d (or lower shuffle_block_size or predownload)",
                self.limiter.limit,
                need,
                need / 2**20,
                len(self._machine_ranks(World.detect(self.data_parallel))),
                need,
            )

    @staticmethod
    def _machine_ranks(world: World) -> range:
        """The data-parallel ranks on this process's node (world.py)."""
        first = world.node * world.local_world_size
        return range(first, first + world.local_world_size)

    def working_set(self, world: World | None = None, budget: int = 1 << 22) -> int:
        """Bytes of evictable shards this machine's ranks need at once in this epoch: the
        smallest cache_limit with which no shard is downloaded twice (eviction.py).

        Computed from the ranks' first ``budget`` samples (the block structure repeats).
        """
        world = world or World.detect(self.data_parallel)
        order = self.order()
        size, per_node = world.world_size, world.local_world_size
        plans = [
            self._plan(
                World(rank=r, world_size=size, local_rank=r % per_node, local_world_size=per_node)
            )
            for r in self._machine_ranks(world)
        ]
        steps = min(plans[0].num_batches, max(1, budget // sum(p.batch_size for p in plans)))
        shard_steps = []
        for k in range(steps):
            positions = np.concatenate([p.positions(k) for p in plans if k < p.num_batches])
            shard_steps.append(np.unique(self.locate(order(positions))[0]))
        shard_bytes = np.array(
            [
                (s.raw_data.bytes + (s.zip_data.bytes if c.keep_zip and s.zip_data else 0))
                if c.evictable
                else 0
                for c in self.caches
                for s in c.shards
            ],
            np.int64,
        )
        # The predownload window in steps, plus the batch being read and one step of slack
        # between the node's ranks (they reach a step at slightly different times).
        window = -(-self.predownload // plans[0].batch_size) + 2
        return working_set_bytes(
            shard_steps, shard_bytes, window, complete=steps == plans[0].num_batches
        )

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

    # -- iteration ------------------------------------------------------------------------

    def order(self) -> Callable[[np.ndarray], np.ndarray]:
        return EpochOrder(
            self._shard_sizes,
            self.stream_counts,
            self.shuffle_seed,
            self._epoch,
            self.shuffle,
            self.shuffle_block_size,
            self.canonical_nodes,
            self.layout_batch(),
        ).ids

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(sample ids, global positions) of this process's batches of the current epoch.

        Shards of the next ``predownload`` samples are downloaded in the background meanwhile.
        """
        pairs = super().batches()
        if not any(c.evictable for c in self.caches) or self.predownload == 0:
            yield from pairs
            return
        yield from self._predownloading(pairs)

    def _predownloading(
        self, pairs: Iterator[tuple[np.ndarray, np.ndarray]]
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        readers = self._readers()
        # With a cache limit, a shard is pinned from when it enters the predownload window
        # until the batch that reads it for the last time (the rest of its shuffle block) has
        # been read, so no reader sharing the cache evicts it before then (pins.py).
        pins = Pins(self.caches) if self.limiter is not None else None
        last = self._last_uses() if pins is not None else {}
        live: set[int] = set()

        def fetch_if_needed(shard: int) -> None:
            # A thread behind the reader (which then fetched the shard itself) skips a shard
            # whose last batch has been read: it may be evicted by now, and would come back
            # for nothing, taking cache space a shard still to be read needs.
            if pins is None or shard in live:
                readers.fetch(shard)

        worker = Predownloader(fetch_if_needed)
        ahead: deque[tuple[tuple[np.ndarray, np.ndarray], list[int], int]] = deque()
        ahead_samples = 0

        def hand_out() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            nonlocal ahead_samples
            pair, shards, k = ahead.popleft()
            ahead_samples -= len(pair[0])
            yield pair
            if pins is not None:  # the caller has read the batch when it asks for the next
                live.difference_update(s for s in shards if last[s] == k)
                pins.set(frozenset(live))

        try:
            for k, pair in enumerate(pairs):
                shards, _ = self.locate(pair[0])
                unique = list(dict.fromkeys(shards.tolist()))  # in order of first use
                if pins is not None:
                    live.update(unique)
                    pins.set(frozenset(live))
                for shard in unique:
                    worker.request(shard)
                ahead.append((pair, unique, k))
                ahead_samples += len(pair[0])
                while ahead and ahead_samples - len(ahead[0][0][0]) >= self.predownload:
                    yield from hand_out()
            while ahead:
                yield from hand_out()
        finally:
            worker.close()
            if pins is not None:
                pins.close()

    def _last_uses(self) -> dict[int, int]:
        """Shard -> the index of this process's last batch (this epoch) that reads it."""
        last: dict[int, int] = {}
        for k, (ids, _) in enumerate(super().batches()):  # the same batches, from the order
            for shard in np.unique(self.locate(ids)[0]).tolist():
                last[shard] = k
        return last

    def __iter__(self) -> Iterator[Any]:
        """This process's samples of the current epoch, one at a time, as stored (not collated
        into batches, which may pad); an evaluation sample carries ``sample_mask`` (a bool
        tensor) as the rows of `EpochDataset`'s batches do."""
        for ids, positions in self.batches():
            for i, position in zip(ids.tolist(), positions.tolist(), strict=True):
                sample = self[i]
                if self.evaluation:
                    sample = {**sample, SAMPLE_MASK: torch.tensor(position < self.epoch_size)}
                yield sample


def _config_streams(streams: Mapping[str, Any], local: str | None) -> list[Stream]:
    """The config's ``{name: {remote, local, proportion | repeat | choose}}`` as Streams, cached
    under ``local/<name>`` when ``local`` is set (an evaluation dataset then drops the shares)."""
    if not streams:
        raise UserError("streams must map stream names to {remote, local, ...}")
    out = []
    for name, spec in streams.items():
        where = f"streams.{name}"
        if not isinstance(spec, Mapping):
            raise UserError(f"{where} must be a mapping with keys {_STREAM_KEYS}")
        unknown = sorted(set(spec) - set(_STREAM_KEYS))
        if unknown:
            raise UserError(
                f"{where}: unknown key(s) {unknown}; allowed: {list(_STREAM_KEYS)} (the split "
                "comes from the data config's train_split / eval_split)"
            )
        args = dict(spec)
        if args.get("local") is None and local is not None:
            args["local"] = join_url(local, name)
        try:
            out.append(Stream(**args))
        except (TypeError, ValueError) as err:
            raise UserError(f"{where}: {err}") from None
    return out
