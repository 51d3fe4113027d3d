"""Loader throughput: MDS through the trainer's DataLoader vs a raw numpy memmap.

The loader is the one the trainer gets from ``build_loaders`` (data=mds): a StreamingDataLoader over a
shuffled StreamingTextDataset, rows cut to ``max_seq_len`` (here the row length). Both sides
read the same 2048-token uint16 rows in the same shuffled order, with the same batch size, and
build the same batch the same way (the rows widened to int64 twice: ``input_ids`` and a
``labels`` copy); every batch of one epoch is checked equal before timing. The memmap side is
the floor a loader cannot beat: one fancy index per batch over a single file, its order
precomputed outside the clock. With num_workers=0 (one process, one core) the clock is this
process's CPU time, so other jobs on a shared machine distort it less than wall time; rounds
alternate between the two sides and both the best round of each and the median of the
per-round ratios are printed. The default batch size, 64, is the per-rank DataLoader batch of
a typical run (global batch 512 on 8 GPUs; microbatching comes later).

    python bench/data_loader.py              # 40k rows (160 MB), about 15 seconds
    python bench/data_loader.py --batch-size 8 --rows 20000
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from llmfoundry.data import StreamingTextDataset
from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.streaming import StreamingDataLoader


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=40_000, help="rows in the dataset (default 40000)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per row (default 2048)")
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch (default 64)")
    p.add_argument("--shard-size", default="16mb", help="MDS shard size limit (default 16mb)")
    p.add_argument(
        "--block-size", type=int, default=None, help="shuffle block in rows (default: dataset's)"
    )
    p.add_argument("--rounds", type=int, default=7, help="timed rounds per side (default 7)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (default 0)")
    p.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp dir)")
    return p.parse_args()


def make_data(root: Path, rows: int, seq_len: int, shard_size: str) -> np.ndarray:
    """Random uint16 rows as a .npy memmap and as the MDS split mds/train (sample i = row i)."""
    tokens = np.lib.format.open_memmap(
        root / "tokens.npy", mode="w+", dtype=np.uint16, shape=(rows, seq_len)
    )
    rng = np.random.default_rng(0)
    for start in range(0, rows, 4096):
        stop = min(start + 4096, rows)
        tokens[start:stop] = rng.integers(0, 50_000, (stop - start, seq_len), dtype=np.uint16)
    tokens.flush()
    with MDSWriter(
        root / "mds" / "train", {"tokens": f"ndarray:uint16:{seq_len}"}, size_limit=shard_size
    ) as w:
        for row in tokens:
            w.write({"tokens": row})
    return np.load(root / "tokens.npy", mmap_mode="r")


def memmap_batch(tokens: np.ndarray, ids: np.ndarray) -> dict[str, torch.Tensor]:
    """The trainer's batch of rows ``ids``, built as StreamingTextDataset builds it."""
    rows = tokens[ids]
    return {
        "input_ids": torch.from_numpy(rows.astype(np.int64)),
        "labels": torch.from_numpy(rows.astype(np.int64)),
    }


def time_memmap(tokens: np.ndarray, batches: list[np.ndarray], clock) -> tuple[float, int]:
    start, rows = clock(), 0
    for ids in batches:
        batch = memmap_batch(tokens, ids)
        rows += len(batch["input_ids"])
    return clock() - start, rows


def time_loader(loader: StreamingDataLoader, clock) -> tuple[float, int]:
    start, rows = clock(), 0
    for batch in loader:
        rows += len(batch["input_ids"])
    return clock() - start, rows


def main() -> int:
    args = parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-loader-"))
    root.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        tokens = make_data(root, args.rows, args.seq_len, args.shard_size)
        dataset = StreamingTextDataset(
            str(root / "mds"),
            split="train",
            shuffle=True,
            shuffle_seed=0,
            shuffle_block_size=args.block_size,
            batch_size=args.batch_size,
            max_seq_len=args.seq_len,
        )
        loader = StreamingDataLoader(dataset, num_workers=args.num_workers)
        batches = [
            ids for ids, _ in dataset.batches()
        ]  # the loader's exact order, for the memmap side
        for ours, ids in zip(loader, batches, strict=True):  # also warms both sides' pages
            want = memmap_batch(tokens, ids)
            if ours.keys() != want.keys() or not all(torch.equal(ours[k], want[k]) for k in want):
                raise SystemExit("the two sides' batches differ; benchmark invalid")
        shards = len(dataset.caches[0].shards)
        print(
            f"{args.rows} rows x {args.seq_len} tokens (uint16), {shards} shards, batch "
            f"{args.batch_size}, shuffle block {dataset.shuffle_block_size}, "
            f"num_workers {args.num_workers}; data written in {time.perf_counter() - t0:.1f}s"
        )
        # Workers burn CPU in other processes, so only a single-process run can use CPU time.
        clock = time.process_time if args.num_workers == 0 else time.perf_counter
        memmap_times, loader_times = [], []
        for _ in range(args.rounds):
            for side, times in ((0, memmap_times), (1, loader_times)):
                seconds, rows = (
                    time_memmap(tokens, batches, clock) if side == 0 else time_loader(loader, clock)
                )
                if rows != args.rows:
                    raise SystemExit(f"read {rows} rows, expected {args.rows}")
                times.append(seconds)
        memmap_rate, loader_rate = args.rows / min(memmap_times), args.rows / min(loader_times)
        paired = statistics.median(m / t for m, t in zip(memmap_times, loader_times, strict=True))
        print(f"numpy memmap        : {memmap_rate:12,.0f} samples/s (best round)")
        print(f"StreamingDataLoader : {loader_rate:12,.0f} samples/s (best round)")
        print(f"ratio of best rounds: {loader_rate / memmap_rate:12.2f}x  (target >= 0.70x)")
        print(f"median round ratio  : {paired:12.2f}x")
        cores = "one core" if args.num_workers == 0 else f"{args.num_workers} workers"
        print(f"tokens/s ({cores})  : {loader_rate * args.seq_len:12,.0f}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
