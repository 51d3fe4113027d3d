"""Next-token cross-entropy over the vocabulary, computed in row chunks.

`F.cross_entropy` on a small model's [tokens, vocab] logits is a large share of the step: it writes
a full float32 log-softmax, keeps it for backward, writes a full gradient of it, and the shift
(`logits[:, :-1]`) adds a zero-filled full-size gradient and a copy in backward; in bf16 autocast
the `.float()` of the logits is one more full float32 copy. Here the loss walks the logits in
chunks of rows: forward keeps only each row's log-sum-exp (float32), backward recomputes softmax
per chunk and writes the gradient once, in the logits' dtype. Each chunk's only full-size
temporary is one float32 tensor (the logits minus the row maximum, promoted as they are read),
so nothing of the size of the logits is ever added. The shift is done on the labels (the last
position of each row gets no target), so the logits are never sliced. The math is float32
throughout, as `F.cross_entropy(logits.float(), ...)`.

Chunk size, by device (`rows_per_chunk`): a chunk costs about 8 kernels in forward and 4 in
backward, whatever its size.
- CPU: 2^20 logits (a 4 MB float32 temporary), small enough to stay in a core's cache, large
  enough that the per-chunk overhead is negligible.
- GPU (any device but the CPU): 2^26 logits (a 256 MiB temporary). Each full-size kernel then
  moves 128-512 MiB, 30-100 us of HBM traffic on an H100/H200, well above the ~5 us a launch
  costs the host, so the launches hide behind the work: a step's loss costs its bytes (about
  40 per logit in bf16, forward and backward), not its launches. With the CPU's size a GPU
  would run ~20,000 microsecond-long kernels per step (20 rows per chunk at MPT's vocabulary
  of 50,368: 1,639 chunks for 16 x 2048 tokens; 25 with this size, and one chunk for up to
  1,332 tokens). A fused (compiled or Triton) kernel would move about 8 bytes per logit; these
  chunks keep one eager implementation for every device, exact on the CPU tests, with a memory
  bound that does not depend on the batch.

Vocabulary-sharded logits (a DTensor split on its last dimension, as a tensor-parallel output
head leaves them) are read in place: each rank runs the same chunks over its own columns, and
only per-row numbers cross ranks (each row's log-sum-exp and target logit: two all-reduces of
[tokens] floats), never the [tokens, vocab] logits. Backward needs nothing from other ranks:
softmax = exp(logit - lse) with the global lse. torch's `loss_parallel` does the same for
`F.cross_entropy`, but only with the backward inside its context (the trainer's backward is
not), and without the chunking.

Evaluation reads the same chunks (`next_token_scores`): each position's loss and the model's
prediction (the argmax, from the row maxima the log-sum-exp needs anyway; across vocabulary
shards, one all-reduce of the maxima and one of the indices), without a float32 copy of the
logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

IGNORE_INDEX = -100

# Logits per chunk (module docstring): the CPU's cache, and on any other device a size whose
# kernels outlast their launches.
CPU_CHUNK_ELEMENTS = 1 << 20
DEVICE_CHUNK_ELEMENTS = 1 << 26


def rows_per_chunk(vocab: int, device: torch.device) -> int:
    """Rows of `vocab` logits the loss reads per chunk on `device` (module docstring)."""
    budget = CPU_CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    return max(1, budget // vocab)


class _Rows(NamedTuple):
    """The logits as [tokens, columns] rows on this rank and each row's target: `group` is
    the process group over whose ranks the vocabulary is split (None: it is whole here), of
    which this rank holds the columns [first, first + columns)."""

    logits: torch.Tensor
    targets: torch.Tensor
    group: dist.ProcessGroup | None = None
    first: int = 0


Labels = torch.Tensor | Mapping[str, torch.Tensor]


def targets_of(labels: Labels) -> torch.Tensor:
    """Each position's target [batch, seq] (-100: none), from labels or a batch: position t's
    target is labels[t + 1] (the last position's is ignored). A batch may carry its `targets`
    already shifted instead of `labels`: a context-parallel rank's part of a sequence, whose
    targets were shifted over the whole sequence before it was split
    (llmfoundry/distributed/context.py). The one place that knows both."""
    if isinstance(labels, Mapping):
        if "targets" in labels:
            return labels["targets"]
        labels = labels["labels"]
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def _rows(logits: torch.Tensor, targets: torch.Tensor) -> _Rows:
    """Rows of `logits` and their `targets` (`targets_of`); a DTensor's vocabulary is read as
    this rank's columns of it."""
    if not isinstance(logits, DTensor):
        return _Rows(logits.flatten(0, 1), targets.flatten())
    mesh = logits.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"vocabulary-sharded logits must lie on one mesh axis, not {mesh.ndim}")
    vocab = logits.shape[-1]
    if vocab % mesh.size():
        raise ValueError(f"vocabulary {vocab} does not split evenly over {mesh.size()} ranks")
    sharded = logits.redistribute(mesh, [Shard(logits.ndim - 1)])  # a no-op for a TP head
    width = vocab // mesh.size()
    local = sharded.to_local().flatten(0, 1)
    return _Rows(local, targets.flatten(), mesh.get_group(), mesh.get_local_rank() * width)


def _local_targets(rows: _Rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which rows count (target not ignored), which of them have their target among this
    rank's columns, and each row's target column here (0 where it is not here)."""
    valid = rows.targets != IGNORE_INDEX
    local = rows.targets - rows.first
    here = valid & (local >= 0) & (local < rows.logits.shape[1])
    return valid, here, local.masked_fill(~here, 0)


def _row_stats(
    logits: torch.Tensor, argmax: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per row of `logits` [rows, columns], in chunks: the log-sum-exp (float32), the maximum
    (the logits' dtype) and, with `argmax`, the first column holding it."""
    n_rows, width = logits.shape
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    peak = torch.empty(n_rows, dtype=logits.dtype, device=logits.device)
    index = torch.empty(n_rows, dtype=torch.long, device=logits.device) if argmax else None
    step = rows_per_chunk(width, logits.device)
    for start in range(0, n_rows, step):
        rows = slice(start, start + step)
        chunk = logits[rows]
        if index is None:
            torch.amax(chunk, dim=1, out=peak[rows])
        else:
            torch.max(chunk, dim=1, out=(peak[rows], index[rows]))
        # As torch.logsumexp: an infinite maximum shifts by 0 (the row's result is +-inf).
        shift = torch.nan_to_num(peak[rows].float(), posinf=0.0, neginf=0.0)
        sums = torch.sub(chunk, shift[:, None]).exp_().sum(dim=1)  # float32, promoted on read
        torch.add(sums.log_(), shift, out=lse[rows])
    return lse, peak, index


def _global_lse(lse: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """log sum_r exp(lse_r) over the ranks of `group`, shifted by the rows' maxima for range."""
    peak = lse.clone()
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    total = (lse - peak).exp()
    dist.all_reduce(total, group=group)
    return total.log_() + peak


def _global_argmax(
    peak: torch.Tensor, index: torch.Tensor, rows: _Rows, vocab: int
) -> torch.Tensor:
    """The first vocabulary index of each row's maximum over the ranks of `rows.group`, from
    each rank's row maxima and their columns: two all-reduces of [rows] numbers."""
    mine = peak.float()
    best = mine.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=rows.group)
    candidate = torch.where(mine == best, index + rows.first, vocab)
    dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=rows.group)
    return candidate


def _target_logit(logits: torch.Tensor, column: torch.Tensor, here: torch.Tensor) -> torch.Tensor:
    """Each row's logit at `column` (float32), 0 where the target is not `here`."""
    return logits.gather(1, column[:, None]).squeeze(1).float() * here


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum over rows of -log softmax(logits)[target], ignoring rows whose target is -100.

    With a `group`, `logits` are this rank's columns [first, first + width) of the vocabulary
    and the other ranks of `group` hold the rest: targets outside this rank's columns count
    on the rank that holds them, and row log-sum-exps combine over the group."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: dist.ProcessGroup | None = None,
        first: int = 0,
    ) -> torch.Tensor:
        valid, here, column = _local_targets(_Rows(logits, targets, group, first))
        target_logit = _target_logit(logits, column, here)
        lse, _, _ = _row_stats(logits)
        if group is not None:
            lse = _global_lse(lse, group)
            dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(logits, column, here, valid, lse)
        return ((lse - target_logit) * valid).sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, column, here, valid, lse = ctx.saved_tensors
        n_rows, width = logits.shape
        grad = torch.empty_like(logits)
        # d/dlogits = (softmax - onehot(target)) * grad_output, zero on ignored rows.
        math_dtype = torch.promote_types(logits.dtype, torch.float32)
        scale = (valid.to(math_dtype) * grad_output)[:, None]
        onehot = -here.to(math_dtype)[:, None]
        in_place = grad.dtype == math_dtype
        step = rows_per_chunk(width, logits.device)
        for start in range(0, n_rows, step):
            rows = slice(start, start + step)
            # float32 logits: softmax straight into the gradient's rows (no temporary); bf16 or
            # fp16: in a float32 temporary, cast as the scaled result is written into the
            # gradient.
            probs = torch.sub(logits[rows], lse[rows, None], out=grad[rows] if in_place else None)
            probs.exp_().scatter_add_(1, column[rows, None], onehot[rows])
            torch.mul(probs, scale[rows], out=grad[rows])
        return grad, None, None, None


def next_token_loss_sum(logits: torch.Tensor, labels: Labels) -> torch.Tensor:
    """Cross-entropy of each position's logits [batch, seq, vocab] against the next label
    (`targets_of` labels or a batch), summed over positions whose target is not -100; float32.
    `logits` may be a DTensor over one mesh axis (a tensor-parallel head's): read
    vocabulary-sharded, the same sum on every rank of that axis."""
    return _ChunkedCrossEntropySum.apply(*_rows(logits, targets_of(labels)))


@torch.no_grad()
def next_token_scores(logits: torch.Tensor, labels: Labels) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's cross-entropy against its target (`targets_of` labels or a batch;
    float32 [batch, seq], 0 where the target is -100) and the model's prediction there (the
    argmax of its logits, the first on ties: int64 [batch, seq]), for evaluation.

    The logits are read in their own dtype, chunk by chunk (module docstring), so they are
    never copied whole; a vocabulary-sharded DTensor stays sharded (per-row numbers cross its
    ranks, the same results on each)."""
    targets = targets_of(labels)
    rows = _rows(logits, targets)
    valid, here, column = _local_targets(rows)
    target_logit = _target_logit(rows.logits, column, here)
    lse, peak, index = _row_stats(rows.logits, argmax=True)
    if rows.group is not None:
        lse = _global_lse(lse, rows.group)
        dist.all_reduce(target_logit, group=rows.group)
        index = _global_argmax(peak, index, rows, logits.shape[-1])
    losses = torch.where(valid, lse - target_logit, 0.0)
    return losses.view(targets.shape), index.view(targets.shape)


def next_token_loss(logits: torch.Tensor, labels: Labels) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose label is not -100: every family's
    `loss(outputs, batch)` (the model contract, `llmfoundry.core.model`).

    Position t's logits predict labels[t + 1], so labels are the inputs themselves. The loss is
    computed in float32. A batch with no counted position gives 0 (not NaN), so an all-padding
    microbatch adds nothing to an accumulated gradient. `labels` may be the batch holding
    them (the trainer's ``model.loss(outputs, batch)``), or its already shifted `targets`
    (`targets_of`).
    """
    targets = targets_of(labels)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(targets.shape)} must equal logits shape without the vocab "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    total = _ChunkedCrossEntropySum.apply(*_rows(logits, targets))  # chunked: no float32 copy
    return total / (targets != IGNORE_INDEX).sum().clamp(min=1)
