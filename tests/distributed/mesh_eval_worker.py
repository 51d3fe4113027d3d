"""Bodies of the four-process mesh evaluation tests (spawned children import them by module
path): one spawn scores the same requests under every mesh in a row, a fresh process group
each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from llmfoundry.distributed import FSDP, SingleDevice, Strategy
from llmfoundry.eval.forward import mesh_forward
from llmfoundry.eval.scoring import Continuation, Forward, ModelForward, score_continuations
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM

from .spawn import join_env

WORLD = 4
# name -> FSDP options; every mesh is 4 processes (the rest of them data-parallel).
MESHES = {
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "tp2_pp2": {"tp": 2, "pp": 2},
    "fsdp": {},
}
SEED = 3
MAX_SEQ_LEN = 64
# Continuations of odd and even lengths (tp=2 pads the odd ones), in batches of 2 rows and a
# last one of 1 (the pipeline pads rows too).
REQUESTS = [
    Continuation([1, 2, 3, 4, 5], [6, 7]),
    Continuation([9] * 11, [3]),
    Continuation([5, 4], [1, 2, 3]),
    Continuation(list(range(10, 40)), [40, 41, 42, 43]),
    Continuation([7], [8]),
]


def tiny_mpt() -> MPTForCausalLM:
    """On meta (the strategy initializes it): 4 query and 2 key/value heads, so tp=2 splits
    both; 2 blocks, so pp=2 has one a stage."""
    config = MPTConfig(
        d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, vocab_size=64, max_seq_len=MAX_SEQ_LEN,
        init_device="meta",
    )  # fmt: skip
    return MPTForCausalLM(config)


def prepared(strategy: Strategy) -> torch.nn.Module:
    """`tiny_mpt` as `strategy` prepares it, with one process's weights for `SEED` (every
    strategy initializes the whole tensors from the same generator state)."""
    torch.manual_seed(SEED)
    return strategy.prepare(tiny_mpt())


def evaluation(forward: Forward) -> dict[str, Any]:
    """What the tests compare between one process and each mesh."""
    scored = score_continuations(forward, REQUESTS, MAX_SEQ_LEN, batch_size=2)
    return {"scores": [(s.logprob, s.greedy) for s in scored]}


def one_process() -> dict[str, Any]:
    return evaluation(ModelForward(prepared(SingleDevice("cpu"))))


def rank_main(rank: int, world: int, ports: list[int], out: str) -> None:
    result = {}
    for (name, options), port in zip(MESHES.items(), ports, strict=True):
        join_env(rank, world, port)
        strategy = FSDP("cpu", timeout_s=60, **options)
        strategy.setup()
        try:
            result[name] = evaluation(mesh_forward(prepared(strategy), strategy))
        finally:
            strategy.teardown()
            # DTensor caches layouts by mesh shape; the next mesh's process groups are new.
            _clear_sharding_prop_cache()
    torch.save(result, Path(out) / f"rank{rank}.pt")
