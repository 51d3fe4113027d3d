"""Checkpoints with two DDP processes (gloo, CPU): each rank saves and restores its own RNG."""

import json

import torch
import torch.multiprocessing as mp

from llmfoundry.checkpoint import read_latest
from tests.conftest import free_port

from .ddp_worker import rank_main

WORLD = 2


def test_two_ranks_stop_and_resume_exactly(tmp_path):
    ports = [free_port() for _ in range(3)]
    mp.spawn(rank_main, args=(WORLD, ports, str(tmp_path)), nprocs=WORLD, join=True)
    folder = tmp_path / "resumed"
    assert read_latest(str(folder)) == "ep1-ba5"
    files = sorted(p.name for p in (folder / "ep0-ba3").iterdir())
    assert files == [
        "manifest.json",
        "model.safetensors",
        "rng-rank0.pt",
        "rng-rank1.pt",
        "state.pt",
    ]
    # rank 0's manifest lists every rank's files
    listed = json.loads((folder / "ep0-ba3" / "manifest.json").read_text())["files"]
    assert sorted(listed) == files[1:]
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for result in results:  # every step's (global) loss and this rank's sample ids
        assert result["resumed"] == result["straight"]
    # Each rank has its own generator states (seeded seed + rank), restored to that rank.
    rng = [torch.load(folder / "ep0-ba3" / f"rng-rank{r}.pt", weights_only=True) for r in range(2)]
    assert not torch.equal(rng[0]["torch"], rng[1]["torch"])
