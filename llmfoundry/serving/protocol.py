"""The OpenAI API's request and response bodies, as far as this server implements them.

Requests are pydantic models that forbid unknown fields, so a misspelt `max_token` is a 400
naming it rather than a silently ignored setting. Responses are plain dicts in OpenAI's shape
(`text_completion`, `chat.completion` and their streamed `.chunk` forms), which the `openai`
client parses. Completions also take token-id prompts, `echo` (the prompt before the answer)
and `logprobs` (OpenAI's legacy object: with `echo`, the prompt's own tokens too, the first one
None), and both endpoints `n` choices per prompt: what lm-evaluation-harness's
`local-completions` client sends to score multiple choice, answered as vLLM answers it.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)

from llmfoundry.models.generation import TokenLogprob

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "FINISH_REASONS",
    "error_body",
    "new_id",
]

NonEmpty = Annotated[str, StringConstraints(min_length=1)]
# Strict: JSON's true is not token 1 (a client's bug, answered as if it were a prompt).
TokenIds = Annotated[list[Annotated[int, Field(ge=0, strict=True)]], Field(min_length=1)]


def _unicode(text: str) -> str:
    """Refuse a lone surrogate (JSON's "\\ud800" escape): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"holds {text[err.start]!r} at character {err.start}, half of a UTF-16 pair (a lone "
            "surrogate); send whole characters"
        ) from None
    return text


# Text a template renders (constrained strings, such as NonEmpty, already refuse surrogates).
Text = Annotated[str, AfterValidator(_unicode)]
# Our Decoder's reasons, as OpenAI names them (an EOS token is a natural stop).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the token counts (and no choices)


class Sampling(BaseModel):
    """The fields every generating request shares."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, description="0 or below 1e-5: greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=4)] | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 63)  # what torch.Generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, description="choices per prompt (more than 1: without stream)")
    user: str | None = None

    @model_validator(mode="after")
    def _streamable(self) -> Sampling:
        if self.stream and self.n > 1:
            raise ValueError("n > 1 is served without stream; set stream to false or n to 1")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(Sampling):
    prompt: (
        NonEmpty
        | Annotated[list[NonEmpty], Field(min_length=1)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1)]
    )
    echo: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=5, strict=True, description="top alternatives per token"
    )

    @model_validator(mode="after")
    def _scored_whole(self) -> CompletionRequest:
        if self.stream and (self.echo or self.logprobs is not None):
            raise ValueError("echo and logprobs are served without stream; set stream to false")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: text, or token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: NonEmpty
    content: Text
    name: Text | None = None


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None) -> dict:
    """OpenAI's error shape: the client raises it with `message`."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_choice(
    index: int, text: str, reason: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": FINISH_REASONS[reason],
    }


def completion_logprobs(
    ids: Sequence[int],
    entries: Sequence[TokenLogprob | None],
    decode: Callable[[list[int]], str],
    offset: int = 0,
) -> dict[str, Any]:
    """OpenAI's legacy `logprobs` object for tokens `ids` with their `entries` (None: the first
    prompt token, which nothing predicts): each token's text, log-probability, the most likely
    tokens at its position with its own (as vLLM gives them), and where its text starts in the
    choice's text (`offset`: the characters before the first token)."""
    texts = [decode([t]) for t in ids]
    tops: list[dict[str, float] | None] = []
    for text, entry in zip(texts, entries, strict=True):
        if entry is None:
            tops.append(None)
            continue
        top = {text: entry.logprob}
        for token, logprob in entry.top:
            top.setdefault(decode([token]), logprob)  # two ids of one text: the likelier
        tops.append(top)
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": tops,
        "text_offset": list(itertools.accumulate(map(len, texts), initial=offset))[: len(texts)],
    }


def completion_body(
    id_: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": id_,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def completion_chunk(
    id_: str, model: str, index: int, text: str, reason: str | None
) -> dict[str, Any]:
    choice = {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": None if reason is None else FINISH_REASONS[reason],
    }
    return {
        "id": id_,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [choice],
    }


def chat_body(
    id_: str, model: str, texts: list[str], reasons: list[str], usage_: dict[str, int]
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": FINISH_REASONS[reason],
        }
        for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
    ]
    return {
        "id": id_,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_chunk(id_: str, model: str, delta: dict[str, str], reason: str | None) -> dict[str, Any]:
    choice = {
        "index": 0,
        "delta": delta,
        "finish_reason": None if reason is None else FINISH_REASONS[reason],
    }
    return {
        "id": id_,
        "object": "chat.completion.chunk",
        "created": now(),
        "model": model,
        "choices": [choice],
    }


def usage_chunk(id_: str, model: str, kind: str, usage_: dict[str, int]) -> dict[str, Any]:
    """The last streamed chunk when the client asked for usage: counts, no choices."""
    return {
        "id": id_,
        "object": kind,
        "created": now(),
        "model": model,
        "choices": [],
        "usage": usage_,
    }
