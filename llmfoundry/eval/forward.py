"""The model's forward over token ids wherever the model is, as a scoring `Forward`
(llmfoundry/eval/scoring.py): `mesh_forward(model, strategy)`.

Every process calls it with the same right-padded ids [B, L] and gets the same reduced tensor:

- one process, DDP, FSDP, DeepSpeed: every rank runs the whole forward, as the trainer's
  evaluation does (`model(batch)`; FSDP gathers each block's weights from all ranks, so all of
  them must run it);
- tensor parallelism (`strategy.tp` > 1): sequence parallelism splits the positions over the tp
  ranks, so the ids are right-padded to a multiple of tp (a causal model's earlier positions do
  not see later ones: the real positions' logits are unchanged); a vocabulary-sharded head's
  logits (a DTensor) are gathered whole, then cut back to [B, L] and reduced;
- context parallelism (`strategy.context`): each rank of a cp group runs its part of every
  sequence (`ContextParallel.shard`; the ids right-padded to a multiple of 2 cp x tp), and the
  parts' logits are gathered over the group and put back in position order before the
  reduction;
- pipeline parallelism (`strategy.pipeline`): the stages run `Pipeline.forward_only`, the last
  one reduces its logits and sends the result to the other stages of its column (or its
  error, which every stage then raises: a sampling of non-finite scores, say). A pipeline
  builds a stage and schedule per batch shape, so the ids are padded to a few shapes (rows and
  positions to powers of two): an evaluation, or a generation whose sequences grow a token at
  a time, builds a handful, not one per length.

The forward runs in eval mode, without gradients, under the trainer's autocast when given its
`precision` (as its evaluation runs); `reduce` runs outside autocast, on the logits as the model
gave them, so it sees the numbers the trainer's metrics see. Gathering the whole logits on each
tp rank costs [B, L, vocab] per rank for the one forward: what the reductions (a softmax over
the vocabulary, sampling) need.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llmfoundry.core.precision import Precision
from llmfoundry.distributed import Strategy, unwrap_model
from llmfoundry.distributed.context import load_balanced_index
from llmfoundry.eval.scoring import Forward, Reduce
from llmfoundry.models.generation import eval_mode

__all__ = ["mesh_forward", "splits_the_model"]


def splits_the_model(strategy: Strategy | None) -> bool:
    """Whether no process holds the whole model (tensor or pipeline parallelism) or the whole
    sequence (context parallelism): its forward is then `mesh_forward`'s, not the model's own
    on each process."""
    return strategy is not None and (
        strategy.pipeline is not None or strategy.tp > 1 or strategy.context is not None
    )


def mesh_forward(
    model: torch.nn.Module, strategy: Strategy, precision: Precision | None = None
) -> Forward:
    """The `Forward` of `model` as `strategy` prepared it (the trainer's `state.model` and
    `state.strategy`); `precision`: the trainer's (`state.precision`), whose autocast the
    forward runs under (None: the model's own dtype)."""
    return MeshForward(model, strategy, precision)


class MeshForward:
    """See the module docstring; `mesh_forward` builds it."""

    def __init__(
        self, model: torch.nn.Module, strategy: Strategy, precision: Precision | None = None
    ) -> None:
        self.model, self.inner = model, unwrap_model(model)
        self.pipeline, self.tp, self.device = strategy.pipeline, strategy.tp, strategy.device
        self.context = strategy.context
        # What a row's length must be a multiple of: what sequence (and context) parallelism
        # split it into.
        self.multiple = self.tp * (2 * self.context.cp if self.context is not None else 1)
        self.autocast: Callable[[], contextlib.AbstractContextManager] = (
            contextlib.nullcontext if precision is None else precision.autocast
        )
        # The learned position table's length (where there is one) caps the padding.
        self.max_seq_len: int | None = getattr(
            getattr(self.inner, "config", None), "max_seq_len", None
        )

    def __call__(self, ids: torch.Tensor, reduce: Reduce) -> torch.Tensor:
        rows, length = ids.shape
        batch = {"input_ids": self._padded(ids).to(self.device)}
        if self.context is not None:  # this rank's part of each row (the labels are not read)
            batch = self.context.shard({**batch, "labels": batch["input_ids"]})
        with torch.no_grad(), eval_mode(self.inner):
            with self.autocast():
                if self.pipeline is None:
                    logits = self.model(batch)
                else:
                    logits = self.pipeline.forward_only(batch)  # None but on the last stage
            if self.pipeline is None:
                return reduce(self._whole(logits)[:rows, :length]).cpu()
            reduced, failure = None, None
            if logits is not None:  # the last stage: the others wait for what it sends
                try:
                    reduced = reduce(self._whole(logits)[:rows, :length])
                except Exception as err:  # raised on every stage, not only here
                    failure = err
            return self.pipeline.share_from_last_stage(reduced, failure).cpu()

    def _padded(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` right-padded (with token 0) to a length tp (and 2 cp) divides, and under a
        pipeline to one of its few shapes."""
        rows, length = ids.shape
        if self.pipeline is None:
            width, height = _round_up(length, self.multiple), rows
        else:
            width = _bucket(length, self.multiple, self.max_seq_len)
            height = _power_of_two(rows)
        if (height, width) == (rows, length):
            return ids
        padded = ids.new_zeros(height, width)
        padded[:rows, :length] = ids
        return padded

    def _whole(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits as one plain tensor [rows, positions, vocab] on every rank: a
        tensor-parallel head's are a DTensor, sharded over the vocabulary; a context-parallel
        rank's are of its positions, gathered over the group and put in position order."""
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        context = self.context
        if context is None:
            return logits
        parts = [torch.empty_like(logits) for _ in range(context.cp)]
        dist.all_gather(parts, logits.contiguous(), group=context.group)
        length = logits.shape[1] * context.cp
        held = torch.cat([load_balanced_index(length, context.cp, r) for r in range(context.cp)])
        return torch.cat(parts, dim=1)[:, torch.argsort(held).to(logits.device)]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _bucket(length: int, tp: int, cap: int | None) -> int:
    """The padded length of `length` positions: the next power of two, a multiple of `tp`, but
    not past `cap` (the position table) where `length` fits in it."""
    size = _round_up(_power_of_two(length), tp)
    if cap is not None and length <= cap < size:
        size = max(cap - cap % tp, _round_up(length, tp))
    return size
