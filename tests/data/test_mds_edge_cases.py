"""MDS edge cases (issue 13.12): byte order, 4 GiB shards, compressed local data, JPEG bytes,
shards deleted while mapped."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from llmfoundry.data.mds import MDSWriter, get_encoding
from llmfoundry.data.streaming import StreamingDataset
from llmfoundry.data.streaming import reader_pool as reader_pool_mod

SEQ = 8


def write_mds(folder: Path, n: int, **kwargs) -> None:
    columns = {"id": "int", "tokens": f"ndarray:uint16:{SEQ}"}
    with MDSWriter(folder, columns, size_limit=300, **kwargs) as writer:
        for i in range(n):
            writer.write({"id": i, "tokens": (np.arange(SEQ) + i).astype(np.uint16)})


@pytest.fixture
def temp_dir(tmp_path, monkeypatch) -> Path:
    """The system temp dir, moved under tmp_path (default caches live there)."""
    folder = tmp_path / "systemp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.parametrize("name", ["ndarray", "ndarray:int32", "ndarray:int32:3", "ndarray::3"])
def test_big_endian_arrays_are_stored_little_endian(name):
    values = np.array([1, 256, -70000], dtype=">i4")
    coder = get_encoding(name)
    back = coder.decode(coder.encode(values))
    assert back.tolist() == [1, 256, -70000]
    assert coder.encode(values) == coder.encode(values.astype("<i4"))


def test_size_limit_of_4gib_or_more_is_refused_at_once(tmp_path):
    columns = {"x": "int"}
    for limit in (1 << 32, "4gb", "5gb"):
        with pytest.raises(ValueError, match="size_limit=.* 4 GiB"):
            MDSWriter(tmp_path / "o", columns, size_limit=limit)
    assert not (tmp_path / "o").exists()
    MDSWriter(tmp_path / "ok", columns, size_limit=(1 << 32) - 1).finish()


def test_compressed_local_dataset_reads_without_a_cache_folder(tmp_path, temp_dir):
    data = tmp_path / "mds"
    write_mds(data / "train", 30, compression="zstd")
    before = sorted(p.name for p in (data / "train").iterdir())
    for ds in (
        StreamingDataset(str(data), split="train"),
        StreamingDataset(local=str(data), split="train"),
        StreamingDataset(str(data), str(data), split="train"),
    ):
        assert sorted(int(s["id"]) for s in ds) == list(range(30))
    assert sorted(p.name for p in (data / "train").iterdir()) == before  # never written
    assert list(temp_dir.rglob("shard.00000.mds"))  # decompressed into the temp dir


def test_jpeg_from_a_jpeg_file_keeps_its_bytes(tmp_path):
    image = pytest.importorskip("PIL.Image")
    path = tmp_path / "x.jpg"
    rng = np.random.default_rng(0)
    image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(path, quality=93)
    with image.open(path) as img:
        assert get_encoding("jpeg").encode(img) == path.read_bytes()
    # an image not read from a JPEG file is encoded at the encoding's quality
    fresh = image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8))
    assert get_encoding("jpeg").decode(get_encoding("jpeg").encode(fresh)).size == (16, 16)


def test_a_cached_shard_deleted_while_mapped_is_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setattr(reader_pool_mod, "_TOUCH_EVERY_S", 0.0)
    write_mds(tmp_path / "remote", 30)
    cache = tmp_path / "cache"
    ds = StreamingDataset(str(tmp_path / "remote"), str(cache))  # no cache limit
    assert ds[0]["id"] == 0
    shard = cache / "shard.00000.mds"
    shard.unlink()  # e.g. evicted by another process sharing the cache
    assert ds[1]["id"] == 1
    assert shard.is_file()  # fetched again instead of reading the deleted mapping forever
