"""The two questions every evaluation asks of a causal LM, batched: how likely is this
continuation after this context (multiple choice, LAMBADA, lm-eval's ``loglikelihood``), and
what does the model write after this prompt (question answering, lm-eval's ``generate_until``).

Both run on a `Forward`: the model's forward over a batch of right-padded token ids, with a
reduction applied where the logits are, whose (small) result every process gets. On one process
that is `ModelForward`; on a mesh (tensor or pipeline parallel, FSDP) it is
llmfoundry/eval/forward.py's, so the same scoring code gives the same answers on any mesh.
Right padding changes nothing before it in a causal model, so a row's scores do not depend on
the rows batched with it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from llmfoundry.utils.errors import UserError

__all__ = [
    "Continuation",
    "Forward",
    "ModelForward",
    "Scored",
    "greedy_continue",
    "score_continuations",
]

Reduce = Callable[[torch.Tensor], torch.Tensor]


class Forward(Protocol):
    """`reduce(logits [B, L, V])` of the model's forward over `ids` [B, L] (right-padded with
    any token), on every process alike; no gradients."""

    def __call__(self, ids: torch.Tensor, reduce: Reduce) -> torch.Tensor: ...


class ModelForward:
    """`Forward` of a whole model on this process (one process, DDP, FSDP: every rank calls
    it with the same ids)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor, reduce: Reduce) -> torch.Tensor:
        device = next(self.model.parameters()).device
        with torch.no_grad():
            return reduce(self.model(ids.to(device))).cpu()


@dataclass(frozen=True)
class Continuation:
    """A continuation to score after its context (token ids)."""

    context: Sequence[int]
    continuation: Sequence[int]


@dataclass(frozen=True)
class Scored:
    """`logprob`: the sum of the continuation tokens' log-probabilities; `greedy`: whether each
    of them is the most likely token at its position (teacher forcing); `tokens`: how many."""

    logprob: float
    greedy: bool
    tokens: int

    @property
    def mean_loss(self) -> float:
        """The mean cross-entropy per continuation token (lower is likelier)."""
        return -self.logprob / self.tokens


def _window(request: Continuation, max_seq_len: int) -> list[int]:
    """Context and continuation, the context's start cut where both exceed `max_seq_len` + 1:
    the last token is only predicted, never an input, so the model sees `max_seq_len` tokens
    (as lm-evaluation-harness cuts: its rolling windows are `max_seq_len` + 1 long)."""
    answer = list(request.continuation)
    if not answer:
        raise UserError("a continuation that tokenizes to nothing cannot be scored")
    ids = (list(request.context) + answer)[-(max_seq_len + 1) :]
    if len(ids) <= len(answer):
        raise UserError(
            f"a continuation of {len(answer)} tokens leaves no room for its context in "
            f"max_seq_len={max_seq_len}"
        )
    return ids


def _continuation_scores(
    positions: torch.Tensor, targets: torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """[2, B, A] float64: the log-probability of each continuation token `targets` [B, A] at
    its `positions` [B, A] of `logits` [B, L, V], and whether it is the most likely there. Only
    those positions' rows are normalized (not the whole [B, L, V])."""
    index = positions.to(logits.device)[..., None].expand(-1, -1, logits.shape[-1])
    picked = F.log_softmax(logits.gather(1, index).float(), dim=-1)
    wanted = targets.to(logits.device)[..., None]
    logprob = picked.gather(2, wanted)[..., 0]
    greedy = (picked.argmax(dim=-1, keepdim=True) == wanted)[..., 0]
    return torch.stack([logprob.double(), greedy.double()])


def _last_argmax(last: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The most likely next token [B] after each row's position `last` [B] of `logits`."""
    rows = torch.arange(len(last), device=logits.device)
    return logits[rows, last.to(logits.device)].float().argmax(dim=-1)


def score_continuations(
    forward: Forward,
    requests: Sequence[Continuation],
    max_seq_len: int,
    batch_size: int = 8,
) -> list[Scored]:
    """Each request's `Scored`, in order; `batch_size` rows per forward (longest first, so
    rows of like length share a batch)."""
    windows = [_window(r, max_seq_len) for r in requests]
    answers = [len(r.continuation) for r in requests]
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i]))
    results: list[Scored | None] = [None] * len(windows)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(len(windows[i]) for i in rows) - 1  # the last token is not an input
        span = max(answers[i] for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        # positions[b, j]: where the logits predicting row b's j-th continuation token are
        positions = torch.zeros(len(rows), span, dtype=torch.long)
        targets = torch.zeros(len(rows), span, dtype=torch.long)
        for b, i in enumerate(rows):
            n, a = len(windows[i]), answers[i]
            ids[b, : n - 1] = torch.tensor(windows[i][:-1])
            positions[b, :a] = torch.arange(n - a - 1, n - 1)
            targets[b, :a] = torch.tensor(windows[i][n - a :])

        out = forward(ids, functools.partial(_continuation_scores, positions, targets))
        for b, i in enumerate(rows):
            a = answers[i]
            results[i] = Scored(
                logprob=float(out[0, b, :a].sum()), greedy=bool(out[1, b, :a].all()), tokens=a
            )
    return [r for r in results if r is not None]


def greedy_continue(
    forward: Forward,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    max_seq_len: int,
    stop: Callable[[list[int]], bool] | None = None,
    batch_size: int = 8,
) -> list[list[int]]:
    """The greedy continuation of each prompt: up to `max_new_tokens` new tokens, or until
    `stop(new tokens so far)` says the row is done (the tokens that made it stop are kept).
    Recomputes the whole sequence per token (no KV cache), so it runs on any `Forward`. A prompt
    longer than `max_seq_len - max_new_tokens` loses its start."""
    if max_new_tokens >= max_seq_len:
        raise UserError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in "
            f"max_seq_len={max_seq_len}"
        )
    keep = max_seq_len - max_new_tokens
    rows = [list(p)[-keep:] for p in prompts]
    if any(not row for row in rows):
        raise UserError("an empty prompt cannot be continued")
    new: list[list[int]] = [[] for _ in rows]
    for start in range(0, len(rows), batch_size):
        batch = list(range(start, min(start + batch_size, len(rows))))
        for _ in range(max_new_tokens):
            live = [i for i in batch if not (stop is not None and new[i] and stop(new[i]))]
            live = [i for i in live if len(new[i]) < max_new_tokens]
            if not live:
                break
            lengths = [len(rows[i]) + len(new[i]) for i in live]
            ids = torch.zeros(len(live), max(lengths), dtype=torch.long)
            for b, i in enumerate(live):
                ids[b, : lengths[b]] = torch.tensor(rows[i] + new[i])
            last = torch.tensor(lengths) - 1
            for i, token in zip(
                live, forward(ids, functools.partial(_last_argmax, last)).tolist(), strict=True
            ):
                new[i].append(int(token))
    return new
