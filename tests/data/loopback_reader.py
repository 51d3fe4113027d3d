"""One rank of the two-node loopback test (test_streaming_s3.py), started by torchrun.

Reads one epoch of ``url`` through StreamingTextDataset and StreamingDataLoader with the node's
cache folder ``cache``, and writes what it asked S3 for to ``out/rank<RANK>.json``: its S3
calls while building the dataset (metadata) and the shards it downloaded.
"""

import json
import os
import sys
from pathlib import Path

import s3fs

from llmfoundry.data import StreamingTextDataset
from llmfoundry.data.streaming import StreamingDataLoader
from llmfoundry.data.streaming.cache import ShardCache


def main() -> None:
    url, cache, out = sys.argv[1:4]
    calls: list[str] = []
    fetched: list[str] = []
    call_s3, fetch = s3fs.S3FileSystem._call_s3, ShardCache._fetch

    async def counting_call(fs, method, *args, **kwargs):
        calls.append(method)
        return await call_s3(fs, method, *args, **kwargs)

    def counting_fetch(self, j):
        fetched.append(self.shards[j].raw_basename)
        return fetch(self, j)

    s3fs.S3FileSystem._call_s3 = counting_call
    ShardCache._fetch = counting_fetch
    ds = StreamingTextDataset(url, cache, split="train", shuffle=True, batch_size=4)
    metadata = list(calls)
    rows = sum(len(batch["input_ids"]) for batch in StreamingDataLoader(ds))
    record = {
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "metadata_calls": metadata,
        "fetched": fetched,
        "rows": rows,
        "canonical_nodes": ds.canonical_nodes,
    }
    Path(out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
