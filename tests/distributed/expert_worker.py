"""Bodies of the four-process tests of expert parallelism (test_expert_parallel.py). One spawn
runs every case in a row, a fresh process group each: the MoE layer's dispatch and combine at
ep4 and at ep2 x efsdp2 against the one-process layer (outputs, input and weight gradients),
then the trainings.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from llmfoundry.algorithms import GradientClipping
from llmfoundry.distributed import FSDP, Strategy
from llmfoundry.distributed.expert import apply_ep
from llmfoundry.models.layers.moe import MoE, MoESpec
from llmfoundry.models.mixtral import MixtralConfig, MixtralForCausalLM
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Trainer
from tests.checkpoint.helpers import SEQ_LEN, VOCAB
from tests.trainer.conftest import token_batches

from .context_mesh_worker import Norms
from .sharded_worker import STOP_AT, Recorder, resume_run
from .spawn import join_env
from .workers import global_batches

WORLD = 4
D_MODEL, ROWS = 16, 6
# Eight experts, two per token: at ep4 each rank holds two, at ep2 four.
LAYER = MoESpec(n_experts=8, top_k=2, expert_hidden=8)
LAYER_EP = (4, 2)


def moe_layer() -> MoE:
    """The MoE layer every rank and the one process build alike."""
    torch.manual_seed(0)
    return MoE(D_MODEL, LAYER)


def layer_inputs(world: int = WORLD) -> list[torch.Tensor]:
    """Each rank's [1, ROWS, d] tokens: 12 copies over 8 experts, so the splits differ between
    ranks and some experts get none from a rank."""
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(1, ROWS, D_MODEL, generator=generator) for _ in range(world)]


def layer_run(layer: MoE, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Forward `x`, backward of the outputs' summed squares (a sum over tokens, so the ranks'
    parts add up to the whole's): the output, the input's and the weights' gradients (the
    experts' as this rank holds them)."""
    x = x.clone().requires_grad_()
    out = layer(x)
    out.square().sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in grads.items()}
    return {"out": out.detach(), "x_grad": x.grad, **{f"grad.{k}": v for k, v in local.items()}}


def layer_case(rank: int, ep: int) -> dict[str, torch.Tensor]:
    """This rank's run of the layer with its experts split over `ep` ranks (FSDP's mesh laid
    out for them, ep borrowed from the four dp_shard ranks)."""
    strategy = FSDP("cpu", timeout_s=60, parallelism={"ep": ep})
    strategy.setup()
    try:
        layer = moe_layer()
        apply_ep(layer.experts, strategy.mesh.ep_mesh)
        return layer_run(layer, layer_inputs()[rank])
    finally:
        strategy.teardown()


# --- trainings -------------------------------------------------------------------------------


def tiny_mixtral() -> MixtralForCausalLM:
    """Tiny, on meta (the Trainer initializes it after seeding): 4 query and 2 key/value heads
    (tp=2 splits both), and in each of its two blocks four experts (so ep4 holds one per rank),
    two per token. No load-balancing loss: each rank's is of its own tokens (as in
    transformers), not a part of the whole batch's, so no mesh would give one process's loss
    with it, expert parallelism or not."""
    config = MixtralConfig(
        d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, n_experts=4, top_k=2, expert_hidden=16,
        vocab_size=VOCAB, max_seq_len=SEQ_LEN, aux_loss_weight=0.0, init_device="meta",
    )  # fmt: skip
    return MixtralForCausalLM(config)


# name -> (FSDP options, Trainer options): the parity runs (three AdamW steps and an eval).
PARITY: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "ep2_dp2": ({"ep": 2}, {}),
    "ep4_every_2nd_block_checkpointed": ({"ep": 4, "activation_checkpointing": 2}, {}),
    "ep2_tp2_full_checkpointing": ({"ep": 2, "tp": 2, "activation_checkpointing": "full"}, {}),
    # ep4 over dp_shard 2 x cp 2: each ep group's tokens are the cp ranks' parts of sequences.
    "ep4_cp2": ({"ep": 4, "cp": 2}, {}),
    # One sample per microbatch: 1F1B needs at least pp of them (each rank's 4 rows).
    "ep2_pp2": ({"ep": 2, "pp": 2}, {"device_train_microbatch_size": 1}),
}


def fsdp(options: dict[str, Any]) -> FSDP:
    """FSDP with `options`, its mesh axes given as the parallelism block."""
    axes = {k: v for k, v in options.items() if k in ("ep", "cp", "tp", "pp")}
    rest = {k: v for k, v in options.items() if k not in axes}
    return FSDP("cpu", timeout_s=60, parallelism=axes, **rest)


def padded_eval_set(strategy: Strategy) -> list[dict[str, torch.Tensor]]:
    """Seven samples padded to eight (the last row masked out, as the streaming eval loaders
    pad), this data-parallel rank's rows: every rank of an ep group must run as many forwards
    as its peers, whose all-to-alls wait for it."""
    (batch,) = token_batches(1, 8, seed=4)
    batch["sample_mask"] = torch.arange(8) < 7
    return [
        {
            key: value.tensor_split(strategy.dp_size)[strategy.dp_rank]
            for key, value in batch.items()
        }
    ]


def parity_run(strategy: Strategy, **kwargs: Any) -> dict[str, Any]:
    """Three AdamW steps on the shared global batches (this data-parallel rank's slice), the
    gradient norm logged (clipping far above it), then an evaluation on them and on a padded
    batch: the losses, the norms and the eval metrics."""
    every = global_batches()
    recorder, norms = Recorder(), Norms()
    own = [
        {key: value.tensor_split(strategy.dp_size)[strategy.dp_rank] for key, value in b.items()}
        for b in every
    ]
    state = Trainer(
        model=tiny_mixtral(),
        strategy=strategy,
        train_dataloader=own,
        eval_dataloaders={"train": own, "padded": padded_eval_set(strategy)},
        max_duration=f"{len(every)}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2),
        callbacks=[recorder],
        loggers=[norms],
        algorithms=[GradientClipping(threshold=1e6)],
        run_dir=os.environ.get("TMPDIR", "/tmp"),
        **kwargs,
    ).fit()
    return {"losses": recorder.losses, "norms": norms.norms, "eval": dict(state.eval_metrics)}


def rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    ports = iter(ports)
    result: dict[str, dict] = {}
    for ep in LAYER_EP:
        join_env(rank, world, next(ports))
        result[f"layer_ep{ep}"] = layer_case(rank, ep)
    for name, (options, kwargs) in PARITY.items():
        join_env(rank, world, next(ports))
        result[name] = parity_run(fsdp(options), **kwargs)
    # A DCP checkpoint saved at ep2 x dp2 on the real data pipeline, resumed at ep4 x tp... (and
    # in one process by the test).
    for name, options, kwargs in (
        ("ep2_dp2_saved", {"ep": 2}, {"stop_at": STOP_AT}),
        ("ep4_from_ep2_dp2", {"ep": 4}, {"load": f"{out}/ep2_dp2_saved"}),
    ):
        join_env(rank, world, next(ports))
        recorder = resume_run(fsdp(options), mds, f"{out}/{name}", model=tiny_mixtral, **kwargs)
        result[name] = {"losses": recorder.losses}
    torch.save(result, Path(out) / f"rank{rank}.pt")
