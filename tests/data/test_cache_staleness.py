"""A warm cache never serves shards of an older version of its remote (issue 13.3).

The remote is rewritten in place with rows of the same size, so the index (without hashes) is
byte-identical: only the store's version of each object (mtime, ETag) tells the copies apart.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmfoundry.data.mds import MDSWriter, load_index
from llmfoundry.data.prep import tokens_to_mds
from llmfoundry.data.streaming import StreamingDataset

SEQ = 8


def write(out, offset: int, **kwargs) -> None:
    with MDSWriter(out, {"tokens": f"ndarray:uint16:{SEQ}"}, size_limit=200, **kwargs) as w:
        for i in range(24):
            w.write({"tokens": (np.arange(SEQ) + i + offset).astype(np.uint16)})


def firsts(ds) -> list[int]:
    return sorted(int(s["tokens"][0]) for s in ds)


@pytest.mark.parametrize("hashes", [(), ("xxh64",)])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_rewritten_local_remote_is_refetched(tmp_path, hashes, compression):
    remote, cache = str(tmp_path / "remote"), str(tmp_path / "cache")
    write(remote, 0, hashes=hashes, compression=compression)
    assert firsts(StreamingDataset(remote, cache)) == list(range(24))  # warm cache
    write(remote, 100, hashes=hashes, compression=compression, exist_ok=True)
    assert firsts(StreamingDataset(remote, cache)) == list(range(100, 124))
    # an unchanged remote is not fetched again
    before = {p.name: p.stat().st_ino for p in (tmp_path / "cache").glob("shard.*")}
    assert firsts(StreamingDataset(remote, cache)) == list(range(100, 124))
    after = {p.name: p.stat().st_ino for p in (tmp_path / "cache").glob("shard.*")}
    assert before == after


def test_rewritten_s3_remote_is_refetched(s3_env, tmp_path):
    s3fs = pytest.importorskip("s3fs")
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("stale")
    url, cache = "s3://stale/ds", str(tmp_path / "cache")
    write(url, 0)
    assert firsts(StreamingDataset(url, cache)) == list(range(24))
    write(url, 100, exist_ok=True)
    assert firsts(StreamingDataset(url, cache)) == list(range(100, 124))
    s3fs.S3FileSystem.clear_instance_cache()


def test_data_prep_records_xxh64_by_default(tmp_path):
    from llmfoundry.data.prep import text_to_tokens

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world, " * 400)
    text_to_tokens(
        [str(corpus)], tmp_path / "t.bin", train_tokenizer=True, vocab_size=300, progress=False
    )
    tokens_to_mds(tmp_path / "t.bin", str(tmp_path / "mds"), 16, progress=False)
    assert all(s.hashes == ("xxh64",) for s in load_index(tmp_path / "mds" / "train"))
