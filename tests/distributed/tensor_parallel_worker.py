"""Bodies of the four-process tensor-parallel tests (spawned children import them by module
path): one spawn runs every case in a row, a fresh process group each."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from llmfoundry.checkpoint.state import model_state_dict
from llmfoundry.distributed import FSDP, SingleDevice, Strategy
from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.models.qwen3 import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Callback, Trainer
from llmfoundry.utils.errors import UserError

from .sharded_worker import STOP_AT, Recorder, resume_run
from .spawn import join_env
from .workers import global_batches, rank_slice, uneven_eval_set

WORLD, TP = 4, 2


def tp_llama(tied: bool = False) -> LlamaForCausalLM:
    """Tiny, on meta (the Trainer initializes it after seeding); 4 query and 2 key/value heads,
    so tp=2 splits both."""
    config = LlamaConfig(
        d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=64, max_seq_len=16,
        tie_word_embeddings=tied, init_device="meta",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def tp_mpt() -> MPTForCausalLM:
    """Tiny MPT (ALiBi, tied head), on meta; 4 query and 2 key/value heads in its fused Wqkv,
    so tp=2 splits both and the column exchange moves pieces of q, k and v alike."""
    config = MPTConfig(
        d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, vocab_size=64, max_seq_len=16,
        init_device="meta",
    )  # fmt: skip
    return MPTForCausalLM(config)


def tp_mpt_llama_like() -> MPTForCausalLM:
    """Tiny MPT with what llm-foundry's Llama-like configs use: RoPE, RMSNorm, a GLU (its
    gate_proj split as up_proj) and an untied lm_head (split by vocabulary column)."""
    config = MPTConfig(
        d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, vocab_size=64, max_seq_len=16,
        alibi=False, rope=True, norm_type="rmsnorm", ffn_type="glu", ffn_act="silu",
        tie_word_embeddings=False, init_device="meta",
    )  # fmt: skip
    return MPTForCausalLM(config)


def tp_qwen3() -> Qwen3ForCausalLM:
    """Tiny Qwen3, on meta: heads 16 wide (d_model / n_heads is 8), each rank's two query heads
    and one key/value head normalised by the q/k norms every rank holds whole."""
    config = Qwen3Config(
        d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2, ffn_hidden_size=64,
        vocab_size=64, max_seq_len=16, init_device="meta",
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def tp_qwen2() -> Qwen2ForCausalLM:
    """Tiny Qwen2 (tied head), on meta: its q, k and v biases split with their columns."""
    config = Qwen2Config(
        d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_hidden_size=64, vocab_size=64,
        max_seq_len=16, tie_word_embeddings=True, init_device="meta",
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


MODELS = {
    "llama": tp_llama,
    "llama_tied": functools.partial(tp_llama, tied=True),
    "mpt": tp_mpt,
    "mpt_llama_like": tp_mpt_llama_like,
    "qwen3": tp_qwen3,
    "qwen2": tp_qwen2,
}
# The parity runs: name -> (FSDP options, model).
PARITY = {
    "tp2_dp2": ({"parallelism": {"tp": TP}}, "llama"),
    "tp2_dp2_tied_activation_checkpointing": (
        {"parallelism": {"tp": TP}, "activation_checkpointing": "full"},
        "llama_tied",
    ),
    # The Wqkv exchange runs again in the recomputed forward.
    "mpt_tp2_dp2_activation_checkpointing": (
        {"parallelism": {"tp": TP}, "activation_checkpointing": "full"},
        "mpt",
    ),
    "mpt_rope_rmsnorm_glu_untied_tp2_dp2": ({"parallelism": {"tp": TP}}, "mpt_llama_like"),
    "qwen3_tp2_dp2": ({"parallelism": {"tp": TP}}, "qwen3"),
    "qwen2_tp2_dp2": ({"parallelism": {"tp": TP}}, "qwen2"),
}
# The models whose tp=2 x dp=2 checkpoint is resumed on other meshes.
RESUMED = {"llama": tp_llama, "mpt": tp_mpt}


class HeadNorms(Callback):
    """The per-head q/k norm weights (Qwen3's) at the end of training, whole on rank 0."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def fit_end(self, state, logger) -> None:
        weights = model_state_dict(state.model)  # a collective under FSDP: every rank asks
        self.weights = {k: v.clone() for k, v in weights.items() if k.endswith("_norm.weight")}


def parity_run(
    strategy: Strategy, model: str, **kwargs: Any
) -> tuple[Recorder, dict[str, float], dict[str, torch.Tensor]]:
    """Three AdamW steps on the shared global batches (this data-parallel rank's slice), then
    an evaluation on them and on batches of 5 and 3 rows: the recorded steps, the eval metrics
    and the trained per-head q/k norm weights (Qwen3's: every tp rank holds them whole, so a
    gradient not summed over tp leaves each rank its own; AdamW's first steps move by lr *
    sign(gradient), so that shows here more than in the losses)."""
    batches = global_batches()
    recorder, head_norms = Recorder(), HeadNorms()
    own = rank_slice(batches, strategy.dp_rank, strategy.dp_size)
    state = Trainer(
        model=MODELS[model](),
        strategy=strategy,
        train_dataloader=own,
        eval_dataloaders={
            "train": own,
            "uneven": uneven_eval_set(strategy.dp_rank, strategy.dp_size),
        },
        max_duration=f"{len(batches)}ba",
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2),
        callbacks=[recorder, head_norms],
        run_dir=os.environ.get("TMPDIR", "/tmp"),
        **kwargs,
    ).fit()
    return recorder, dict(state.eval_metrics), head_norms.weights


def single_parity_run(model: str) -> tuple[Recorder, dict[str, float], dict[str, torch.Tensor]]:
    return parity_run(SingleDevice("cpu"), model)


def rank_main(rank: int, world: int, ports: list[int], out: str, mds: str) -> None:
    ports = iter(ports)
    result: dict[str, dict] = {}
    for name, (options, model) in PARITY.items():
        join_env(rank, world, next(ports))
        recorder, metrics, head_norms = parity_run(FSDP("cpu", timeout_s=60, **options), model)
        result[name] = {
            "losses": recorder.losses,
            "initial": recorder.initial,
            "eval": metrics,
            "head_norms": head_norms,
        }
    for family, build in RESUMED.items():
        for name, options, kwargs in (
            (f"{family}_tp2_dp2_saved", {"parallelism": {"tp": TP}}, {"stop_at": STOP_AT}),
            (f"{family}_dp4_from_tp2_dp2", {}, {"load": f"{out}/{family}_tp2_dp2_saved"}),
        ):
            join_env(rank, world, next(ports))
            recorder = resume_run(
                FSDP("cpu", timeout_s=60, **options), mds, f"{out}/{name}", model=build, **kwargs
            )
            result[name] = {"losses": recorder.losses, "ids": recorder.ids}
    # Auto-microbatching is refused (an OOM inside a block would strand its tp peers).
    join_env(rank, world, next(ports))
    strategy = FSDP("cpu", timeout_s=60, parallelism={"tp": TP})
    try:
        parity_run(strategy, "llama", device_train_microbatch_size="auto")
        result["auto_microbatching"] = {"error": ""}
    except UserError as err:
        result["auto_microbatching"] = {"error": str(err)}
    finally:
        strategy.teardown()
    # A sequence tp does not divide is refused on every rank before any collective.
    join_env(rank, world, next(ports))
    strategy = FSDP("cpu", timeout_s=60, parallelism={"tp": TP})
    try:
        strategy.setup()
        model = strategy.prepare(tp_mpt())
        model(torch.zeros(2, 15, dtype=torch.long))
        result["odd_sequence"] = {"error": ""}
    except UserError as err:
        result["odd_sequence"] = {"error": str(err)}
    finally:
        strategy.teardown()
    torch.save(result, Path(out) / f"rank{rank}.pt")
