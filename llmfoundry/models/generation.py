"""Text generation from any family's causal LM (`CausalLM`): batched, left-padded prompts decoded with a KV cache.

The one entry point for callers that want whole answers is

    generate(model, input_ids, attention_mask, GenerationConfig(...) or [one per row], decode=...)

and for callers that want tokens as they come (a server streaming, or batching requests
dynamically), `Decoder`: build it with the same arguments, call `step()` until `done`, read
each row's tokens as they grow, `add(prompt, config)` a request that arrives meanwhile (it joins
the running batch and decodes exactly as it would alone), and `cancel(row)` a row whose client
went away. Finished rows leave the batch. `generate` is that loop.

Prompts of different lengths share a batch through left padding: `attention_mask` is 0 on the
padding, which becomes its own document (`sequence_id` 0, the prompt and its continuation 1), so
no real token attends to padding in any kernel, and learned positions restart at each row's first
real token. ALiBi needs nothing: it depends only on the distance between query and key.

Each row has its own sampling settings (`GenerationConfig`): temperature (0 is greedy), top-k,
top-p, a repetition penalty, stop strings, an EOS id, a token budget and a seed; the order in
which they act on the logits is transformers' (repetition penalty, temperature, top-k, top-p).
A row's `texts` grows by whole characters only (`TextStream`): a token that ends inside a
multi-byte UTF-8 character is held back until the character completes, so a server can stream
the text as it grows, and stop strings are matched on it. One bad row never ends the others: a
row whose next-token scores are not finite (a model that overflowed on its prompt) ends alone
with finish reason "error" and a message in `errors`.

With `use_cache=False` every step reruns the whole sequence instead of reading the cache: the
reference the cache is tested against, and the baseline of `bench/generation.py`.
Infini-attention models carry their compressive memory in the cache; their segments count from
each row's first token, so `generate` decodes rows of different prompt lengths in separate
batches (a `Decoder` refuses padding for them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from llmfoundry.models.families import family_of
from llmfoundry.models.family import CausalLM
from llmfoundry.models.layers.kv_cache import KVCache
from llmfoundry.utils.errors import UserError

Decode = Callable[[list[int]], str]

# Prompt positions scored at once (`prompt_logprobs`): their float32 log-probabilities
# [chunk, vocab] beside the forward's logits, not a second copy of all of them ([prompt, vocab]:
# 0.5 GB for a 1k-token prompt over a 128k vocabulary, per prompt scored).
PROMPT_SCORE_CHUNK = 256

# Temperatures below this are greedy: dividing logits by them overflows float32, and the
# distribution they describe is the most likely token already.
GREEDY_BELOW = 1e-5


def new_cache(model: CausalLM, max_len: int) -> KVCache:
    """An empty cache for `model` (any family's) holding up to `max_len` positions: a key/value
    buffer per layer, or infini-attention's memory where the family keeps one."""
    recurrent = family_of(model).recurrent_memory(model.config)
    return KVCache.empty(model.config.n_layers, max_len, recurrent)


@dataclass(frozen=True)
class GenerationConfig:
    """How to continue one prompt.

    `temperature=0` picks the most likely token (greedy), and so does any temperature below
    `GREEDY_BELOW` (1e-5); otherwise tokens are sampled after dividing the logits by it,
    keeping the `top_k` most likely tokens and the smallest set whose probability reaches
    `top_p`. `repetition_penalty` > 1 makes tokens already in the row (prompt
    included) less likely (CTRL's rule: positive logits divided, negative ones multiplied).
    Generation of a row ends after `max_new_tokens`, at `eos_token_id` (kept in the tokens), or
    when the decoded text contains one of `stop` (the text is cut before it). `seed` makes the
    row's samples reproducible whatever else is in the batch (None: the global torch RNG).
    `logprobs` (k >= 0) records each new token's log-probability under the model (before the
    sampling settings) with the k most likely tokens', and `prompt_logprobs` those of every
    prompt token after the first, from the same forward that reads the prompt (scoring, as
    OpenAI's `echo`); both are in `Decoder.logprobs` and `Decoder.prompt_logprobs`.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    eos_token_id: int | None = None
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise UserError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}"
            )
        if not self.temperature >= 0:
            raise UserError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise UserError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if not self.repetition_penalty > 0:
            raise UserError(
                f"repetition_penalty must be > 0 (1: none), got {self.repetition_penalty!r}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError(f"stop must hold non-empty strings, got {self.stop!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise UserError(f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}")


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability under the model, and the `top` most likely (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationOutput:
    """Per row: the new tokens, why generation ended ("eos", "stop", "length", "cancelled" or
    "error", whose message is in `errors`), and the decoded new text (cut before a stop string)
    when `decode` was given."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    texts: list[str] | None = field(default=None)
    errors: list[str | None] = field(default_factory=list)


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [batch, longest] for token lists of any lengths, left-padded."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def sequence_ids(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """Document ids for left-padded rows (padding 0, the text 1); None when nothing is padded.

    A mask that is not 0s then 1s in every row, or a row of padding only, is refused.
    """
    mask = attention_mask.to(torch.long)
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (tokens)")
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError(
            "attention_mask must be left padding (0s then 1s in each row); pad prompts on the "
            "left, e.g. with generation.left_pad"
        )
    if (mask[:, -1] == 0).any():
        raise ValueError("attention_mask has a row of padding only; every prompt needs a token")
    return None if bool(mask.all()) else mask


class Decoder:
    """One batch of prompts being continued, a token per row at each `step()`.

    `input_ids` [batch, prompt_len] are left-padded (`attention_mask` 0 on padding, or None for
    none); `configs` is one GenerationConfig for every row or one per row. `decode` turns token
    ids into text (needed for stop strings; e.g. a tokenizer's `decode`). The model is run in
    eval mode and without gradients, and put back in its mode after each step. A row that
    finishes (or is cancelled) leaves the batch tensors and the cache at the next step, so it
    costs nothing more; rows keep their input index in every result.
    """

    def __init__(
        self,
        model: CausalLM,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        configs: GenerationConfig | Sequence[GenerationConfig] = GenerationConfig(),
        decode: Decode | None = None,
        use_cache: bool = True,
    ) -> None:
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be [batch, prompt_len] with a token, got {tuple(input_ids.shape)}"
            )
        batch, prompt_len = input_ids.shape
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        if isinstance(configs, GenerationConfig):
            configs = [configs] * batch
        if len(configs) != batch:
            raise ValueError(f"got {len(configs)} GenerationConfigs for {batch} prompts")
        if decode is None and any(c.stop for c in configs):
            raise ValueError("stop strings need `decode` (e.g. tokenizer.decode) to read the text")
        cfg = model.config
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size:
            raise UserError(
                f"input_ids must be token ids in [0, {cfg.vocab_size}) (the model's vocab_size), "
                f"got values from {int(input_ids.min())} to {int(input_ids.max())}"
            )
        self.model, self.configs = model, list(configs)
        self.decode, self.use_cache = decode, use_cache
        device = model.transformer.wte.weight.device
        self.ids = input_ids.to(device)
        self.sid = None if attention_mask is None else sequence_ids(attention_mask.to(device))
        family = family_of(model)
        if family.recurrent_memory(cfg) and self.sid is not None:
            raise ValueError(
                "infini-attention counts segments from each row's first token, so its rows cannot "
                "be padded; decode prompts of different lengths separately (generate() does)"
            )
        self.max_len = prompt_len + max(c.max_new_tokens for c in configs)
        if (limit := family.position_limit(cfg)) is not None and self.max_len > limit:
            raise UserError(
                f"prompt ({prompt_len} tokens) + max_new_tokens is {self.max_len} tokens, more "
                f"than max_seq_len {limit} (the learned position table); shorten one"
            )
        self.cache = new_cache(model, self.max_len) if use_cache else None
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.finish_reasons: list[str | None] = [None] * batch
        self.errors: list[str | None] = [None] * batch  # why a row ended with "error"
        self.texts: list[str] = [""] * batch
        self._streams = [TextStream(decode) for _ in range(batch)] if decode else []
        # Rows' log-probabilities, when their config asks (GenerationConfig.logprobs).
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(batch)]
        self.prompt_logprobs: list[list[TokenLogprob]] = [[] for _ in range(batch)]
        self._read_prompts = False  # whether the first forward (the prompts) has run
        self._generators = [
            None if c.seed is None else torch.Generator(device).manual_seed(c.seed) for c in configs
        ]
        self._penalty = torch.tensor(
            [c.repetition_penalty for c in configs], device=device, dtype=torch.float32
        )
        self._seen = None
        if bool((self._penalty != 1).any()):
            real = self.ids if self.sid is None else self.ids.masked_fill(self.sid == 0, -1)
            self._seen = torch.zeros(batch, cfg.vocab_size, dtype=torch.bool, device=device)
            rows, cols = (real >= 0).nonzero(as_tuple=True)
            self._seen[rows, real[rows, cols]] = True
        self._next_input = self.ids  # what the next forward reads (all of it without a cache)
        # The rows still in the batch tensors, by their index in the input; finished rows leave.
        self._active = list(range(batch))

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.finish_reasons)

    def add(self, prompt: Sequence[int], config: GenerationConfig = GenerationConfig()) -> int:
        """Join a new prompt to the running batch (continuous batching); returns its row.

        The prompt is run alone (its first token is chosen at once, and is in `tokens`), then its
        cache joins the batch's, the shorter side left-padded (`KVCache.join`), so from the next
        `step()` it decodes with the others, exactly as it would alone. Needs the KV cache, a
        batch that has stepped at least once, and a model without infini-attention.
        """
        if self.cache is None or self.cache.length == 0:
            raise ValueError("add() joins a running batch: use_cache=True and step() once first")
        if family_of(self.model).recurrent_memory(self.model.config):
            raise ValueError("infini-attention rows cannot be padded, so they cannot join a batch")
        newcomer = Decoder(self.model, torch.tensor([list(prompt)]), None, config, self.decode)
        newcomer.step()
        row = len(self.tokens)
        self.tokens += newcomer.tokens
        self.finish_reasons += newcomer.finish_reasons
        self.errors += newcomer.errors
        self.texts += newcomer.texts
        self._streams += newcomer._streams
        self.logprobs += newcomer.logprobs
        self.prompt_logprobs += newcomer.prompt_logprobs
        self.configs += newcomer.configs
        self._generators += newcomer._generators
        if newcomer.done:
            return row
        self._drop_finished()
        self.cache.join(newcomer.cache)
        self._active.append(row)
        self._next_input = torch.cat([self._next_input, newcomer._next_input])
        self._penalty = torch.cat([self._penalty, newcomer._penalty])
        if self._seen is not None or newcomer._seen is not None:
            vocab = self.model.config.vocab_size
            seen = [
                d._seen
                if d._seen is not None
                else self._penalty.new_zeros(n, vocab, dtype=torch.bool)
                for d, n in ((self, len(self._active) - 1), (newcomer, 1))
            ]
            self._seen = torch.cat(seen)
        return row

    def cancel(self, row: int) -> None:
        """Stop decoding `row` (its client left); the batch goes on without it."""
        if self.finish_reasons[row] is None:
            self.finish_reasons[row] = "cancelled"

    def step(self) -> list[int | None]:
        """Generate one more token for every unfinished row; returns it (None: finished rows)."""
        if self.done:
            raise RuntimeError("every row has finished; read the output")
        self._drop_finished()
        # Eager even if the blocks are compiled: every step has new shapes (one more key), and
        # recompiling per step would cost far more than it saves.
        with torch.no_grad(), eval_mode(self.model), torch.compiler.set_stance("force_eager"):
            every = self._forward()
        if not self._read_prompts:
            self._score_prompts(every)
            self._read_prompts = True
        logits = every[:, -1]
        chosen_, failed = self._choose(logits.float())
        chosen = chosen_.tolist()
        new: list[int | None] = [None] * len(self.tokens)
        for j, (row, token) in enumerate(zip(self._active, chosen, strict=True)):
            if j in failed:  # ends alone; its placeholder token leaves with it at the next step
                self.finish_reasons[row], self.errors[row] = "error", failed[j]
                continue
            new[row] = token
            if self.configs[row].logprobs is not None:
                lp = logits[j].float().log_softmax(dim=-1)
                self.logprobs[row] += _entries(lp[None], [token], self.configs[row].logprobs)
            self._accept(row, token)
        feed = torch.tensor(chosen, device=self.ids.device, dtype=torch.long)[:, None]
        if self._seen is not None:
            self._seen[torch.arange(len(chosen), device=feed.device), feed[:, 0]] = True
        if self.use_cache:
            self._next_input = feed
        else:
            self._next_input = torch.cat([self._next_input, feed], dim=1)
        return new

    def output(self) -> GenerationOutput:
        reasons = [r or "length" for r in self.finish_reasons]
        texts = None if self.decode is None else list(self.texts)
        tokens = [list(t) for t in self.tokens]
        return GenerationOutput(tokens, reasons, texts, list(self.errors))

    def _forward(self) -> torch.Tensor:
        """Logits [batch, new positions, vocab] of the sequence so far (the last one: next)."""
        ids = self._next_input
        if self.cache is not None and self.cache.length > 0:  # new tokens are real (id 1)
            sid = None if self.cache.sequence_id is None else torch.ones_like(ids)
        elif self.sid is None:
            sid = None
        else:
            grown = ids.shape[1] - self.sid.shape[1]
            sid = torch.cat([self.sid, self.sid.new_ones(ids.shape[0], grown)], dim=1)
        return self.model(ids, sid, cache=self.cache)

    def _score_prompts(self, logits: torch.Tensor) -> None:
        """Each asking row's prompt log-probabilities, from the logits of the first forward
        [active rows, prompt positions, vocab] (a row's prompt is its last real tokens)."""
        for j, row in enumerate(self._active):
            cfg = self.configs[row]
            if not cfg.prompt_logprobs:
                continue
            prompt = self._next_input[j]  # the rows' prompts, as the first forward read them
            ids = (prompt if self.sid is None else prompt[self.sid[j] != 0]).tolist()
            first, scored = logits.shape[1] - len(ids), []
            # Position first + i predicts ids[i + 1]; a chunk at a time (`PROMPT_SCORE_CHUNK`).
            for start in range(0, len(ids) - 1, PROMPT_SCORE_CHUNK):
                stop = min(start + PROMPT_SCORE_CHUNK, len(ids) - 1)
                lp = logits[j, first + start : first + stop].float().log_softmax(dim=-1)
                scored += _entries(lp, ids[start + 1 : stop + 1], cfg.logprobs or 0)
            self.prompt_logprobs[row] = scored

    def _drop_finished(self) -> None:
        """Take finished (or cancelled) rows out of the batch, so they cost no more compute."""
        keep = [j for j, row in enumerate(self._active) if self.finish_reasons[row] is None]
        if len(keep) == len(self._active):
            return
        index = torch.tensor(keep, device=self.ids.device)
        self._active = [self._active[j] for j in keep]
        self._next_input = self._next_input[index]
        if self.sid is not None and (self.cache is None or self.cache.length == 0):
            self.sid = self.sid[index]  # the prompts' ids, read until the cache holds them
        self._penalty = self._penalty[index]
        if self._seen is not None:
            self._seen = self._seen[index]
        if self.cache is not None:
            self.cache.select(index)

    def _choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, str]]:
        """The next token of every active row from its last logits [active rows, vocab], and
        the rows (positions among the active ones) that have none, with why."""
        if self._seen is not None:
            logits = apply_repetition_penalty(logits, self._seen, self._penalty)
        chosen = logits.argmax(dim=-1)
        failed = {j: NOT_FINITE for j in logits.isnan().any(dim=-1).nonzero()[:, 0].tolist()}
        sampled = [
            j
            for j, row in enumerate(self._active)
            if self.configs[row].temperature >= GREEDY_BELOW and j not in failed
        ]
        if not sampled:
            return chosen, failed
        rows = [self._active[j] for j in sampled]
        probs = sampling_probs(logits[sampled], [self.configs[row] for row in rows])
        drawable = probs.isfinite().all(dim=-1) & (probs.sum(dim=-1) > 0)
        for j, row, p, ok in zip(sampled, rows, probs, drawable.tolist(), strict=True):
            if ok:
                chosen[j] = torch.multinomial(p, 1, generator=self._generators[row])[0]
            else:
                failed[j] = NOT_FINITE
        return chosen, failed

    def _accept(self, row: int, token: int) -> None:
        cfg, tokens = self.configs[row], self.tokens[row]
        tokens.append(token)
        if self.decode is not None:
            stream = self._streams[row]
            if token != cfg.eos_token_id:
                stream.push(token)
            if token == cfg.eos_token_id or len(tokens) >= cfg.max_new_tokens:
                stream.flush()  # the row ends: a character it left unfinished ends too
            text = stream.text
            hits = [text.find(s) for s in cfg.stop if s in text]
            if hits:
                self.texts[row] = text[: min(hits)]
                self.finish_reasons[row] = "stop"
                return
            self.texts[row] = text
        if token == cfg.eos_token_id:
            self.finish_reasons[row] = "eos"
        elif len(tokens) >= cfg.max_new_tokens:
            self.finish_reasons[row] = "length"


NOT_FINITE = (
    "generation failed for this prompt: the model's next-token scores are not finite (NaN or "
    "inf), so no token can be chosen; other requests are unaffected"
)


def _entries(logprobs: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """TokenLogprobs of `tokens` from log-probabilities [len(tokens), vocab], top `k` each."""
    if not tokens:
        return []
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0]
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0])
    return [
        TokenLogprob(t, lp, tuple(zip(ids, lps, strict=True)))
        for t, lp, ids, lps in zip(
            tokens, chosen.tolist(), top_ids.long().tolist(), top_lp.tolist(), strict=True
        )
    ]


class TextStream:
    """The text of a growing token sequence, by whole characters.

    A byte-level tokenizer can split one character over tokens; decoding a prefix that ends
    inside it gives U+FFFD marks (one for a ByteLevel decoder, one per byte with byte fallback)
    that the next tokens replace. So `push` holds back the decoded text's trailing marks, up to
    `PENDING` of them (a character's unfinished part is at most 3 bytes; marks before those are
    bytes that never form a character, and stay U+FFFD as in a decode of the whole sequence),
    until a token ends the text cleanly (and all of them while the window's decode disagrees
    with what it already gave: byte fallback decodes a run of byte tokens that is not UTF-8 as
    one mark per byte, the bytes of finished characters included). It decodes a window that
    starts one clean piece back (TGI's and vLLM's rule), so decoders that strip a leading space
    see the same context as a decode of everything, at a cost that does not grow with the text.
    `flush` adds what is held back when the sequence ends.
    """

    PENDING = 3

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # the window's first token: the clean point before the last one
        self._clean = 0  # the last token after which the decoded text ended cleanly
        self._sent = ""  # the window's text already in `text`

    def push(self, token: int) -> str:
        """Add a token; returns the text it completes ("" while a character is unfinished)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character's U+FFFD), now added."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self.decode(self.ids[self._prefix :])
        marks = len(window) - len(window.rstrip("\ufffd"))
        if not final and marks and not window.startswith(self._sent):
            return ""  # a decode that changed what it gave: wait for the character to finish
        end = len(window) if final else len(window) - min(marks, self.PENDING)
        new = window[len(self._sent) : end]
        self.text += new
        self._sent += new
        if end == len(window):  # clean: the next window starts at the previous clean point
            self._prefix, self._clean = self._clean, len(self.ids)
            self._sent = self.decode(self.ids[self._prefix :])
        return new


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """CTRL's penalty on tokens already `seen` [batch, vocab]: logit / p if > 0, else logit * p."""
    p = penalty[:, None]
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def sampling_probs(logits: torch.Tensor, configs: Sequence[GenerationConfig]) -> torch.Tensor:
    """Probabilities [rows, vocab] after each row's temperature, top-k and top-p.

    The most likely logit is subtracted before dividing by the temperature, so the top token's
    scaled logit is 0 and a small temperature sends the others to -inf, never to +inf (which
    softmax would turn into NaN).
    """
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([c.temperature for c in configs], device=device)
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]
    if any(c.top_k is not None for c in configs):
        k = torch.tensor([min(c.top_k or vocab, vocab) for c in configs], device=device)
        ranked = logits.sort(dim=-1, descending=True).values
        kth = ranked.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(c.top_p is not None for c in configs):
        top_p = torch.tensor([c.top_p or 1.0 for c in configs], device=device)
        ranked, order = logits.sort(dim=-1, descending=True)
        probs = ranked.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        drop_ranked = before >= top_p[:, None]
        drop_ranked[:, 0] = False  # always keep the most likely token
        drop = drop_ranked.scatter(1, order, drop_ranked)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def generate(
    model: CausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    configs: GenerationConfig | Sequence[GenerationConfig] = GenerationConfig(),
    decode: Decode | None = None,
    use_cache: bool = True,
) -> GenerationOutput:
    """Continue every prompt of the batch to its end (see `Decoder` for the arguments)."""
    if family_of(model).recurrent_memory(model.config) and attention_mask is not None:
        lengths = attention_mask.sum(dim=1)
        if bool((lengths != attention_mask.shape[1]).any()):
            return _by_length(model, input_ids, attention_mask, configs, decode, use_cache)
    decoder = Decoder(model, input_ids, attention_mask, configs, decode, use_cache)
    while not decoder.done:
        decoder.step()
    return decoder.output()


def _by_length(
    model: CausalLM,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    configs: GenerationConfig | Sequence[GenerationConfig],
    decode: Decode | None,
    use_cache: bool,
) -> GenerationOutput:
    """Decode each group of equal prompt lengths without padding; reassemble in input order."""
    sequence_ids(attention_mask)  # validate: left padding only
    batch = input_ids.shape[0]
    if isinstance(configs, GenerationConfig):
        configs = [configs] * batch
    lengths = attention_mask.sum(dim=1).tolist()
    tokens: list[list[int]] = [[] for _ in range(batch)]
    reasons, texts, errors = [""] * batch, [""] * batch, [None] * batch
    for length in sorted(set(lengths)):
        rows = [i for i, n in enumerate(lengths) if n == length]
        ids = input_ids[rows][:, input_ids.shape[1] - length :]
        out = generate(model, ids, None, [configs[i] for i in rows], decode, use_cache)
        for j, row in enumerate(rows):
            tokens[row], reasons[row], errors[row] = (
                out.tokens[j],
                out.finish_reasons[j],
                out.errors[j],
            )
            if out.texts is not None:
                texts[row] = out.texts[j]
    return GenerationOutput(tokens, reasons, None if decode is None else texts, errors)


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """`model` in eval mode (no dropout) inside, put back in its mode after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def generate_by_recompute(
    model: torch.nn.Module, prompt: Sequence[int], config: GenerationConfig
) -> list[int] | None:
    """The new tokens a module of your own (llmfoundry/models/custom.py: no family, no KV
    cache) continues `prompt` with, recomputing the whole sequence per token through its
    training forward, ``forward({"input_ids": ids})``; None when that gives no logits
    [1, seq, vocab] to sample from. Sampling is `config`'s temperature, top-k and top-p (with
    its seed); stops at its eos token or `max_new_tokens`."""
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    generator = None if config.seed is None else torch.Generator(device).manual_seed(config.seed)
    new: list[int] = []
    with torch.no_grad(), eval_mode(model):
        for _ in range(config.max_new_tokens):
            logits = model({"input_ids": ids})
            if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or len(logits) != 1:
                return None
            last = logits[:, -1].float()
            if config.temperature < GREEDY_BELOW:
                token = int(last.argmax(dim=-1))
            else:
                probs = sampling_probs(last, [config])
                token = int(torch.multinomial(probs[0], 1, generator=generator))
            new.append(token)
            if token == config.eos_token_id:
                break
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    return new
