"""The model's forward over token ids wherever the model is, as a scoring `Forward`
(llmfoundry/eval/scoring.py): `mesh_forward(model, strategy)`.

Every process calls it with the same right-padded ids [B, L] and gets the same reduced tensor:

- one process, DDP, FSDP, DeepSpeed: every rank runs the whole forward, as the trainer's
  evaluation does (`model(batch)`; FSDP gathers each block's weights from all ranks, so all of
  them must run it);
- tensor parallelism (`parallelism.tp` > 1): sequence parallelism splits the positions over the tp
  ranks, so the ids are right-padded to a multiple of tp (a causal model's earlier positions do
  not see later ones: the real positions' logits are unchanged); a vocabulary-sharded head's
  logits (a DTensor) are gathered whole, then cut back to [B, L] and reduced;
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
from torch.distributed.tensor import DTensor

from llmfoundry.core.precision import Precision
from llmfoundry.distributed import Strategy, unwrap_model
from llmfoundry.eval.scoring import Forward, Reduce
from llmfoundry.models.generation import eval_mode

__all__ = ["mesh_forward", "splits_the_model"]


def splits_the_model(strategy: Strategy | None) -> bool:
    """Whether no process holds the whole model (tensor or pipeline parallelism): its forward
    is then `mesh_forward`'s, not the model's own on each process."""
    return strategy is not None and (strategy.pipeline is not None or strategy.tp > 1)


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
        with torch.no_grad(), eval_mode(self.inner):
            with self.autocast():
                if self.pipeline is None:
                    logits = self.model(batch)
                else:
                    logits = self.pipeline.forward_only(batch)  # None but on the last stage
            if self.pipeline is None:
                return reduce(_whole(logits)[:rows, :length]).cpu()
            reduced, failure = None, None
            if logits is not None:  # the last stage: the others wait for what it sends
                try:
                    reduced = reduce(_whole(logits)[:rows, :length])
                except Exception as err:  # raised on every stage, not only here
                    failure = err
            return self.pipeline.share_from_last_stage(reduced, failure).cpu()

    def _padded(self, ids: torch.Tensor) -> torch.Tensor:
        """`ids` right-padded (with token 0) to a length tp divides, and under a pipeline to
        one of its few shapes."""
        rows, length = ids.shape
        if self.pipeline is None:
            width, height = _round_up(length, self.tp), rows
        else:
            width, height = _bucket(length, self.tp, self.max_seq_len), _power_of_two(rows)
        if (height, width) == (rows, length):
            return ids
        padded = ids.new_zeros(height, width)
        padded[:rows, :length] = ids
        return padded


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """The logits as one plain tensor on every rank (a tensor-parallel head's are a DTensor,
    sharded over the vocabulary)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


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
