"""Checkpoints on a real S3 API (a moto server on 127.0.0.1): save, prune, fail mid-save, load."""

import fsspec
import pytest
import torch

from llmfoundry.callbacks import CheckpointSaver
from llmfoundry.checkpoint import read_latest

from ..trainer.conftest import token_batches
from .helpers import Batches
from .test_checkpoint import FailOnce, make_trainer

pytest.importorskip("s3fs")


def test_save_prune_fail_and_resume_on_s3(s3_env, monkeypatch, tmp_path):
    # The endpoint comes from the environment (s3_env), as for MinIO or R2 in production.
    fs, _ = fsspec.core.url_to_fs("s3://ckpt-bucket", skip_instance_cache=True)
    fs.mkdir("ckpt-bucket")
    url = "s3://ckpt-bucket/runs/a/checkpoints"

    FailOnce(monkeypatch, "state.pt", at_save=4)
    saver = CheckpointSaver(url, save_interval="1ba", num_checkpoints_to_keep=2)
    trainer = make_trainer(tmp_path, Batches(token_batches(5, 2)), saver=saver)
    with pytest.raises(OSError, match="injected"):
        trainer.fit()
    assert read_latest(url) == "ep0-ba3"
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False))
    # ep0-ba1 pruned; ep0-ba4 failed before its upload began, so nothing of it is there.
    assert names == ["ep0-ba2", "ep0-ba3", "latest"]

    saver = CheckpointSaver(url, num_checkpoints_to_keep=1)
    resumed = make_trainer(tmp_path, Batches(token_batches(5, 2)), saver=saver, load_path=url)
    assert resumed.state.timestamp.batch == 3
    saved = torch.load(
        fs.open(f"{url}/ep0-ba3/rng-rank0.pt", "rb"), weights_only=True, map_location="cpu"
    )
    assert set(saved) >= {"python", "numpy", "torch"}
    resumed.fit()
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url, detail=False)) == ["ep1-ba5", "latest"]
