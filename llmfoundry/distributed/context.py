"""Context parallelism (`cp=C`): each sequence split over the C ranks of a cp group, attention
over the whole of it by all-gathering keys and values.

The scheme is the one Llama 3's long-context training used: every rank projects queries, keys
and values for its own part of the sequence, then in each layer all-gathers the keys and
values of the other ranks' parts (`ContextKeys`), and its queries attend over all of them.
Since a rank knows the global position of each of its queries and of every key, any mask or
bias is exact: ALiBi from global distances, causality, a sliding window, document masks from
the whole `sequence_id`, RoPE at global positions. The model needs no parallel code for it: a
`ContextKeys` is a `Keys` (llmfoundry/models/layers/kv_cache.py), like a decoding cache, and
says where the rank's queries sit among the keys; the attention kernels build their mask for
those rows (llmfoundry/models/layers/attention.py). Backward: the gathers' gradients (dK, dV
of every rank's queries) are reduce-scattered back to the ranks that own those keys.

Layout: the sequence of L tokens is cut into 2C equal chunks and rank r holds chunks r and
2C-1-r (`load_balanced_index`), so every rank has as many causal query-key pairs as the
others. Its targets are the labels shifted over the WHOLE sequence first (position t's target
is labels[t + 1], whoever holds it), then indexed (`ContextParallel.shard`). The losses of a
cp group's ranks cover different tokens: the trainer sums losses and token counts over them
(`Mesh.loss_group`), and FSDP averages their gradients as data-parallel ranks' (its mesh
joins dp_shard and cp).

Why not torch's ring attention (torch.distributed.tensor.experimental.context_parallel): on torch
2.13 it does not run our attention. A probe ran it on 2 CPU ranks (gloo; bench/RESULTS.md has its
output, git has bench/context_parallel_probe.py at 3fb1390): causal SDPA failed (the CPU flash
kernel has no sharding rule), the math backend failed (DTensor mixed with plain tensors), an
additive bias (MPT's ALiBi, document masks) gave a wrong result (max error 3.59) or hung, and a
Llama step failed: its shards carry no global offsets for a bias to be built from.
All-gathered K/V costs memory a ring would not (the
whole sequence's keys and values, 2 L kv_heads head_dim per row and layer, which attention keeps
for its backward: in every layer, or in the one being recomputed under activation checkpointing;
small beside the activations for grouped-query heads), and overlaps no communication, but it is
exact for every mask, kernel and family, with one all-gather per layer forward and one
reduce-scatter per layer backward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from llmfoundry.core.loss import targets_of
from llmfoundry.distributed.torch_compat import all_gather_autograd
from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError

# The per-token keys `shard` splits or keeps whole; anything else in a batch is refused.
_SPLIT, _WHOLE = ("input_ids",), ("sequence_id",)


def load_balanced_index(
    seq_len: int, cp: int, rank: int, device: torch.device | None = None
) -> torch.Tensor:
    """The global positions (ascending) of cp rank `rank`'s tokens of a sequence of `seq_len`:
    of its 2 cp equal chunks, chunk `rank` and chunk 2 cp - 1 - rank (an early one and a late
    one, so every rank has as much causal attention to compute). `seq_len` must be a multiple
    of 2 cp (`ContextParallel.check_length`)."""
    chunk = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
            torch.arange(late * chunk, (late + 1) * chunk, device=device),
        ]
    )


class ContextParallel:
    """This rank's part of context parallelism over `cp` ranks (it is `rank` among them, in
    `group`): what it takes of each batch (`shard`) and the keys of each forward (`keys`).
    `setting` names the config key the degree came from, for messages."""

    def __init__(
        self, cp: int, rank: int, group: dist.ProcessGroup, setting: str = "parallelism.cp"
    ) -> None:
        if not 0 <= rank < cp:
            raise ValueError(f"cp rank {rank} is outside the {cp} context-parallel ranks")
        self.cp, self.rank, self.group, self.setting = cp, rank, group, setting
        # While automatic microbatching searches for a size (the strategy's
        # `guard_collectives`): called before each gather and its backward's reduce-scatter,
        # so that every rank agrees no rank ran out of memory before any enters either.
        self.guard: Callable[[], None] | None = None

    def check_length(self, seq_len: int) -> None:
        """Refuse a sequence length 2 cp does not divide (on every rank alike: the cp ranks read
        the same batch, and this runs before any collective of its forward)."""
        if seq_len % (2 * self.cp):
            raise UserError(
                f"{self.setting}={self.cp} splits each sequence into {2 * self.cp} chunks (two "
                f"per rank), but this batch's sequences have {seq_len} positions, not a "
                f"multiple of {2 * self.cp}: pad the batches to a multiple of {2 * self.cp} "
                f"(the training loader does), or use {self.setting}=1"
            )

    def index(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """This rank's positions of a sequence of `seq_len` (`load_balanced_index`)."""
        return load_balanced_index(seq_len, self.cp, self.rank, device)

    def shard(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a (micro)batch of whole sequences, which every rank of the group
        holds alike: `input_ids` [B, L / cp] at its positions, `targets` [B, L / cp] (the
        labels shifted over the whole sequence, then indexed: `loss.targets_of`, so no
        `labels`), and `sequence_id` left whole [B, L] (the documents of every key). Other keys
        are refused: what they mean per position is not known here."""
        unknown = sorted(set(batch) - {*_SPLIT, *_WHOLE, "labels", "targets"})
        if unknown:
            raise UserError(
                f"{self.setting}={self.cp} splits input_ids, labels and sequence_id by "
                f"position, but the batch also has {', '.join(unknown)}; drop them from the "
                f"batch, or use {self.setting}=1"
            )
        input_ids = batch["input_ids"]
        self.check_length(input_ids.shape[1])
        index = self.index(input_ids.shape[1], input_ids.device)
        local = {"input_ids": input_ids[:, index], "targets": targets_of(batch)[:, index]}
        for key in _WHOLE:
            if key in batch:
                local[key] = batch[key]
        return local

    def keys(self, sequence_id: torch.Tensor | None, local_len: int, n_layers: int) -> ContextKeys:
        """The `Keys` of one forward of this rank's `local_len` tokens through `n_layers`
        blocks; `sequence_id` [B, L] is the whole sequence's (None: no documents)."""
        return ContextKeys(self, sequence_id, local_len, n_layers)


class ContextKeys:
    """The `Keys` (llmfoundry/models/layers/kv_cache.py) of a context-parallel forward: every
    key of the sequence, the other ranks' gathered in each layer (`append`). Its queries are
    this rank's positions (`queries`), not the last ones."""

    def __init__(
        self,
        context: ContextParallel,
        sequence_id: torch.Tensor | None,
        local_len: int,
        n_layers: int,
    ) -> None:
        self.context = context
        self.seq_len = local_len * context.cp
        self.length = self.seq_len - local_len  # the keys besides this forward's own
        self.sequence_id = sequence_id
        self.layers = [self] * n_layers  # every layer gathers alike; nothing is kept
        self._order: torch.Tensor | None = None

    def extend(self, sequence_id: torch.Tensor | None, seq_len: int) -> torch.Tensor | None:
        """Every key's document ids: the whole sequence's, given when these keys were made."""
        if sequence_id is not None:
            raise ValueError("a context-parallel forward takes sequence_id through its keys")
        self.length += seq_len
        return self.sequence_id

    def queries(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """This rank's positions among the keys."""
        return self.context.index(self.seq_len, device)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of every position in order, [B, kv_heads, L, D], from this rank's [B, kv_heads,
        L / cp, D]: one all-gather over the group of both (only the key/value heads, so
        grouped-query attention moves kv_heads / n_heads of what query heads would), whose
        backward reduce-scatters dK and dV back to their owners (the gradients of every rank's
        queries), then put in position order."""
        heads, guard = k.shape[1], self.context.guard
        both = torch.cat([k, v], dim=1).movedim(2, 0).contiguous()  # positions first
        if guard is not None and torch.is_grad_enabled():  # (evaluation never retries)
            guard()
        gathered = all_gather_autograd(both, gather_dim=0, group=self.context.group)
        if guard is not None and gathered.requires_grad:  # runs just before the reduce-scatter
            gathered.register_hook(lambda _grad: guard())
        ordered = gathered.index_select(0, self.order(gathered.device)).movedim(0, 2)
        return ordered[:, :heads], ordered[:, heads:]

    def order(self, device: torch.device) -> torch.Tensor:
        """For each global position, where the gather put it (ranks' parts one after another)."""
        if self._order is None or self._order.device != device:
            ctx = self.context
            held = torch.cat([load_balanced_index(self.seq_len, ctx.cp, r) for r in range(ctx.cp)])
            self._order = torch.argsort(held).to(device)
        return self._order


def check_context_parallel(plan: ParallelPlan, cp: int, setting: str = "parallelism.cp") -> None:
    """Refuse (one line, every rank alike, before any collective) a model context parallelism
    cannot split: a family whose plan says why (infini-attention's memory runs through the
    sequence in order)."""
    if plan.context_parallel_refusal:
        raise UserError(f"{setting}={cp}: {plan.context_parallel_refusal}")


def apply_cp(model: nn.Module, context: ContextParallel) -> None:
    """Context parallelism from outside the model: a forward pre-hook on the root makes
    ``model(local)``, a batch from `ContextParallel.shard`, into ``model(input_ids,
    cache=keys)``, the keys gathering the other ranks' parts in each layer. Anything else is
    refused: a whole batch or bare token ids would attend within this rank's tokens alone."""
    n_layers = model.config.n_layers
    model.register_forward_pre_hook(
        lambda _module, args, kwargs: _local_forward(context, n_layers, args, kwargs),
        with_kwargs=True,
    )


def _local_forward(
    context: ContextParallel, n_layers: int, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    if "seq_len" in kwargs:  # a pipeline stage's forward (pipeline.py), once per microbatch
        return args, _stage_keys(context, n_layers, kwargs)
    local = args[0] if args else None
    if not (isinstance(local, Mapping) and "targets" in local) or kwargs or len(args) > 1:
        raise UserError(
            f"{context.setting}={context.cp}: the model takes one batch from "
            "ContextParallel.shard (this rank's part of each sequence), as the trainer "
            "gives it; not whole sequences or token ids"
        )
    input_ids = local["input_ids"]
    keys = context.keys(local.get("sequence_id"), input_ids.shape[1], n_layers)
    return (input_ids,), {"cache": keys}


def _stage_keys(context: ContextParallel, n_layers: int, kwargs: dict) -> dict:
    """A pipeline stage's forward arguments (`PipelineSplit.forward`: its input, `seq_len`, the
    microbatch's whole `sequence_id`) with the keys of its microbatch: `seq_len` is this
    rank's part of the sequence (`Pipeline.step` runs `shard`'s batch), and the documents go
    to the keys, which give the forward every key's."""
    kwargs = dict(kwargs)
    sequence_id = kwargs.pop("sequence_id", None)
    kwargs["keys"] = context.keys(sequence_id, kwargs["seq_len"], n_layers)
    return kwargs
