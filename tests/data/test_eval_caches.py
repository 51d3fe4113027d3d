"""Where eval sets cache their shards: each ``eval_datasets`` entry in its own folder, never in
the main data's ``local`` (both hold a ``val/`` split, so sharing one folder would mix them)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from llmfoundry.data.mds import MDSWriter
from llmfoundry.data.streaming.stream import default_cache_dir
from tests.data.test_data_builder import loaders
from tests.data.test_streaming_text import L, token_rows, write_tokens


def _write_compressed(folder: Path, rows: np.ndarray) -> None:
    spec = {"tokens": f"ndarray:uint16:{rows.shape[1]}"}
    with MDSWriter(folder, spec, compression="zstd", size_limit=1 << 11) as writer:
        for row in rows:
            writer.write({"tokens": row.astype(np.uint16)})


def _rows(loader) -> torch.Tensor:
    return torch.cat([b["input_ids"] for b in loader])


def _shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("shard.*.mds"))


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_compressed_local_eval_sets_decompress_into_their_own_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))  # the default caches
    (tmp_path / "systemp").mkdir()
    main = tmp_path / "mds"
    write_tokens(main / "train", token_rows(20))
    write_tokens(main / "val", token_rows(6, start=500))
    code = tmp_path / "code"
    _write_compressed(code / "val", token_rows(40, start=2000))
    before = _tree(code)
    pinned = tmp_path / "code-cache"
    data = loaders(
        remote=str(main),
        eval_datasets={"code": str(code), "pinned": {"remote": str(code), "local": str(pinned)}},
    )
    want = torch.from_numpy(token_rows(40, start=2000))
    assert torch.equal(_rows(data.evals["code"]), want)
    assert torch.equal(_rows(data.evals["pinned"]), want)
    assert torch.equal(_rows(data.evals["val"]), torch.from_numpy(token_rows(6, start=500)))
    default = default_cache_dir(str(code)) / "val"
    assert default.is_relative_to(tmp_path / "systemp") and len(_shards(default)) > 1
    assert _shards(pinned / "val") == _shards(default)  # the entry's local, decompressed
    assert _tree(code) == before  # the data folder itself is never written


def test_s3_eval_set_caches_in_its_local_not_the_main_data_local(s3_env, tmp_path, monkeypatch):
    s3fs = pytest.importorskip("s3fs")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "systemp"))
    (tmp_path / "systemp").mkdir()
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir("evalcaches")
    spec = {"tokens": f"ndarray:uint16:{L}"}
    for url, rows in (
        ("s3://evalcaches/mds/train", token_rows(20)),
        ("s3://evalcaches/mds/val", token_rows(6, start=500)),
        ("s3://evalcaches/code/mds/val", token_rows(30, start=2000)),
    ):
        with MDSWriter(url, spec, size_limit=1 << 11) as writer:  # uploads
            for row in rows:
                writer.write({"tokens": row.astype(np.uint16)})
    main_cache, code_cache = tmp_path / "main-cache", tmp_path / "code-cache"
    data = loaders(
        remote="s3://evalcaches/mds",
        local=str(main_cache),
        eval_datasets={
            "code": {"remote": "s3://evalcaches/code/mds", "local": str(code_cache)},
            "bare": "s3://evalcaches/code/mds",  # no local: the remote's default cache
        },
    )
    code = torch.from_numpy(token_rows(30, start=2000))
    assert torch.equal(_rows(data.evals["code"]), code)
    assert torch.equal(_rows(data.evals["bare"]), code)
    assert torch.equal(_rows(data.evals["val"]), torch.from_numpy(token_rows(6, start=500)))
    code_shards = _shards(code_cache / "val")
    assert len(code_shards) > 1
    assert _shards(default_cache_dir("s3://evalcaches/code/mds") / "val") == code_shards
    fs = s3fs.S3FileSystem()
    for cache, url in ((main_cache, "evalcaches/mds/val"), (code_cache, "evalcaches/code/mds/val")):
        assert (cache / "val" / "index.json").read_bytes() == fs.cat(f"{url}/index.json")
    assert sorted(p.name for p in main_cache.iterdir()) == ["train", "val"]
    s3fs.S3FileSystem.clear_instance_cache()


def test_an_eval_set_given_the_main_data_local_is_refused_with_the_fix(tmp_path):
    main, code, cache = tmp_path / "mds", tmp_path / "code", tmp_path / "cache"
    write_tokens(main / "train", token_rows(20))
    write_tokens(main / "val", token_rows(6, start=500))
    write_tokens(code / "val", token_rows(6, start=2000))
    with pytest.raises(ValueError, match=r"data.eval_datasets.<label>.local for an eval set"):
        loaders(
            remote=str(main),
            local=str(cache),
            eval_datasets={"code": {"remote": str(code), "local": str(cache)}},
        )
