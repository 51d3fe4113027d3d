"""Next-token cross-entropy over the vocabulary, computed in row chunks.

`F.cross_entropy` on a small model's [tokens, vocab] logits is a large share of the step: it writes
a full float32 log-softmax, keeps it for backward, writes a full gradient of it, and the shift
(`logits[:, :-1]`) adds a zero-filled full-size gradient and a copy in backward; in bf16 autocast
the `.float()` of the logits is one more full float32 copy. Here the loss walks the logits in
chunks of rows small enough to stay in cache: forward keeps only each row's log-sum-exp (float32),
backward recomputes softmax per chunk and writes the gradient once, in the logits' dtype. The
shift is done on the labels (the last position of each row gets no target), so the logits are
never sliced. The math is float32 throughout, as `F.cross_entropy(logits.float(), ...)`.

Vocabulary-sharded logits (a DTensor split on its last dimension, as a tensor-parallel output
head leaves them) are read in place: each rank runs the same chunks over its own columns, and
only per-row numbers cross ranks (each row's log-sum-exp and target logit: two all-reduces of
[tokens] floats), never the [tokens, vocab] logits. Backward needs nothing from other ranks:
softmax = exp(logit - lse) with the global lse. torch's `loss_parallel` does the same for
`F.cross_entropy`, but only with the backward inside its context (the trainer's backward is
not), and without the chunking.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

IGNORE_INDEX = -100

# Logits per chunk: 1M (4 MB in float32), small enough for one chunk's temporaries to stay in a
# core's cache, large enough that the per-chunk overhead is negligible.
_CHUNK_ELEMENTS = 1 << 20


def _rows_per_chunk(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab)


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
        n_rows, vocab = logits.shape
        valid = targets != IGNORE_INDEX
        local = targets - first
        here = valid & (local >= 0) & (local < vocab)
        safe_targets = local.masked_fill(~here, 0)
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        target_logit = logits.gather(1, safe_targets[:, None]).squeeze(1).float() * here
        step = _rows_per_chunk(vocab)
        for start in range(0, n_rows, step):
            chunk = logits[start : start + step].float()
            torch.logsumexp(chunk, dim=1, out=lse[start : start + step])
        if group is not None:  # log sum_r exp(lse_r), shifted by the rows' maxima for range
            peak = lse.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            total = (lse - peak).exp()
            dist.all_reduce(total, group=group)
            lse = total.log_() + peak
            dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(logits, safe_targets, here, valid, lse)
        return ((lse - target_logit) * valid).sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, safe_targets, here, valid, lse = ctx.saved_tensors
        n_rows, vocab = logits.shape
        grad = torch.empty_like(logits)
        # d/dlogits = (softmax - onehot(target)) * grad_output, zero on ignored rows.
        scale = valid.float() * grad_output.float()
        step = _rows_per_chunk(vocab)
        for start in range(0, n_rows, step):
            stop = min(start + step, n_rows)
            # float32 logits: compute straight into the gradient's rows (no temporary); others:
            # in a float32 temporary, cast once into the gradient. Never in the logits' storage.
            if grad.dtype == torch.float32:
                probs = torch.sub(logits[start:stop], lse[start:stop, None], out=grad[start:stop])
            else:
                probs = logits[start:stop].float() - lse[start:stop, None]
            probs.exp_()
            rows = torch.arange(stop - start, device=logits.device)
            probs[rows, safe_targets[start:stop]] -= here[start:stop].to(probs.dtype)
            probs.mul_(scale[start:stop, None])
            if probs.dtype != grad.dtype:
                grad[start:stop] = probs
        return grad, None, None, None


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits [batch, seq, vocab] against the next label,
    summed over positions whose next label is not -100; float32. `logits` may be a DTensor
    over one mesh axis (a tensor-parallel head's): read vocabulary-sharded, the same sum on
    every rank of that axis."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    if not isinstance(logits, DTensor):
        return _ChunkedCrossEntropySum.apply(logits.flatten(0, 1), targets.flatten())
    mesh = logits.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"vocabulary-sharded logits must lie on one mesh axis, not {mesh.ndim}")
    vocab = logits.shape[-1]
    if vocab % mesh.size():
        raise ValueError(f"vocabulary {vocab} does not split evenly over {mesh.size()} ranks")
    sharded = logits.redistribute(mesh, [Shard(logits.ndim - 1)])  # a no-op for a TP head
    width = vocab // mesh.size()
    return _ChunkedCrossEntropySum.apply(
        sharded.to_local().flatten(0, 1),
        targets.flatten(),
        mesh.get_group(),
        mesh.get_local_rank() * width,
    )


def next_token_loss(
    logits: torch.Tensor, labels: torch.Tensor | Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """Mean next-token cross-entropy over positions whose label is not -100: every family's
    `loss(outputs, batch)` (the model contract, `llmfoundry.core.model`).

    Position t's logits predict labels[t + 1], so labels are the inputs themselves. The loss is
    computed in float32. A batch with no counted position gives 0 (not NaN), so an all-padding
    microbatch adds nothing to an accumulated gradient. `labels` may be the batch holding
    them (the trainer's ``model.loss(outputs, batch)``).
    """
    if isinstance(labels, Mapping):
        labels = labels["labels"]
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the vocab "
            f"dimension, {tuple(logits.shape[:-1])}"
        )
    total = next_token_loss_sum(logits, labels)  # chunked: no full float32 copy
    return total / (labels[:, 1:] != IGNORE_INDEX).sum().clamp(min=1)
