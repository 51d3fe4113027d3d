"""The parallelization plan of the shared decoder (llmfoundry/models/layers/decoder.py): its
blocks for FSDP and activation checkpointing, its pipeline stage forward (every family's), and
the tensor-parallel layout of decoders with separate q, k, v projections (Llama, Qwen3, the
mixture-of-experts families; MPT's fused Wqkv has its own, models/mpt/parallelize.py).

Pipeline stages: the first embeds, the last holds the final norm and the head (a tied head is
the embedding, held by both ends); every stage computes the positions and the mask itself.

Tensor parallel (Megatron's layout, with sequence parallelism; torchtitan's standard one): in
each block q, k, v and the MLP's gate and up projections are split by output column (each rank
computes its own heads and its share of the hidden units), out_proj and down_proj by input row
(each rank's partial sums are reduce-scattered). Between them the residual stream and the norms
are split by sequence position (SequenceParallel), so norms and the residual adds run on 1/tp
of the tokens and the activations kept for backward are 1/tp too; each attention or MLP input
is all-gathered over the sequence first (PrepareModuleInput). A mixture of experts' input is
gathered the same way; its router and experts are not split over tp (`moe_layout`: the experts
go over the ep axis instead, llmfoundry/distributed). Per-head q/k norms (Qwen3's) act on whole
heads, each rank's own: nothing to lay out. The token embedding is split by vocabulary row (its
lookups reduce-scattered to sequence shards), the untied output head by vocabulary column: its
logits stay vocabulary-sharded and the loss reads them so (llmfoundry/core/loss.py), never
gathering [tokens, vocab]. A tied head multiplies by the row-split embedding, which gives the
same layout once its input, the final norm's output, is gathered over the sequence
(`GatheredSequenceParallel`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
)

from llmfoundry.models.layers.decoder import DecoderLM
from llmfoundry.models.layers.kv_cache import Keys
from llmfoundry.models.layers.moe import pipeline_refusal
from llmfoundry.models.plan import GatheredSequenceParallel, ParallelPlan, PipelineSplit


def pipeline_stage_forward(
    model: DecoderLM,
    inputs: torch.Tensor,
    sequence_id: torch.Tensor | None = None,
    *,
    seq_len: int,
    first: bool,
    last: bool,
    keys: Keys | None = None,
) -> torch.Tensor:
    """`DecoderLM.forward` for one pipeline stage (`PipelineSplit.forward`): the blocks the
    stage does not hold pass their input through. `keys`: as the model's `cache` (a
    context-parallel rank's; `seq_len` is then this rank's part of the sequence)."""
    h = model.transformer.stage(inputs, sequence_id, keys, seq_len=seq_len, first=first, last=last)
    return model.head(h) if last else h


def pipeline_split(
    model: DecoderLM, first: tuple[str, ...] = ("transformer.wte",)
) -> PipelineSplit:
    """The first stage embeds (`first`: the modules only it holds when the head is untied; a
    tied embedding is held by both ends), the last holds the final norm and the head."""
    tied = model.spec.tie_word_embeddings
    embedding = ("transformer.wte",)
    return PipelineSplit(
        first=tuple(m for m in first if m not in embedding) if tied else first,
        last=("transformer.norm_f",) if tied else ("transformer.norm_f", "lm_head"),
        tied=embedding if tied else (),
        forward=pipeline_stage_forward,
    )


def decoder_plan(model: DecoderLM) -> ParallelPlan:
    """The plan of a separate-qkv decoder: its blocks (one layer's weights gathered at a time;
    the embedding, the final norm and an untied lm_head stay with the root), its pipeline split
    and its tensor-parallel layout (the module docstring)."""
    spec = model.spec
    divides = {"n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads}
    if spec.ffn != "moe":
        divides["ffn_hidden_size"] = spec.ffn_hidden
    return ParallelPlan(
        blocks=list(model.transformer.blocks),
        pipeline=pipeline_split(model),
        tensor_parallel=tensor_parallel_layout(model),
        tp_divides={**divides, "vocab_size": spec.vocab_size},
        pipeline_refusal="" if spec.moe is None else pipeline_refusal(spec.moe),
    )


def tensor_parallel_layout(model: DecoderLM) -> dict[str, ParallelStyle]:
    sequence_sharded, whole = Shard(1), Replicate()
    spec = model.spec
    tied = spec.tie_word_embeddings
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
        }
        layout |= moe_layout(block) if spec.ffn == "moe" else mlp_layout(block, spec.ffn)
    return layout


def mlp_layout(block: str, ffn: str) -> dict[str, ParallelStyle]:
    """The (gated) MLP: its input gathered over the sequence, gate and up split by column, down
    by row with its output reduce-scattered back to sequence shards."""
    sequence_sharded, whole = Shard(1), Replicate()
    columns = ("gate_proj", "up_proj") if ffn == "glu" else ("up_proj",)
    return {
        f"{block}.ffn": PrepareModuleInput(
            input_layouts=(sequence_sharded,), desired_input_layouts=(whole,)
        ),
        **{f"{block}.ffn.{name}": ColwiseParallel() for name in columns},
        f"{block}.ffn.down_proj": RowwiseParallel(output_layouts=sequence_sharded),
    }


def moe_layout(block: str) -> dict[str, ParallelStyle]:
    """A mixture of experts over tp: its input gathered over the sequence as the MLP's, its
    router and experts replicated (every rank routes and computes every token: the experts are
    split over the ep axis, not tp), its output handed back split by sequence position (whose
    backward all-gathers the gradient, so each rank's router and experts get the whole
    sequence's gradient, equal on every rank)."""
    sequence_sharded, whole = Shard(1), Replicate()
    return {
        f"{block}.ffn": PrepareModuleInputOutput(
            input_layouts=(sequence_sharded,),
            desired_input_layouts=(whole,),
            use_local_input=True,
            output_layouts=(whole,),
            desired_output_layouts=(sequence_sharded,),
        )
    }
