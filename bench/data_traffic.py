"""Object-store traffic of one training epoch on N nodes x 8 ranks, through the real loader.

A dataset is made by our data_prep (text_to_tokens, then tokens_to_mds straight onto S3) on a
local moto S3 server (``moto_server``, 127.0.0.1). Then, for each node count N, every rank of
every node gets its own ``StreamingTextDataset`` and ``StreamingDataLoader`` (in this process,
as torchrun would start them: node ``n``'s ranks share the node's own cache folder, and its
local rank 0 is the one that fetches the metadata), and all ranks step through one epoch in
lockstep, reading every batch. Counted per node: the shard bytes it downloaded (over the
dataset's bytes), its requests to S3 (each boto call, metadata included) and its downloads per
distinct shard; with no cache limit, and with a per-node ``cache_limit`` of what the node reads
at once (a shuffle block's shards plus the predownload window: ``StreamingDataset.working_set``,
the size the start warning recommends). The global order (the concatenation over ranks of
every step's batches, here its SHA-256) must be identical for every N.

Every N uses the same canonical node count (``--canonical-nodes``, default the largest N) and
the same global batch, which is what makes the order independent of N.

    nice python bench/data_traffic.py                              # 300 shards, N = 1..32
    nice python bench/data_traffic.py --shards 1000 --nodes 1 32
    nice python bench/data_traffic.py --cache-limit none           # without the limited runs
    nice python bench/data_traffic.py --canonical-nodes 1 --nodes 32 --cache-limit none
                                                    # the old partition: every node, every shard
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from llmfoundry.data import StreamingTextDataset
from llmfoundry.data.mds import ShardInfo, load_index
from llmfoundry.data.prep.text_to_tokens import text_to_tokens
from llmfoundry.data.prep.tokens_to_mds import tokens_to_mds
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.data.streaming.cache import ShardCache
from llmfoundry.data.streaming.epochs import EpochDataset

RANKS_PER_NODE = 8
BUCKET = "bench"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shards", type=int, default=300, help="train shards to write (default 300)")
    p.add_argument("--samples-per-shard", type=int, default=70, help="rows per shard (default 70)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per row (default 64)")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="node counts")
    p.add_argument(
        "--canonical-nodes", type=int, default=None, help="C for every N (default: max N)"
    )
    p.add_argument("--global-batch", type=int, default=512, help="samples per step (512)")
    p.add_argument(
        "--block-size", type=int, default=None, help="shuffle block (default: the dataset's)"
    )
    p.add_argument(
        "--cache-limit",
        default="working-set",
        help="per-node cache_limit of the limited runs: 'working-set' (default: the node's "
        "working set, a block's shards plus the window), bytes, or 'none' to skip them",
    )
    p.add_argument("--dir", type=Path, default=None, help="work folder (default: a temp dir)")
    return p.parse_args()


def start_moto(root: Path) -> tuple[subprocess.Popen, str]:
    exe = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "moto.log", "w")  # noqa: SIM115 (lives as long as the server)
    server = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, url
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit(f"moto_server did not start on {url} (see {root / 'moto.log'})")


def write_text(folder: Path, rows: int, seq_len: int) -> None:
    """Word-like synthetic documents, about enough bytes for ``rows`` rows of tokens."""
    rng = np.random.default_rng(0)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(3000)]
    folder.mkdir(parents=True, exist_ok=True)
    target = int(rows * seq_len * 2.2)  # a small BPE makes ~1.9 bytes of this text a token
    written, doc = 0, 0
    with open(folder / "corpus.txt", "w") as f:
        while written < target:
            text = " ".join(rng.choice(words, rng.integers(50, 400))) + "\n\n"
            f.write(text)
            written += len(text)
            doc += 1


def make_dataset(root: Path, args: argparse.Namespace) -> tuple[str, list[ShardInfo]]:
    """Write the dataset to s3://bench/ds with about ``--shards`` train shards; returns its URL
    and the train split's index."""
    rows = args.shards * args.samples_per_shard
    write_text(root / "text", rows, args.seq_len)
    tokens = root / "tokens" / "corpus.bin"
    text_to_tokens(
        [str(root / "text")], tokens, train_tokenizer=True, vocab_size=1024, progress=False
    )
    total = np.memmap(tokens, dtype=np.uint16, mode="r").shape[0]
    usable = total // args.seq_len
    if usable < rows:
        raise SystemExit(f"the synthetic corpus gave {usable} rows, fewer than {rows}")
    # Calibrate the size limit locally so the shard count is what was asked for.
    limit = args.samples_per_shard * (args.seq_len * 2 + 4) + 64
    for _ in range(6):
        probe = root / "probe"
        shutil.rmtree(probe, ignore_errors=True)
        tokens_to_mds(tokens, str(probe), args.seq_len, size_limit=limit, progress=False)
        got = len(load_index(probe / "train"))
        if abs(got - args.shards) <= max(1, 0.01 * args.shards):
            break
        limit = int(limit * got / args.shards)
    url = f"s3://{BUCKET}/ds"
    tokens_to_mds(tokens, url, args.seq_len, size_limit=limit, progress=False)
    shards = load_index(probe / "train")
    return url, shards


class Counts:
    """Per node: S3 calls by phase (building the datasets: metadata; reading: shards), shard
    downloads and their stored bytes."""

    current: Counts | None = None

    def __init__(self) -> None:
        self.phase = "metadata"
        self.calls: dict[str, Counter[int]] = defaultdict(Counter)
        self.downloads: dict[int, Counter[int]] = defaultdict(Counter)
        self.bytes: Counter[int] = Counter()

    @staticmethod
    def install() -> None:
        """Count every S3 call and shard download of this process into ``Counts.current``."""
        import s3fs

        call_s3 = s3fs.S3FileSystem._call_s3
        fetch = ShardCache._fetch

        async def counting_call(fs, method, *a, **kw):
            node = fs.config_kwargs.get("user_agent_extra", "")
            if Counts.current is not None and node.startswith("node-"):
                Counts.current.calls[Counts.current.phase][int(node[5:])] += 1
            return await call_s3(fs, method, *a, **kw)

        def counting_fetch(cache, j):
            counts = Counts.current
            if counts is not None and cache.local.parent.name.startswith("node"):
                node = int(cache.local.parent.name.removeprefix("node"))
                counts.downloads[node][j] += 1
                info = cache.shards[j]
                counts.bytes[node] += (info.zip_data or info.raw_data).bytes
            return fetch(cache, j)

        s3fs.S3FileSystem._call_s3 = counting_call
        ShardCache._fetch = counting_fetch


def run(
    url: str, root: Path, nodes: int, args: argparse.Namespace, limit: str | None, counts: Counts
) -> tuple[str, list[int] | None]:
    """One epoch on ``nodes`` x 8 ranks; returns the global order's hash and per-node limits."""
    world = nodes * RANKS_PER_NODE
    per_rank = args.global_batch // world
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(RANKS_PER_NODE))
    common = dict(
        split="train",
        shuffle=True,
        batch_size=per_rank,
        shuffle_block_size=args.block_size,
        canonical_nodes=args.canonical_nodes,
    )
    limits: list[int] | None = None
    if limit == "working-set":  # what each node reads at once, from a probe (not counted)
        os.environ["LOCAL_RANK"] = "0"
        limits = []
        for n in range(nodes):
            probe = StreamingTextDataset(
                url, str(root / "probe-cache"), data_parallel=(n * RANKS_PER_NODE, world), **common
            )
            limits.append(probe.working_set())
    counts.phase = "metadata"
    loaders = []
    for n in range(nodes):
        options = {"config_kwargs": {"user_agent_extra": f"node-{n}"}}
        node_limit = limits[n] if limits is not None else (int(limit) if limit else None)
        for local in range(RANKS_PER_NODE):
            os.environ["LOCAL_RANK"] = str(local)  # local rank 0 fetches the metadata
            ds = StreamingTextDataset(
                url,
                str(root / f"node{n}"),
                data_parallel=(n * RANKS_PER_NODE + local, world),
                storage_options=options,
                cache_limit=node_limit,
                **common,
            )
            loaders.append(StreamingDataLoader(ds))
    counts.phase = "read"
    # The rows each rank's loader delivers, at the global positions its plan gives them (the
    # dataset's batches without predownload: pure, no I/O); the last step's padding repeats
    # depend on N and are left out, so the check is on positions 0 .. epoch_size - 1.
    plans = [EpochDataset.batches(loader.streaming_dataset) for loader in loaders]
    iterators = [iter(loader) for loader in loaders]
    epoch_size = loaders[0].streaming_dataset.epoch_size
    rows = np.zeros((epoch_size, args.seq_len), np.int64)
    seen = np.zeros(epoch_size, np.int64)
    active = True
    while active:
        active = False
        for it, plan in zip(iterators, plans, strict=True):  # one step: every rank's batch
            batch = next(it, None)
            if batch is not None:
                active = True
                _, positions = next(plan)
                real = positions < epoch_size
                rows[positions[real]] = batch["input_ids"].numpy()[real]
                seen[positions[real]] += 1
    if not (seen == 1).all():
        raise SystemExit(f"{nodes} nodes: positions read {set(seen.tolist())} times, not once")
    return hashlib.sha256(rows.tobytes()).hexdigest(), limits


def main() -> None:
    args = parse_args()
    if args.canonical_nodes is None:
        args.canonical_nodes = max(args.nodes)
    bad = [
        n
        for n in args.nodes
        if (args.canonical_nodes > 1 and args.canonical_nodes % n) or args.global_batch % (8 * n)
    ]
    if bad:
        raise SystemExit(
            f"node counts {bad} must divide --canonical-nodes {args.canonical_nodes} (unless 1) and "
            f"--global-batch {args.global_batch} / 8"
        )
    root = Path(args.dir or tempfile.mkdtemp(prefix="data_traffic-"))
    root.mkdir(parents=True, exist_ok=True)
    server, endpoint = start_moto(root)
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    try:
        import s3fs

        s3fs.S3FileSystem().mkdir(BUCKET)
        Counts.install()
        started = time.monotonic()
        url, index = make_dataset(root, args)
        data_bytes = sum((s.zip_data or s.raw_data).bytes for s in index)
        rows = sum(s.samples for s in index)
        print(
            f"dataset: {len(index)} train shards, {data_bytes / 2**20:.1f} MiB stored, "
            f"{rows} rows of {args.seq_len} tokens ({rows / len(index):.0f} per shard); C = "
            f"{args.canonical_nodes}, global batch {args.global_batch}, {RANKS_PER_NODE} ranks "
            f"per node (made in {time.monotonic() - started:.0f} s)",
            flush=True,
        )
        limits = [None] if args.cache_limit == "none" else [None, args.cache_limit]
        print(
            "| cache limit per node | N | total shard bytes / dataset | per node: bytes / "
            "dataset (min-max) | requests per node (min-max) | metadata requests per node | "
            "downloads per shard per node (max) | ranks that went over the limit | global order |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
        reference = None
        for limit in limits:
            for nodes in args.nodes:
                counts = Counts.current = Counts()
                shutil.rmtree(root / "caches", ignore_errors=True)
                t0 = time.monotonic()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    digest, node_limits = run(url, root / "caches", nodes, args, limit, counts)
                over = sum("over cache_limit" in str(w.message) for w in caught)
                reference = reference or digest
                per_node = [counts.bytes[n] / data_bytes for n in range(nodes)]
                metadata = [counts.calls["metadata"][n] for n in range(nodes)]
                requests = [m + counts.calls["read"][n] for n, m in enumerate(metadata)]
                repeats = [
                    sum(d.values()) / max(len(d), 1)
                    for d in (counts.downloads[n] for n in range(nodes))
                ]
                shown = (
                    "none"
                    if node_limits is None
                    else f"{np.mean(node_limits) / 2**20:.2f} MiB ({np.mean(node_limits) / data_bytes:.0%})"
                )
                print(
                    f"| {shown} | {nodes} | {sum(per_node):.3f} | {min(per_node):.3f}-"
                    f"{max(per_node):.3f} | {min(requests)}-{max(requests)} | "
                    f"{min(metadata)}-{max(metadata)} | {max(repeats):.3f} | {over} | "
                    f"{'same' if digest == reference else 'DIFFERENT'} |",
                    flush=True,
                )
                print(f"  ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        server.terminate()
        server.wait(10)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
