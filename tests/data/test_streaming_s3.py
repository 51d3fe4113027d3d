"""Streaming from a real S3 API: a moto server on 127.0.0.1, started and stopped by the test."""

from __future__ import annotations

import numpy as np
import pytest

from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.streaming import StreamingDataset

s3fs = pytest.importorskip("s3fs")
SEQ = 16


@pytest.fixture
def bucket(s3_endpoint, monkeypatch, tmp_path):
    """A fresh bucket holding an MDS dataset (zstd shards with hashes) under mds/train."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    options = {"endpoint_url": s3_endpoint}
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    name = f"bucket-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    fs.mkdir(name)
    local = tmp_path / "made"
    columns = {"id": "int", "tokens": f"ndarray:uint16:{SEQ}"}
    with MDSWriter(local, columns, compression="zstd", hashes=("xxh64",), size_limit=600) as w:
        for i in range(120):
            w.write({"id": i, "tokens": (np.arange(SEQ) + i).astype(np.uint16)})
    fs.put(str(local) + "/", f"{name}/mds/train/", recursive=True)
    fs.invalidate_cache()
    return f"s3://{name}/mds", options


def test_stream_from_s3_with_cache_limit_evicting_and_refetching(bucket, tmp_path):
    url, options = bucket
    cache = tmp_path / "cache"
    probe = StreamingDataset(url, str(tmp_path / "probe"), split="train", storage_options=options)
    largest = max(s.raw_data.bytes for s in probe.caches[0].shards)
    limit = 3 * largest
    ds = StreamingDataset(
        url,
        str(cache),
        split="train",
        shuffle=True,
        shuffle_block_size=20,
        cache_limit=limit,
        validate_hash="xxh64",
        storage_options=options,
        predownload=0,
    )
    assert ds[77]["id"] == 77  # random access pulls exactly one shard
    assert len(list((cache / "train").glob("shard.*"))) == 1
    seen = []
    for sample in ds:
        assert np.array_equal(sample["tokens"], np.arange(SEQ) + sample["id"])
        seen.append(int(sample["id"]))
    assert sorted(seen) == list(range(120))
    files = list((cache / "train").glob("shard.*"))
    assert 0 < sum(f.stat().st_size for f in files) <= limit
    assert all(f.suffix == ".mds" for f in files)
    evicted = next(j for j in range(len(ds.caches[0].shards)) if not ds.caches[0].present(j))
    first = int(np.flatnonzero(ds.locate(np.arange(120))[0] == evicted)[0])
    assert ds[first]["id"] == first  # fetched again from S3
    assert ds.caches[0].present(evicted)


def test_s3_missing_split_lists_the_splits(bucket, tmp_path):
    url, options = bucket
    with pytest.raises(FileNotFoundError, match=r"available splits .*\['train'\]"):
        StreamingDataset(url, str(tmp_path / "c"), split="val", storage_options=options)


def test_s3_endpoint_from_the_environment(s3_env, tmp_path):
    """No storage_options: credentials and endpoint come from AWS_* variables, as on a cluster."""
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("envbucket")
    columns = {"id": "int", "tokens": f"ndarray:uint16:{SEQ}"}
    with MDSWriter("s3://envbucket/ds/val", columns, size_limit=600) as w:  # uploads
        for i in range(30):
            w.write({"id": i, "tokens": (np.arange(SEQ) + i).astype(np.uint16)})
    ds = StreamingDataset("s3://envbucket/ds", str(tmp_path / "cache"), split="val")
    assert [int(s["id"]) for s in ds] == list(range(30))
    s3fs.S3FileSystem.clear_instance_cache()


def test_metadata_is_fetched_once_per_machine(bucket, tmp_path, monkeypatch):
    """Two machines x 3 local ranks: only each machine's local rank 0 asks S3 for index.json,
    the listing and meta.json; the others read its copy and agree with it."""
    from llmfoundry.data import StreamingTextDataset

    url, options = bucket
    s3 = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    s3.pipe(url.removeprefix("s3://") + "/meta.json", b'{"eos_id": 0, "vocab_size": 512}')
    calls: list[str] = []
    call_s3 = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        calls.append(method)
        return await call_s3(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    for node in range(2):
        requests, made = [], []
        for local_rank in range(3):
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            before = len(calls)
            made.append(
                StreamingTextDataset(
                    url, str(tmp_path / f"node{node}"), split="train", storage_options=options
                )
            )
            requests.append(calls[before:])
        assert requests[0] and requests[1:] == [[], []], requests
        assert all(ds.meta == {"eos_id": 0, "vocab_size": 512} for ds in made)
        assert all(ds.caches[0].shards == made[0].caches[0].shards for ds in made)
        assert all(ds.caches[0]._versions == made[0].caches[0]._versions for ds in made)
        assert made[0].caches[0]._versions  # the listing itself was shared, not skipped


@pytest.mark.slow
def test_two_nodes_on_loopback_fetch_each_shard_about_once(s3_env, tmp_path):
    """Two torchrun agents x 2 processes (c10d rendezvous on 127.0.0.1), each node with its own
    cache: together they download each train shard about once (the node-aware partition),
    and only each node's local rank 0 fetches the metadata."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.distributed.test_fsdp import free_port

    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("loopback")
    columns = {"id": "int", "tokens": f"ndarray:uint16:{SEQ}"}
    with MDSWriter("s3://loopback/mds/train", columns, size_limit=600) as w:
        for i in range(600):
            w.write({"id": i, "tokens": (np.arange(SEQ) + i).astype(np.uint16)})
    shards = len(s3fs.S3FileSystem().glob("loopback/mds/train/shard.*"))
    root = Path(__file__).resolve().parents[2]
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc_per_node=2",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={endpoint}",
                "--rdzv_id=data",
                "--max-restarts=0",
                str(root / "tests" / "data" / "loopback_reader.py"),
                "s3://loopback/mds",
                str(tmp_path / f"cache{agent}"),
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for agent in range(2)
    ]
    outputs = []
    try:
        outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(outputs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert sum(r["rows"] for r in ranks) >= 600 and {r["canonical_nodes"] for r in ranks} == {2}
    per_node = [[f for r in ranks if r["node"] == n for f in r["fetched"]] for n in range(2)]
    fetched = per_node[0] + per_node[1]
    assert set(fetched) == {f"shard.{i:05}.mds" for i in range(shards)}
    assert len(fetched) <= 1.1 * shards, (shards, [len(p) for p in per_node])
    assert all(len(p) < 0.7 * shards for p in per_node)  # each node about its half
    leaders = [r["metadata_calls"] for r in ranks if r["local_rank"] == 0]
    assert all(leaders) and [r["metadata_calls"] for r in ranks if r["local_rank"]] == [[], []]
