"""StreamingDataset: local and cached reads, locking, eviction, resumption, workers, mixing."""

from __future__ import annotations

import bz2
import importlib
import multiprocessing as mp
import os
import signal
import time
import tracemalloc
import warnings
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from fsspec.implementations.local import LocalFileSystem

from llmfoundry.data.mds import MDSWriter, ShardCorruptError, load_index, write_index
from llmfoundry.data.streaming import Stream, StreamingDataLoader, StreamingDataset
from llmfoundry.data.streaming import download as download_mod
from llmfoundry.data.streaming.locking import file_lock
from llmfoundry.utils.errors import UserError

SEQ = 8


def write_mds(folder: Path, n: int, start: int = 0, size_limit: int = 300, **kwargs) -> None:
    """``n`` samples {"id": start + i, "tokens": row} in shards of a few samples each."""
    columns = {"id": "int", "tokens": f"ndarray:uint16:{SEQ}"}
    with MDSWriter(folder, columns, size_limit=size_limit, **kwargs) as writer:
        for i in range(start, start + n):
            writer.write({"id": i, "tokens": (np.arange(SEQ) + i).astype(np.uint16)})


def ids_of(dataset) -> list[int]:
    return [int(sample["id"]) for sample in dataset]


def shard_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("shard.*"))


@pytest.fixture
def data(tmp_path: Path) -> Path:
    """An MDS root with train/ (60 samples, ~9 shards) and val/ (10 samples)."""
    write_mds(tmp_path / "mds" / "train", 60)
    write_mds(tmp_path / "mds" / "val", 10, start=1000)
    return tmp_path / "mds"


@pytest.fixture
def world(monkeypatch):
    """Set this process's rank the way torchrun does."""

    def set_world(rank: int, size: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(size))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(size))

    return set_world


# -- reading ----------------------------------------------------------------------------------


def test_local_folder_is_read_in_place(data: Path):
    before = sorted(p.name for p in (data / "train").iterdir())
    ds = StreamingDataset(str(data), split="train")
    assert ds.num_samples == ds.epoch_size == len(ds) == 60
    assert ds[7]["id"] == 7 and ds[-1]["id"] == 59
    assert np.array_equal(ds[7]["tokens"], np.arange(SEQ) + 7)
    assert ids_of(ds) == list(range(60))
    with pytest.raises(IndexError, match="out of range"):
        ds[60]
    assert sorted(p.name for p in (data / "train").iterdir()) == before  # nothing written


def test_remote_shards_are_fetched_lazily_for_random_access(data: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    ds = StreamingDataset(str(data), str(cache), split="train")
    assert shard_files(cache / "train") == []  # only the index so far
    assert (cache / "train" / "index.json").read_bytes() == (data / "train/index.json").read_bytes()
    shard, _ = ds.locate(np.array([45]))
    assert ds[45]["id"] == 45
    assert shard_files(cache / "train") == [f"shard.{int(shard[0]):05d}.mds"]
    assert sorted(ids_of(ds)) == list(range(60))
    assert shard_files(cache / "train") == shard_files(data / "train")
    assert not list((cache / "train").glob("*.tmp.*"))


def test_compressed_shards_are_checked_and_decompressed(tmp_path: Path):
    write_mds(tmp_path / "remote", 40, compression="zstd", hashes=("sha1", "xxh64"))
    ds = StreamingDataset(str(tmp_path / "remote"), str(tmp_path / "c1"), validate_hash="xxh64")
    assert sorted(ids_of(ds)) == list(range(40))
    names = {p.name for p in (tmp_path / "c1").glob("shard.*")}
    assert names and all(n.endswith(".mds") for n in names)  # raw only
    kept = StreamingDataset(str(tmp_path / "remote"), str(tmp_path / "c2"), keep_zip=True)
    assert kept[0]["id"] == 0
    assert {p.suffix for p in (tmp_path / "c2").glob("shard.*")} == {".mds", ".zstd"}


@pytest.mark.parametrize("compression", [None, "gz"])
def test_corrupt_download_names_the_file_and_leaves_nothing(tmp_path: Path, compression):
    write_mds(tmp_path / "remote", 20, compression=compression, hashes=("xxh64",))
    victim = sorted((tmp_path / "remote").glob("shard.00001.*"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF  # same size, different bytes
    victim.write_bytes(bytes(raw))
    ds = StreamingDataset(str(tmp_path / "remote"), str(tmp_path / "cache"), validate_hash="xxh64")
    shard1 = int(np.flatnonzero(ds.locate(np.arange(20))[0] == 1)[0])
    with pytest.raises(ShardCorruptError, match=victim.name):
        ds[shard1]
    assert shard_files(tmp_path / "cache") == [] or "shard.00001.mds" not in shard_files(
        tmp_path / "cache"
    )
    assert not list((tmp_path / "cache").glob("*.tmp.*"))
    assert ds[0]["id"] == 0  # other shards still fine


def _bomb(algo: str, size: int) -> bytes:
    """``size`` zero bytes compressed with ``algo``, made without holding them (except snappy,
    whose ratio is bounded: its bomb is the size header the reader checks first)."""
    zeros = b"\0" * (1 << 20)
    if algo == "snappy":
        return importlib.import_module("snappy").compress(zeros * (size >> 20))
    if algo == "br":
        packer = importlib.import_module("brotli").Compressor(quality=1)
        return b"".join(packer.process(zeros) for _ in range(size >> 20)) + packer.finish()
    make = {
        "zstd": lambda: zstandard.ZstdCompressor().compressobj(),
        "gz": lambda: zlib.compressobj(9, wbits=31),
        "bz2": lambda: bz2.BZ2Compressor(9),
    }[algo]
    packer = make()
    return b"".join(packer.compress(zeros) for _ in range(size >> 20)) + packer.flush()


@pytest.mark.parametrize("algo", ["zstd", "gz", "bz2", "br", "snappy"])
def test_a_decompression_bomb_is_refused_within_the_index_raw_size(tmp_path: Path, algo):
    """A shard whose index says ~1 KB raw but which expands to 64 MiB is refused with one line
    naming it, having held a few chunks of 1 MiB: never the 64 MiB (issue 32.4)."""
    if algo in ("br", "snappy"):
        pytest.importorskip({"br": "brotli", "snappy": "snappy"}[algo])
    remote = tmp_path / "remote"
    write_mds(remote, 3, compression=algo)
    [info] = load_index(remote)
    bomb = _bomb(algo, 64 << 20)
    (remote / info.zip_basename).write_bytes(bomb)
    write_index(remote, [replace(info, zip_data=replace(info.zip_data, bytes=len(bomb)))])
    ds = StreamingDataset(str(remote), str(tmp_path / "cache"))
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match="decompresses to more than") as err:
            ds[0]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.zip_basename in str(err.value) and "\n" not in str(err.value)
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB held while refusing a 64 MiB bomb"
    assert not list((tmp_path / "cache").glob("shard.*"))  # nothing left, not even a part


def test_validate_hash_must_be_recorded(tmp_path: Path):
    write_mds(tmp_path / "remote", 5, hashes=("sha1",))
    with pytest.raises(ValueError, match="record only hashes \\['sha1'\\]"):
        StreamingDataset(str(tmp_path / "remote"), str(tmp_path / "c"), validate_hash="md5")


def test_missing_index_and_split_give_helpful_errors(data: Path, tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=r"available splits .*\['train', 'val'\]"):
        StreamingDataset(str(data), split="test")
    with pytest.raises(FileNotFoundError, match="data_prep"):
        StreamingDataset(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match=r"available splits .*\['train', 'val'\]"):
        StreamingDataset(str(data), str(tmp_path / "cache"), split="tset")


def test_a_cache_folder_serves_one_remote(data: Path, tmp_path: Path):
    StreamingDataset(str(data / "train"), str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="already caches"):
        StreamingDataset(str(data / "val"), str(tmp_path / "cache"))


def test_downloads_retry_transient_errors_but_not_missing_files(tmp_path, monkeypatch):
    src = tmp_path / "src.bin"
    src.write_bytes(b"payload")
    real = LocalFileSystem.get_file
    calls, blips = [], [ConnectionResetError("network blip")]

    def flaky(self, rpath, lpath, **kw):
        calls.append(rpath)
        if blips:
            raise blips.pop()
        return real(self, rpath, lpath, **kw)

    monkeypatch.setattr(LocalFileSystem, "get_file", flaky)
    download_mod.download(str(src), tmp_path / "dst.bin", backoff=0.01)
    assert (tmp_path / "dst.bin").read_bytes() == b"payload" and len(calls) == 2
    calls.clear()
    with pytest.raises(FileNotFoundError, match="missing.bin does not exist"):
        download_mod.download(str(tmp_path / "missing.bin"), tmp_path / "x", backoff=0.01)
    assert len(calls) == 1


# -- sharing one cache between processes -----------------------------------------------------


def _hold_lock_then_hang(path: str, ready) -> None:
    with file_lock(path):
        ready.set()
        time.sleep(60)


def test_a_crashed_downloader_leaves_no_stale_lock_or_temp_files(data: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    ds = StreamingDataset(str(data / "train"), str(cache))
    leftover = cache / "shard.00000.mds.tmp.999999.deadbeef"
    leftover.write_bytes(b"half a shard")
    ctx = mp.get_context("fork")  # the holder only takes a lock: forking is safe and fast
    ready = ctx.Event()
    holder = ctx.Process(
        target=_hold_lock_then_hang, args=(str(cache / ".locks/shard.00000.mds.lock"), ready)
    )
    holder.start()
    try:
        assert ready.wait(30)
        os.kill(holder.pid, signal.SIGKILL)  # dies holding the shard's lock, mid "download"
        holder.join(10)
        start = time.monotonic()
        assert ds[0]["id"] == 0  # the kernel released the lock; the leftover is cleaned up
        assert time.monotonic() - start < 5
        assert not leftover.exists()
    finally:
        holder.kill()


def _read_all(remote: str, local: str, seed: int) -> tuple[list[int], int]:
    ds = StreamingDataset(remote, local, shuffle=True, shuffle_seed=seed, shuffle_block_size=7)
    ids, checksum = [], 0
    for sample in ds:
        ids.append(int(sample["id"]))
        checksum += int(sample["tokens"].astype(np.int64).sum()) - SEQ * int(sample["id"])
    return ids, checksum


def test_two_processes_share_one_cache_folder(tmp_path: Path):
    write_mds(tmp_path / "remote", 300, size_limit=400, compression="zstd", hashes=("xxh64",))
    args = [(str(tmp_path / "remote"), str(tmp_path / "cache"), seed) for seed in (1, 2)]
    with mp.get_context("spawn").Pool(2) as pool:
        results = pool.starmap(_read_all, args)
    expected_checksum = 300 * sum(range(SEQ))
    for ids, checksum in results:
        assert sorted(ids) == list(range(300)) and checksum == expected_checksum
    assert results[0][0] != results[1][0]  # really two different readers, two orders
    assert shard_files(tmp_path / "cache") == sorted(
        p.name[: -len(".zstd")] for p in (tmp_path / "remote").glob("shard.*")
    )
    assert not list((tmp_path / "cache").glob("*.tmp.*"))


# -- cache limit -------------------------------------------------------------------------------


def cached_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("shard.*"))


def test_cache_limit_evicts_least_recently_used_and_refetches(data: Path, tmp_path: Path):
    cache = tmp_path / "cache" / "train"
    shard_size = max(p.stat().st_size for p in (data / "train").glob("shard.*"))
    limit = 3 * shard_size
    ds = StreamingDataset(
        str(data), str(tmp_path / "cache"), split="train", cache_limit=limit, predownload=0
    )
    assert ids_of(ds) == list(range(60))
    assert 0 < cached_bytes(cache) <= limit
    assert "shard.00000.mds" not in shard_files(cache)  # least recently used went first
    assert shard_files(cache)[-1] == shard_files(data / "train")[-1]  # most recent stayed
    assert ds[0]["id"] == 0  # evicted shard comes back on demand
    assert "shard.00000.mds" in shard_files(cache) and cached_bytes(cache) <= limit
    with pytest.raises(ValueError, match="cannot hold the largest shard"):
        StreamingDataset(str(data), str(tmp_path / "c2"), split="train", cache_limit=10)


def test_cache_limit_never_deletes_the_only_copy(data: Path):
    with pytest.warns(UserWarning, match="only copy"):
        ds = StreamingDataset(str(data), split="train", cache_limit="1kb")
    files = shard_files(data / "train")
    assert ids_of(ds) == list(range(60))
    assert shard_files(data / "train") == files


def test_predownload_fetches_ahead_of_the_reader(data: Path, tmp_path: Path):
    cache = tmp_path / "cache" / "train"
    ds = StreamingDataset(str(data), str(tmp_path / "cache"), split="train", predownload=40)
    shard_ends = np.cumsum([s.samples for s in ds.caches[0].shards])
    it = iter(ds)
    assert next(it)["id"] == 0
    needed = int(np.searchsorted(shard_ends, 40, side="right")) + 1  # shards of samples 0..40
    deadline = time.monotonic() + 10
    while len(shard_files(cache)) < needed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(shard_files(cache)) >= needed  # fetched before the reader asked
    assert [s["id"] for s in it] == list(range(1, 60))


# -- order, epochs, resumption, workers --------------------------------------------------------


def test_shuffle_is_deterministic_per_seed_and_epoch(data: Path):
    def order(epoch, seed=5):
        ds = StreamingDataset(str(data), split="train", shuffle=True, shuffle_seed=seed)
        ds.set_epoch(epoch)
        return ids_of(ds)

    assert order(0) == order(0) and sorted(order(0)) == list(range(60))
    assert order(0) != order(1) and order(0) != order(0, seed=6)


def global_order(data: Path, world, world_size: int, batch: int, state=None) -> list[int]:
    """Samples all ranks read in one epoch, step by step in rank order (ranks in-process)."""
    streams = []
    for rank in range(world_size):
        world(rank, world_size)
        ds = StreamingDataset(
            str(data), split="train", shuffle=True, shuffle_block_size=16, batch_size=batch
        )
        ds.set_epoch(2)
        if state is not None:
            ds.load_state_dict(state)
        streams.append([[int(i) for i in b] for b, _ in ds.batches()])
    assert len({len(s) for s in streams}) == 1
    return [i for step in zip(*streams, strict=True) for batch in step for i in batch]


def test_ranks_partition_the_global_order_without_divisibility(data: Path, world):
    single = global_order(data, world, 1, 4)
    assert sorted(single) == list(range(60))
    for world_size, batch in [(2, 3), (4, 2), (7, 2)]:  # 60 samples over 7 ranks: 9 each
        seen = global_order(data, world, world_size, batch)
        assert seen[:60] == single
        assert len(seen) == -(-60 // world_size) * world_size  # a few repeats, none dropped
        world(0, world_size)
        assert len(StreamingDataset(str(data), split="train")) == -(-60 // world_size)


@pytest.mark.parametrize("consumed", [0, 8, 13, 59, 60])
def test_resumption_continues_the_global_order_on_another_world_size(data, world, consumed):
    single = global_order(data, world, 1, 4)
    world(0, 4)
    ds = StreamingDataset(
        str(data), split="train", shuffle=True, shuffle_block_size=16, batch_size=2
    )
    ds.set_epoch(2)
    state = ds.state_dict(consumed)
    for world_size, batch in [(4, 2), (2, 4), (3, 3)]:
        rest = global_order(data, world, world_size, batch, state)
        remaining = 60 - consumed
        assert rest[:remaining] == single[consumed:]
        assert len(rest) - remaining == (-remaining) % world_size


def test_resume_state_is_bound_to_its_epoch_and_checked(data: Path):
    ds = StreamingDataset(str(data), split="train", shuffle=True, batch_size=4)
    ds.set_epoch(3)
    full = ids_of(ds)
    ds.load_state_dict(ds.state_dict(20))
    assert ds.epoch == 3 and ids_of(ds) == full[20:]
    assert ds.state_dict(8, from_beginning=False)["sample_in_epoch"] == 28
    ds.set_epoch(4)  # a new epoch starts from its beginning
    assert len(ids_of(ds)) == 60
    other = StreamingDataset(str(data), split="train", shuffle=True, shuffle_seed=1)
    with pytest.raises(ValueError, match="shuffle_seed: checkpoint 17 vs now 1"):
        other.load_state_dict(ds.state_dict(5))
    with pytest.raises(ValueError, match="missing"):
        other.load_state_dict({"epoch": 0})


def test_dataloader_workers_keep_the_batch_order(data: Path, tmp_path: Path):
    def batches(num_workers: int) -> list[list[int]]:
        ds = StreamingDataset(
            str(data), str(tmp_path / f"cache{num_workers}"), split="train", shuffle=True,
            shuffle_block_size=16, batch_size=4,
        )  # fmt: skip
        loader = StreamingDataLoader(ds, num_workers=num_workers)
        loader.set_epoch(1)
        out = [b["id"].tolist() for b in loader]
        assert len(out) == len(loader) == 15
        return out

    reference = batches(0)
    assert sorted(i for b in reference for i in b) == list(range(60))
    assert batches(2) == reference  # 15 batches: 8 from worker 0, 7 from worker 1


def test_in_process_loader_matches_torchs_iterator(data: Path):
    # Without workers the loader yields the dataset's batches itself, unless a profiler runs:
    # the same batches and the same draws from the global RNG either way.
    loader = StreamingDataLoader(StreamingDataset(str(data), split="train", batch_size=4))
    torch.manual_seed(0)
    direct = [b["id"].tolist() for b in loader]
    after_direct = torch.rand(3)
    torch.manual_seed(0)
    with torch.autograd.profiler.profile() as prof:
        profiled = [b["id"].tolist() for b in loader]
    assert profiled == direct and torch.equal(torch.rand(3), after_direct)
    assert any(e.name.startswith("enumerate(DataLoader)") for e in prof.function_events)
    with pytest.raises(ValueError, match="set num_workers > 0"):
        StreamingDataLoader(loader.streaming_dataset, timeout=5)


def test_loader_resumes_and_drop_last(data: Path):
    ds = StreamingDataset(str(data), split="train", batch_size=8)
    loader = StreamingDataLoader(ds, drop_last=True)
    assert len(loader) == 7 and all(len(b["id"]) == 8 for b in loader)
    full = [b["id"] for b in StreamingDataLoader(ds)]
    assert len(full) == 8 and len(full[-1]) == 4
    loader.load_state_dict(loader.state_dict(16))
    assert torch.equal(next(iter(loader))["id"], full[2])


# -- canonical nodes: each node reads its own spans ---------------------------------------------


@pytest.fixture
def nodes(monkeypatch):
    """Set the variables torchrun gives rank ``rank`` of ``count`` nodes x ``per_node`` ranks."""

    def set_nodes(rank: int, count: int, per_node: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(count * per_node))
        monkeypatch.setenv("LOCAL_RANK", str(rank % per_node))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))

    return set_nodes


def node_run(data: Path, nodes, count, per_node, batch, state=None, **kwargs):
    """(the global order all ranks read, step by step, without the repeats; how many repeats;
    the shards each node read; rank 0's dataset)."""
    steps, shards, first = [], [set() for _ in range(count)], None
    for rank in range(count * per_node):
        nodes(rank, count, per_node)
        ds = StreamingDataset(
            str(data), split="train", shuffle=True, shuffle_block_size=8, batch_size=batch,
            **kwargs,
        )  # fmt: skip
        first = first or ds
        ds.set_epoch(1)
        if state is not None:
            ds.load_state_dict(state)
        steps.append(list(ds.batches()))
        for ids, _ in steps[-1]:
            shards[rank // per_node] |= set(ds.locate(ids)[0].tolist())
    assert len({len(s) for s in steps}) == 1
    pairs = [pair for step in zip(*steps, strict=True) for pair in step]
    ids = np.concatenate([i for i, _ in pairs])
    positions = np.concatenate([p for _, p in pairs])
    return ids[positions < 60].tolist(), int((positions >= 60).sum()), shards, first


def test_nodes_read_their_own_shards_and_resume_on_node_counts_dividing_c(data, nodes):
    order, repeats, shards, ds = node_run(data, nodes, 4, 2, 2)  # C: this launch's 4 nodes
    assert ds.canonical_nodes == 4 and sorted(order) == list(range(60)) and repeats == 4
    total = len(shard_files(data / "train"))
    # each node reads its part of the shards (before, every node read every shard)
    assert sum(map(len, shards)) <= total + 3 and max(map(len, shards)) < total
    state = ds.state_dict(16)  # one step of 4 nodes x 2 ranks x 2
    assert (state["canonical_nodes"], state["global_batch"]) == (4, 16)
    # the same global batch on other nodes and GPUs per node; then another global batch (24),
    # which finishes the epoch in the state's layout
    for count, per_node, batch in [(2, 2, 4), (1, 4, 4), (4, 1, 4), (1, 1, 16), (2, 3, 4)]:
        rest, repeats, _, resumed = node_run(data, nodes, count, per_node, batch, state)
        assert resumed.canonical_nodes == 4  # adopted from the state
        assert rest == order[16:] and repeats == (-44) % (count * per_node)


def test_other_node_counts_are_refused_before_training(data, nodes):
    nodes(0, 3, 2)
    with pytest.raises(UserError, match=r"has 3 nodes; run on 1, 2, 4 nodes \(the divisors"):
        StreamingDataset(str(data), split="train", canonical_nodes=4)
    ds = StreamingDataset(str(data), split="train", batch_size=2)  # C = 3, this launch's
    nodes(0, 2, 2)
    state = ds.state_dict(12)
    with pytest.raises(UserError, match="canonical_nodes=3 but this run has 2 nodes; run on 1, 3"):
        StreamingDataset(str(data), split="train", batch_size=3).load_state_dict(state)
    with pytest.raises(UserError, match="has canonical_nodes=3, the config sets 2"):
        StreamingDataset(str(data), split="train", canonical_nodes=2).load_state_dict(state)
    with pytest.raises(UserError, match="canonical_nodes must be an integer >= 1"):
        StreamingDataset(str(data), split="train", canonical_nodes=0)


def test_one_canonical_node_reads_as_before_on_any_node_count(data, nodes, world, caplog):
    reference = global_order(data, world, 1, 4)[:60]  # epoch 2, one node
    state = {"epoch": 2, "sample_in_epoch": 0}  # a state from before canonical nodes
    nodes(0, 1, 1)
    ds = StreamingDataset(str(data), split="train", shuffle=True, shuffle_block_size=16)
    state |= {k: getattr(ds, k) for k in ds.state_checked}
    for count, per_node in [(2, 2), (3, 1)]:
        steps = []
        for rank in range(count * per_node):
            nodes(rank, count, per_node)
            ds = StreamingDataset(
                str(data), split="train", shuffle=True, shuffle_block_size=16, batch_size=1
            )
            ds.load_state_dict(state)
            assert ds.canonical_nodes == 1
            steps.append([int(i[0]) for i, _ in ds.batches()])
        assert [i for step in zip(*steps, strict=True) for i in step][:60] == reference
    assert (
        "canonical_nodes=1 (a one-node run): each of the 3 nodes reads every shard" in caplog.text
    )


def test_evaluation_reads_every_sample_once_whatever_the_nodes(data, nodes):
    seen = []
    for rank in range(6):
        nodes(rank, 3, 2)
        ds = StreamingDataset(
            str(data), split="val", batch_size=1, evaluation=True, canonical_nodes=4
        )
        assert ds.canonical_nodes == 1
        seen += [int(s["id"]) for s in ds if bool(s["sample_mask"])]
    assert sorted(seen) == list(range(1000, 1010))


# -- mixing streams, epoch size ---------------------------------------------------------------


def test_streams_mix_by_proportion_and_repeat(tmp_path: Path):
    write_mds(tmp_path / "a", 50)
    write_mds(tmp_path / "b", 20, start=1000)
    mixed = StreamingDataset(
        streams=[
            Stream(str(tmp_path / "a"), proportion=3),
            Stream(str(tmp_path / "b"), proportion=1),
        ],
        epoch_size=80,
        shuffle=True,
    )
    ids = ids_of(mixed)
    from_a = [i for i in ids if i < 1000]
    assert len(ids) == len(mixed) == 80 and len(from_a) == 60
    assert len(set(from_a)) == 50  # all of a once, 10 of them twice
    assert sorted(set(ids) - set(from_a)) == list(range(1000, 1020))
    assert mixed[50]["id"] == 1000  # random access spans the streams in order
    repeated = StreamingDataset(
        streams=[Stream(str(tmp_path / "a"), choose=10), Stream(str(tmp_path / "b"), repeat=2)]
    )
    ids = ids_of(repeated)
    assert len(ids) == 50 and len({i for i in ids if i < 1000}) == 10
    assert sorted(i for i in ids if i >= 1000) == sorted(list(range(1000, 1020)) * 2)
    with pytest.raises(ValueError, match="at most one of proportion/repeat/choose"):
        Stream(str(tmp_path / "a"), proportion=1, repeat=2)
    with pytest.raises(ValueError, match="either remote/local or streams"):
        StreamingDataset(str(tmp_path / "a"), streams=[Stream(str(tmp_path / "b"))])


def test_epoch_size_down_and_up_samples(data: Path):
    down = StreamingDataset(str(data), split="train", epoch_size=25, shuffle=True)
    ids = ids_of(down)
    assert len(ids) == len(down) == 25 and len(set(ids)) == 25
    down.set_epoch(1)
    assert set(ids_of(down)) != set(ids)  # another subset next epoch
    up = StreamingDataset(str(data), split="train", epoch_size=150)
    counts = np.bincount(ids_of(up), minlength=60)
    assert counts.sum() == 150 and set(counts.tolist()) == {2, 3}


def test_argument_errors_name_the_argument(data: Path):
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        StreamingDataset(str(data), split="train", batch_size=0)
    with pytest.raises(ValueError, match="remote is required"):
        StreamingDataset()
    with pytest.raises(ValueError, match="validate_hash='nope'"):
        StreamingDataset(str(data), split="train", validate_hash="nope")


# -- metadata once per machine (node.py) -------------------------------------------------------


def test_local_ranks_read_the_leaders_copy_of_this_launch_only(data, tmp_path, monkeypatch):
    """A follower reads the index local rank 0 fetched in this launch; a copy from another
    launch is never read (it times out with the fix), and the leader's error reaches it."""
    from llmfoundry.data.streaming import node

    monkeypatch.setattr(node, "WAIT_S", 0.3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("LOCAL_RANK", "0")
    leader = StreamingDataset(str(data), cache, split="train")
    monkeypatch.setenv("LOCAL_RANK", "1")
    follower = StreamingDataset(str(data), cache, split="train")
    assert follower.caches[0].shards == leader.caches[0].shards
    monkeypatch.setattr(node, "_launch_key", lambda: "another-launch")
    with pytest.raises(TimeoutError, match="local rank 1 waited 0 s for local rank 0"):
        StreamingDataset(str(data), cache, split="train")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(FileNotFoundError, match="no MDS dataset"):
        StreamingDataset(str(data), str(tmp_path / "c2"), split="nope")
    monkeypatch.setenv("LOCAL_RANK", "1")
    started = time.monotonic()
    with pytest.raises(FileNotFoundError, match="no MDS dataset"):
        StreamingDataset(str(data), str(tmp_path / "c2"), split="nope")
    assert time.monotonic() - started < 0.3  # the leader's error, not a timeout


# -- caches that do not thrash (pins.py) -------------------------------------------------------


def count_downloads(monkeypatch) -> list[int]:
    """Shard numbers fetched from the remote, in order (every ShardCache download)."""
    from llmfoundry.data.streaming.cache import ShardCache

    fetched: list[int] = []
    fetch = ShardCache._fetch

    def counting(self, j):
        fetched.append(j)
        return fetch(self, j)

    monkeypatch.setattr(ShardCache, "_fetch", counting)
    return fetched


def test_predownload_never_evicts_a_shard_still_to_be_read(data, tmp_path, monkeypatch):
    """A cache of 2 shards under a 40-sample (~6 shard) predownload window: least recently
    used alone evicts predownloaded shards before they are read and fetches them again; with
    the window pinned every shard is downloaded once (the cache overflows, with a warning)."""
    fetched = count_downloads(monkeypatch)
    shard_size = max(p.stat().st_size for p in (data / "train").glob("shard.*"))
    ds = StreamingDataset(
        str(data), str(tmp_path / "c"), split="train", cache_limit=2 * shard_size, predownload=40
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ids_of(ds) == list(range(60))
    assert sorted(fetched) == list(range(len(ds.caches[0].shards)))
    assert any("over cache_limit" in str(w.message) for w in caught)
    assert not list((tmp_path / "c" / "train" / ".pins").glob("*"))  # unpinned at the end


def test_a_predownloader_behind_the_reader_fetches_no_shard_twice(data, tmp_path, monkeypatch):
    """Under load the predownload thread can fall behind the reader, which then fetches shards
    itself; the thread must skip a shard whose last batch was read (evicted by then), not fetch
    it again (CI saw shard 0 twice). A thread slowed by 50 ms a shard shows it every time."""
    from llmfoundry.data.streaming import predownload

    fetched = count_downloads(monkeypatch)
    start = predownload.Predownloader.__init__

    def slowed(self, fetch):
        start(self, lambda shard: (time.sleep(0.05), fetch(shard)))

    monkeypatch.setattr(predownload.Predownloader, "__init__", slowed)
    shard_size = max(p.stat().st_size for p in (data / "train").glob("shard.*"))
    ds = StreamingDataset(
        str(data), str(tmp_path / "c"), split="train", cache_limit=2 * shard_size, predownload=40
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "over cache_limit": the window outgrows 2 shards
        assert ids_of(ds) == list(range(60))
    assert sorted(fetched) == list(range(len(ds.caches[0].shards)))


def test_a_cache_limit_below_the_working_set_is_reported_at_start(data, tmp_path, monkeypatch):
    """The start warning names the working set; a cache of that size reads the epoch with
    every shard downloaded once and never grows past it."""
    import logging
    import re

    fetched = count_downloads(monkeypatch)
    args = dict(split="train", shuffle=True, shuffle_block_size=20, predownload=8)
    shard_size = max(p.stat().st_size for p in (data / "train").glob("shard.*"))
    logger = "llmfoundry.data.streaming.dataset"
    with pytest.MonkeyPatch.context() as m:
        records: list[str] = []
        m.setattr(logging.getLogger(logger), "warning", lambda msg, *a: records.append(msg % a))
        StreamingDataset(str(data), str(tmp_path / "c1"), cache_limit=shard_size, **args)
        (message,) = records
        need = int(re.search(r"cache_limit to at least (\d+)", message).group(1))
        total = sum(p.stat().st_size for p in (data / "train").glob("shard.*"))
        assert shard_size < need < 0.75 * total  # a block plus the window, not the dataset
        records.clear()
        ds = StreamingDataset(str(data), str(tmp_path / "c2"), cache_limit=need, **args)
        assert records == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "over cache_limit" would fail here
        assert sorted(ids_of(ds)) == list(range(60))
    assert sorted(fetched) == list(range(len(ds.caches[0].shards)))
