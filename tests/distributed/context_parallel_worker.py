"""Bodies of the four-process context-parallel tests (spawned children import them by module
path): one spawn runs every case in a row, a fresh process group each."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

from llmfoundry.distributed import FSDP, SingleDevice, Strategy
from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.optim import DecoupledAdamW
from llmfoundry.trainer import Callback, Trainer
from llmfoundry.utils.errors import UserError

from .spawn import join_env

WORLD, BATCH, SEQ_LEN, VOCAB = 4, 4, 16, 64


def cp_mpt(**overrides: Any) -> MPTForCausalLM:
    """Tiny MPT (ALiBi, tied head) on meta; 4 query heads and 2 key/value heads, so only the
    kv heads are gathered."""
    config = MPTConfig(
        d_model=32, n_heads=4, kv_n_heads=2, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ_LEN,
        init_device="meta", **overrides,
    )  # fmt: skip
    return MPTForCausalLM(config)


def cp_llama() -> LlamaForCausalLM:
    """Tiny Llama (RoPE, untied head) on meta, 4 query and 2 key/value heads."""
    config = LlamaConfig(
        d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, vocab_size=VOCAB, max_seq_len=SEQ_LEN,
        init_device="meta",
    )  # fmt: skip
    return LlamaForCausalLM(config)


MODELS = {"mpt": cp_mpt, "llama": cp_llama}
# The parity runs: name -> (cp, model). On four processes cp=2 leaves two data-parallel ranks.
PARITY = {"mpt_cp2_dp2": (2, "mpt"), "llama_cp2_dp2": (2, "llama"), "mpt_cp4": (4, "mpt")}


def global_batches() -> list[dict[str, torch.Tensor]]:
    """Three batches of packed documents (sequence_id: documents that start and end inside
    the chunks of either rank) with unequal loss tokens per row and per chunk, so a wrong
    position, document boundary or loss weight would show."""
    generator = torch.Generator().manual_seed(7)
    boundaries = ([5, 12], [3], [8, 9, 14], [])
    batches = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=generator)
        sequence_id = torch.zeros(BATCH, SEQ_LEN, dtype=torch.long)
        for row, starts in enumerate(boundaries):
            for start in starts:
                sequence_id[row, start:] += 1
        labels = ids.clone()
        labels[0, :6] = -100
        labels[2, 9:] = -100
        batches.append({"input_ids": ids, "labels": labels, "sequence_id": sequence_id})
    return batches


def rank_rows(batches: list[dict], dp_rank: int, dp_size: int) -> list[dict]:
    """This data-parallel rank's rows of each batch (every cp rank of it reads the same)."""
    per_rank = BATCH // dp_size
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return [{key: value[rows] for key, value in batch.items()} for batch in batches]


class Recorder(Callback):
    """Each step's loss and gradient norm (the whole model's, before the optimizer step), and
    the eval metrics at the end."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def after_train_batch(self, state, logger) -> None:
        grads = [p.grad for p in state.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if hasattr(norm, "full_tensor"):  # sharded: a collective, on every rank
            norm = norm.full_tensor()
        self.grad_norms.append(norm.item())

    def batch_end(self, state, logger) -> None:
        self.losses.append(state.train_loss)


def parity_run(strategy: Strategy, model: str) -> tuple[Recorder, dict[str, float]]:
    """Three AdamW steps on the shared global batches (this data-parallel rank's rows), then
    an evaluation on them: the recorded steps and the eval metrics."""
    batches = global_batches()
    recorder = Recorder()
    own = rank_rows(batches, strategy.dp_rank, strategy.dp_size)
    state = Trainer(
        model=MODELS[model](),
        strategy=strategy,
        train_dataloader=own,
        eval_dataloaders={"train": own},
        max_duration=f"{len(batches)}ba",
        # eps 1e-6, not 1e-8: test_context_parallel.py's docstring says why.
        optimizer=functools.partial(DecoupledAdamW, lr=1e-2, weight_decay=1e-2, eps=1e-6),
        callbacks=[recorder],
        run_dir=os.environ.get("TMPDIR", "/tmp"),
    ).fit()
    return recorder, dict(state.eval_metrics)


def single_parity_run(model: str) -> tuple[Recorder, dict[str, float]]:
    return parity_run(SingleDevice("cpu"), model)


def _refusal(rank: int, world: int, port: int, strategy_options: dict, model: Any, ids) -> str:
    """The UserError a context-parallel strategy raises preparing `model` and running it on
    this rank's part of `ids` ("" if none)."""
    join_env(rank, world, port)
    strategy = FSDP("cpu", timeout_s=60, parallelism=strategy_options)
    try:
        strategy.setup()
        prepared = strategy.prepare(model)
        prepared(strategy.context.shard({"input_ids": ids, "labels": ids}))
        return ""
    except UserError as err:
        return str(err)
    finally:
        strategy.teardown()


def rank_main(rank: int, world: int, ports: list[int], out: str) -> None:
    ports = iter(ports)
    result: dict[str, Any] = {}
    for name, (cp, model) in PARITY.items():
        join_env(rank, world, next(ports))
        recorder, metrics = parity_run(FSDP("cpu", timeout_s=60, parallelism={"cp": cp}), model)
        result[name] = {"losses": recorder.losses, "grad_norms": recorder.grad_norms}
        result[name]["eval"] = metrics
    # A length 2 cp does not divide (14 at cp=2), and infini-attention: refused on every rank.
    odd = torch.zeros(2, 14, dtype=torch.long)
    result["odd_length"] = _refusal(rank, world, next(ports), {"cp": 2}, cp_mpt(), odd)
    infini = cp_mpt(infini={"segment_len": 8}, alibi=False)
    even = torch.zeros(2, SEQ_LEN, dtype=torch.long)
    result["infini"] = _refusal(rank, world, next(ports), {"cp": 2}, infini, even)
    torch.save(result, Path(out) / f"rank{rank}.pt")
