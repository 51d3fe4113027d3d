"""Next-token cross-entropy over the vocabulary, computed in row chunks.

`F.cross_entropy` on a small model's [tokens, vocab] logits is a large share of the step: it writes
a full float32 log-softmax, keeps it for backward, writes a full gradient of it, and the shift
(`logits[:, :-1]`) adds a zero-filled full-size gradient and a copy in backward; in bf16 autocast
the `.float()` of the logits is one more full float32 copy. Here the loss walks the logits in
chunks of rows small enough to stay in cache: forward keeps only each row's log-sum-exp (float32),
backward recomputes softmax per chunk and writes the gradient once, in the logits' dtype. The
shift is done on the labels (the last position of each row gets no target), so the logits are
never sliced. The math is float32 throughout, as `F.cross_entropy(logits.float(), ...)`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

IGNORE_INDEX = -100

# Logits per chunk: 1M (4 MB in float32), small enough for one chunk's temporaries to stay in a
# core's cache, large enough that the per-chunk overhead is negligible.
_CHUNK_ELEMENTS = 1 << 20


def _rows_per_chunk(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab)


class _ChunkedCrossEntropySum(torch.autograd.Function):
    """Sum over rows of -log softmax(logits)[target], ignoring rows whose target is -100."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        n_rows, vocab = logits.shape
        valid = targets != IGNORE_INDEX
        safe_targets = targets.masked_fill(~valid, 0)
        lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        target_logit = logits.gather(1, safe_targets[:, None]).squeeze(1).float()
        step = _rows_per_chunk(vocab)
        for start in range(0, n_rows, step):
            chunk = logits[start : start + step].float()
            torch.logsumexp(chunk, dim=1, out=lse[start : start + step])
        ctx.save_for_backward(logits, safe_targets, valid, lse)
        return ((lse - target_logit) * valid).sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, safe_targets, valid, lse = ctx.saved_tensors
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
            probs[rows, safe_targets[start:stop]] -= 1.0
            probs.mul_(scale[start:stop, None])
            if probs.dtype != grad.dtype:
                grad[start:stop] = probs
        return grad, None


def next_token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits [batch, seq, vocab] against the next label,
    summed over positions whose next label is not -100; float32."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return _ChunkedCrossEntropySum.apply(logits.flatten(0, 1), targets.flatten())


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
