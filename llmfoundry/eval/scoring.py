"""The two questions every evaluation asks of a causal LM, batched: how likely is this
continuation after this context (multiple choice, LAMBADA, lm-eval's ``loglikelihood``), and
what does the model write after this prompt (question answering, lm-eval's ``generate_until``,
samples during training: greedy or sampled, tokens chosen as `generation.generate` chooses them).

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

from llmfoundry.models.families import family_of, find_family
from llmfoundry.models.generation import (
    GREEDY_BELOW,
    Decoder,
    GenerationConfig,
    apply_repetition_penalty,
    left_pad,
    sampling_probs,
)
from llmfoundry.utils.errors import UserError

__all__ = [
    "Continuation",
    "Forward",
    "ModelForward",
    "NextTokens",
    "Scored",
    "continue_prompts",
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
    """The greedy continuation of each prompt (`continue_prompts` at temperature 0)."""
    config = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    return continue_prompts(forward, prompts, config, max_seq_len, stop, batch_size)


def continue_prompts(
    forward: Forward,
    prompts: Sequence[Sequence[int]],
    config: GenerationConfig,
    max_seq_len: int,
    stop: Callable[[list[int]], bool] | None = None,
    batch_size: int = 8,
) -> list[list[int]]:
    """Each prompt's continuation as `generation.generate` chooses it (`config`'s temperature,
    top-k, top-p, repetition penalty and seed; `NextTokens`): up to `config.max_new_tokens`
    new tokens, to its `eos_token_id` (kept), or until `stop(new tokens so far)` says the row is
    done (the tokens that made it stop are kept; stop strings need the text: give `stop`).
    Recomputes the whole sequence per token (no KV cache), so it runs on any `Forward`; a whole
    model of a family on this process (`ModelForward`) decodes with `generation.Decoder`'s KV
    cache instead, choosing the same tokens. A prompt longer than
    `max_seq_len - max_new_tokens` loses its start."""
    if config.stop or config.logprobs is not None or config.prompt_logprobs:
        raise UserError(
            "continue_prompts returns tokens only: pass stop strings as stop=, and ask "
            "generation.generate for log-probabilities"
        )
    max_new_tokens = config.max_new_tokens
    if max_new_tokens >= max_seq_len:
        raise UserError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in "
            f"max_seq_len={max_seq_len}"
        )
    keep = max_seq_len - max_new_tokens
    rows = [list(p)[-keep:] for p in prompts]
    if any(not row for row in rows):
        raise UserError("an empty prompt cannot be continued")
    if _decodes_with_a_cache(forward):
        return _continue_cached(forward.model, rows, config, stop, batch_size)
    choose = NextTokens(config)
    new: list[list[int]] = [[] for _ in rows]

    def done(i: int) -> bool:
        tokens = new[i]
        return len(tokens) >= max_new_tokens or bool(
            tokens and (tokens[-1] == config.eos_token_id or (stop is not None and stop(tokens)))
        )

    for start in range(0, len(rows), batch_size):
        batch = range(start, min(start + batch_size, len(rows)))
        while live := [i for i in batch if not done(i)]:
            sequences = [rows[i] + new[i] for i in live]
            ids = torch.zeros(len(live), max(map(len, sequences)), dtype=torch.long)
            for b, sequence in enumerate(sequences):
                ids[b, : len(sequence)] = torch.tensor(sequence)
            tokens = forward(ids, functools.partial(choose, live, sequences))
            for i, token in zip(live, tokens.tolist(), strict=True):
                new[i].append(int(token))
    return new


def _decodes_with_a_cache(forward: Forward) -> bool:
    """Whether `forward` is a whole family model's on this process whose rows may be padded
    (infini-attention's may not), so `generation.Decoder` can continue prompts with its cache."""
    if not isinstance(forward, ModelForward) or find_family(forward.model) is None:
        return False
    return not family_of(forward.model).recurrent_memory(forward.model.config)


def _continue_cached(
    model: torch.nn.Module,
    rows: list[list[int]],
    config: GenerationConfig,
    stop: Callable[[list[int]], bool] | None,
    batch_size: int,
) -> list[list[int]]:
    """`continue_prompts` by `generation.Decoder` (left-padded batches, a KV cache): a row that
    `stop` ends is cancelled, which the decoder leaves out of its next step."""
    new: list[list[int]] = []
    for start in range(0, len(rows), batch_size):
        ids, mask = left_pad(rows[start : start + batch_size])
        decoder = Decoder(model, ids, mask, config)
        while not decoder.done:
            for row, token in enumerate(decoder.step()):
                if token is not None and stop is not None and stop(decoder.tokens[row]):
                    decoder.cancel(row)
        new += decoder.output().tokens
    return new


class NextTokens:
    """The next token of each row after its sequence, from the logits [B, L, V] of the rows
    (right-padded), chosen as `generation.Decoder` chooses it: the repetition penalty, then the
    most likely token (temperature 0) or a draw from `sampling_probs` with the row's own
    generator seeded with `config.seed` (each row's, as the decoder's rows each have one; None:
    the global RNG, which differs between processes, so a mesh needs a seed). The generators
    are made where the logits are, at the first draw: under a pipeline, on the last stage."""

    def __init__(self, config: GenerationConfig) -> None:
        self.config = config
        self.generators: dict[int, torch.Generator] = {}

    def __call__(
        self, rows: Sequence[int], sequences: Sequence[Sequence[int]], logits: torch.Tensor
    ) -> torch.Tensor:
        """`rows`: the rows' indices among all prompts (whose generator each draws from);
        `sequences`: their tokens (prompt and new), whose last position the logits predict."""
        device, config = logits.device, self.config
        last = torch.tensor([len(s) - 1 for s in sequences], device=device)
        picked = logits[torch.arange(len(rows), device=device), last].float()
        if config.repetition_penalty != 1:
            seen = torch.zeros_like(picked, dtype=torch.bool)
            for b, sequence in enumerate(sequences):
                seen[b, torch.tensor(sequence, device=device)] = True
            penalty = picked.new_full((len(rows),), config.repetition_penalty)
            picked = apply_repetition_penalty(picked, seen, penalty)
        if config.temperature < GREEDY_BELOW:
            return picked.argmax(dim=-1)
        probs = sampling_probs(picked, [config] * len(rows))
        return torch.stack(
            [
                torch.multinomial(p, 1, generator=self._generator(row, device))[0]
                for row, p in zip(rows, probs, strict=True)
            ]
        )

    def _generator(self, row: int, device: torch.device) -> torch.Generator | None:
        if self.config.seed is None:
            return None
        if row not in self.generators:
            self.generators[row] = torch.Generator(device).manual_seed(self.config.seed)
        return self.generators[row]
