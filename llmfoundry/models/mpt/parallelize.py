"""MPT's parallelization plan (see llmfoundry/models/plan.py): its transformer blocks, compiled
when its config says `compile`, how the model splits into pipeline stages, and its
tensor-parallel layout.

Each block holds 12 d_model^2 weights of a layer's 12 n_layers d_model^2, so sharding per block
keeps one layer's weights gathered at a time. The token embedding, which is also the output
head unless `tie_word_embeddings=false`, stays with the root: it is used at both ends of the
forward. Split into pipeline stages, the first stage embeds and the last applies the final norm
and the head, so with a tied head both hold the token embedding (`tied`).

Pipeline stages and tensor parallelism are the shared decoder's (models/decoder_plan.py):
Megatron's layout with sequence parallelism, ALiBi's slopes per rank's heads, a tied head fed
the final norm's output gathered over the sequence, an untied `lm_head` split by vocabulary
column. RoPE needs no layout: each rank's attention rotates its own heads with the whole
sequence's angles. MPT's own is its projections' layout:

- The fused Wqkv. Split by output column like any colwise linear (`Shard(0)` of its
  [q | k | v] rows), rank r computes a contiguous slice of [q | k | v] that cuts across q, k
  and v; `ColwiseByHead` then exchanges those columns in one all-to-all over the tp group, so
  rank r holds [q_r | k_r | v_r]: the queries of heads [r H/T, (r+1) H/T) and the keys and
  values of the kv heads they read. The weight keeps its ordinary `Shard(0)` layout, so FSDP
  shards it again and DCP checkpoints it as any other weight, and the checkpoint and the HF
  export keep MPT's fused [q | k | v]. The price is that exchange: per block, forward and
  backward each move (T-1)/T of the projection's output, (n_heads + 2 kv_n_heads) / n_heads
  of a block input, beside the four block inputs' worth that sequence parallelism moves. The
  layout that would need no exchange, DTensor's `_StridedShard(0, split_factor=3)` (rank r's
  rows are [q_r; k_r; v_r] of the whole weight), is not usable with torch 2.13: FSDP2 sharding
  over it gathers a wrong whole tensor and DCP refuses its chunks as overlapping (probed on 2 x
  2 gloo processes).

`qk_ln` (a norm over every head's width), infini-attention (a gate per head) and a learned
position table are not in the layout: with them `parallelism.tp>1` is refused in one line.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from llmfoundry.models import decoder_plan
from llmfoundry.models.mpt.config import MPTConfig
from llmfoundry.models.mpt.model import MPTForCausalLM
from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError


def parallelize_plan(model: MPTForCausalLM) -> ParallelPlan:
    cfg = model.config
    refusal = _tensor_parallel_refusal(cfg)
    return ParallelPlan(
        blocks=list(model.transformer.blocks),
        compile=cfg.compile,
        pipeline=decoder_plan.pipeline_split(model),
        tensor_parallel=None if refusal else tensor_parallel_layout(model),
        tp_divides={
            "n_heads": cfg.n_heads,
            "kv_n_heads": cfg.kv_n_heads,
            "expansion_ratio * d_model": cfg.expansion_ratio * cfg.d_model,
            "vocab_size": cfg.vocab_size,
        },
        tensor_parallel_refusal=refusal,
        tp_all_to_all=(cfg.n_heads + 2 * cfg.kv_n_heads) / cfg.n_heads,
        context_parallel_refusal=INFINI_CP_REFUSAL if cfg.infini is not None else "",
    )


# Infini-attention's compressive memory folds the sequence's segments in order, one after
# another; a context-parallel rank would need the memory of every segment before its own.
INFINI_CP_REFUSAL = (
    "model.infini's memory runs through each sequence in order, so a sequence cannot be "
    "split over context-parallel ranks; turn infini off, or train without context parallelism"
)


def _tensor_parallel_refusal(cfg: MPTConfig) -> str:
    """Why this MPT has no tensor-parallel layout (the module docstring), or "" when it has."""
    unplanned = {
        "model.qk_ln=true (its norms span every head's width)": cfg.qk_ln,
        "model.infini (its gates are per head)": cfg.infini is not None,
        "model.learned_pos_emb=true": cfg.learned_pos_emb,
    }
    found = [name for name, present in unplanned.items() if present]
    if not found:
        return ""
    return (
        f"MPT's tensor-parallel layout does not cover {' or '.join(found)}: turn it off, or "
        "use parallelism.tp=1"
    )


def tensor_parallel_layout(model: MPTForCausalLM) -> dict[str, ParallelStyle]:
    """The shared decoder's layout (models/decoder_plan.py) with the fused Wqkv split by head."""
    cfg = model.config
    kv_dim = cfg.kv_n_heads * (cfg.d_model // cfg.n_heads)
    widths = (cfg.d_model, kv_dim, kv_dim)
    return decoder_plan.tensor_parallel_layout(
        model, lambda block: {f"{block}.attn.Wqkv": ColwiseByHead(widths)}
    )


class ColwiseByHead(ColwiseParallel):
    """ColwiseParallel for a linear whose output is several parts side by side ([q | k | v],
    `widths`), each split by head: after the column split, one all-to-all over the tp group
    gives rank r the r-th T-th of every part, in order (the module docstring)."""

    def __init__(self, widths: tuple[int, ...]) -> None:
        super().__init__()
        self.widths = widths

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        exchange = _PartsExchange(self.widths, device_mesh)
        module.register_forward_hook(lambda _module, _args, output: exchange(output))
        return module


class _PartsExchange:
    """The all-to-all of `ColwiseByHead`. Rank s holds columns [s c, (s+1) c) of the whole
    output (c = sum(widths) / T); rank r wants, of each part, its r-th T-th. Each rank sends
    every other rank the contiguous pieces of its columns that the other wants, part by part,
    and concatenates what it receives part-major (within a part the senders' pieces are in
    column order). The pieces are fixed by the widths and the mesh: computed once here."""

    def __init__(self, widths: tuple[int, ...], mesh: DeviceMesh) -> None:
        size, me = mesh.size(), mesh.get_local_rank()
        total = sum(widths)
        if total % size or any(width % size for width in widths):
            raise UserError(f"parallelism.tp={size} does not divide the widths {widths}")
        self.group = mesh.get_group()
        held = total // size
        starts = [sum(widths[:i]) for i in range(len(widths))]

        def piece(holder: int, wanter: int, part: int) -> tuple[int, int]:
            """Columns of `part` that `wanter` wants and `holder` holds, in holder's coordinates."""
            share = widths[part] // size
            lo = max(holder * held, starts[part] + wanter * share)
            hi = min((holder + 1) * held, starts[part] + (wanter + 1) * share)
            return (lo - holder * held, max(hi, lo) - holder * held)

        parts = range(len(widths))
        sent = [piece(me, to, p) for to in range(size) for p in parts]  # by receiver, part
        self.sent = [(lo, hi) for lo, hi in sent if hi > lo]
        self.send_sizes = [sum(_length(piece(me, to, p)) for p in parts) for to in range(size)]
        self.recv_sizes = [sum(_length(piece(src, me, p)) for p in parts) for src in range(size)]
        received = []  # (start, stop) in the receive buffer, part-major
        for p in parts:
            for src in range(size):
                offset = sum(self.recv_sizes[:src]) + sum(
                    _length(piece(src, me, q)) for q in range(p)
                )
                received.append((offset, offset + _length(piece(src, me, p))))
        self.received = [(lo, hi) for lo, hi in received if hi > lo]

    def __call__(self, output: torch.Tensor) -> torch.Tensor:
        send = self.pack(output)
        got = all_to_all_single_autograd(send, self.recv_sizes, self.send_sizes, self.group)
        return self.unpack(got).view(output.shape)

    def pack(self, output: torch.Tensor) -> torch.Tensor:
        """[columns, tokens]: this rank's pieces, ordered by the rank they go to."""
        rows = output.reshape(-1, output.shape[-1])  # [tokens, held columns]
        return torch.cat([rows[:, lo:hi].t() for lo, hi in self.sent])

    def unpack(self, got: torch.Tensor) -> torch.Tensor:
        """[tokens, columns]: the received pieces ([columns, tokens], by sender), part-major."""
        return torch.cat([got[lo:hi].t() for lo, hi in self.received], dim=1)


def _length(span: tuple[int, int]) -> int:
    return span[1] - span[0]
