"""Llama's parallelization plan (see llmfoundry/models/plan.py): its blocks for FSDP and
activation checkpointing, its pipeline split, and its tensor-parallel layout, torchtitan's
standard one.

Pipeline stages: the first embeds, the last holds the final norm and the head (a tied head is
the embedding, held by both ends); every stage computes the rotations and the mask itself.

Tensor parallel (Megatron's layout, with sequence parallelism): in each block q, k, v and the
MLP's gate and up projections are split by output column (each rank computes its own heads
and its share of the hidden units), out_proj and down_proj by input row (each rank's partial
sums are reduce-scattered). Between them the residual stream and the RMSNorms are split by
sequence position (SequenceParallel), so norms and the residual adds run on 1/tp of the
tokens and the activations kept for backward are 1/tp too; each attention or MLP input is
all-gathered over the sequence first (PrepareModuleInput). The token embedding is split by
vocabulary row (its lookups reduce-scattered to sequence shards), the untied output head by
vocabulary column: its logits stay vocabulary-sharded and the loss reads them so
(llmfoundry/core/loss.py), never gathering [tokens, vocab]. A tied head multiplies
by the row-split embedding, which gives the same layout once its input, the final norm's
output, is gathered over the sequence (`GatheredSequenceParallel`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from llmfoundry.models.layers.attention import compute_dtype
from llmfoundry.models.layers.kv_cache import Keys, attend_over
from llmfoundry.models.layers.position import token_positions
from llmfoundry.models.llama.model import LlamaForCausalLM
from llmfoundry.models.plan import GatheredSequenceParallel, ParallelPlan, PipelineSplit


def parallelize_plan(model: LlamaForCausalLM) -> ParallelPlan:
    """Its blocks, as MPT's: one layer's weights gathered at a time; the embedding, the final
    norm and an untied lm_head stay with the root. Its pipeline split and tensor-parallel
    layout as above."""
    cfg = model.config
    tied = cfg.tie_word_embeddings
    pipeline = PipelineSplit(
        first=() if tied else ("transformer.wte",),
        last=("transformer.norm_f",) if tied else ("transformer.norm_f", "lm_head"),
        tied=("transformer.wte",) if tied else (),
        forward=pipeline_stage_forward,
    )
    return ParallelPlan(
        blocks=list(model.transformer.blocks),
        pipeline=pipeline,
        tensor_parallel=tensor_parallel_layout(model),
        tp_divides={
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "ffn_hidden_size": cfg.ffn_hidden_size,
            "vocab_size": cfg.vocab_size,
        },
    )


def pipeline_stage_forward(
    model: LlamaForCausalLM,
    inputs: torch.Tensor,
    sequence_id: torch.Tensor | None = None,
    *,
    seq_len: int,
    first: bool,
    last: bool,
    keys: Keys | None = None,
) -> torch.Tensor:
    """`LlamaForCausalLM.forward` for one pipeline stage (`PipelineSplit.forward`): the blocks
    the stage does not hold pass their input through. `keys`: as the model's `cache` (a
    context-parallel rank's; `seq_len` is then this rank's part of the sequence)."""
    transformer = model.transformer
    x = transformer.wte(inputs) if first else inputs
    sequence_id, queries, k_len = attend_over(keys, sequence_id, seq_len, x.device)
    positions = token_positions(sequence_id, seq_len, k_len, queries, x.device)
    rope = transformer.rope(positions)
    mask = transformer.masks(sequence_id, x.device, compute_dtype(x), (seq_len, k_len), queries)
    layers = [None] * len(transformer.blocks) if keys is None else keys.layers
    for block, layer_keys in zip(transformer.blocks, layers, strict=True):
        x = block(x, mask, rope, layer_keys)
    if not last:
        return x
    h = transformer.norm_f(x)
    if model.config.tie_word_embeddings:
        return F.linear(h, transformer.wte.weight)
    return model.lm_head(h)


def tensor_parallel_layout(model: LlamaForCausalLM) -> dict[str, ParallelStyle]:
    sequence_sharded, whole = Shard(1), Replicate()
    tied = model.config.tie_word_embeddings
    layout: dict[str, ParallelStyle] = {
        "transformer.wte": RowwiseParallel(input_layouts=whole, output_layouts=sequence_sharded),
        "transformer.norm_f": GatheredSequenceParallel() if tied else SequenceParallel(),
    }
    if not tied:
        layout["lm_head"] = ColwiseParallel(
            input_layouts=sequence_sharded, output_layouts=Shard(-1), use_local_output=False
        )
    for index in range(len(model.transformer.blocks)):
        block = f"transformer.blocks.{index}"
        layout |= {
            f"{block}.norm_1": SequenceParallel(),
            # attn(x, mask, rope, cache): only x is laid out (gathered over the sequence).
            f"{block}.attn": PrepareModuleInput(
                input_layouts=(sequence_sharded, None, None, None),
                desired_input_layouts=(whole, None, None, None),
            ),
            f"{block}.attn.q_proj": ColwiseParallel(),
            f"{block}.attn.k_proj": ColwiseParallel(),
            f"{block}.attn.v_proj": ColwiseParallel(),
            f"{block}.attn.out_proj": RowwiseParallel(output_layouts=sequence_sharded),
            f"{block}.norm_2": SequenceParallel(),
            f"{block}.ffn": PrepareModuleInput(
                input_layouts=(sequence_sharded,), desired_input_layouts=(whole,)
            ),
            f"{block}.ffn.gate_proj": ColwiseParallel(),
            f"{block}.ffn.up_proj": ColwiseParallel(),
            f"{block}.ffn.down_proj": RowwiseParallel(output_layouts=sequence_sharded),
        }
    return layout
