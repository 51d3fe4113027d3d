"""Checkpoints with four DDP processes (gloo, CPU): each rank saves and restores its own RNG,
and a resumed run is bitwise the uninterrupted one.

Four, not two: two ranks' gradients sum alike in any order (a + b == b + a), four do not, so
only there does a gradient bucket laid out differently after a resume (DDP rebuilds its
buckets after the first step, in the order gradients became ready) change the weights.
"""

import json

import torch
import torch.multiprocessing as mp

from llmfoundry.checkpoint import read_latest
from tests.conftest import free_port

from .ddp_worker import rank_main

WORLD = 4


def test_four_ranks_stop_and_resume_bitwise(tmp_path):
    ports = [free_port() for _ in range(3)]
    mp.spawn(rank_main, args=(WORLD, ports, str(tmp_path)), nprocs=WORLD, join=True)
    folder = tmp_path / "resumed"
    assert read_latest(str(folder)) == "ep1-ba5"
    files = sorted(p.name for p in (folder / "ep0-ba3").iterdir())
    rng_files = [f"rng-rank{r}.pt" for r in range(WORLD)]
    assert files == ["manifest.json", "model.safetensors", *rng_files, "state.pt"]
    # rank 0's manifest lists every rank's files
    listed = json.loads((folder / "ep0-ba3" / "manifest.json").read_text())["files"]
    assert sorted(listed) == files[1:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for result in results:  # every step's (global) loss, exactly, and this rank's sample ids
        assert result["resumed"] == result["straight"]
        assert result["weights"].keys() == result["straight_weights"].keys()
        for name, weight in result["weights"].items():
            assert torch.equal(weight, result["straight_weights"][name]), name
    # Each rank has its own generator states (seeded seed + rank), restored to that rank.
    rng = [torch.load(folder / "ep0-ba3" / name, weights_only=True) for name in rng_files]
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])
