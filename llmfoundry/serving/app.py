"""The HTTP server: an OpenAI-compatible API over the batching `Engine`.

    POST /v1/completions        prompt (or a list of prompts) -> text; `stream: true` for SSE
    POST /v1/chat/completions   messages -> the assistant's answer (needs a chat template)
    GET  /v1/models             the one model served
    GET  /health                200 while the decode thread runs (no auth: probes call it)
    GET  /metrics               the engine's counters (JSON)

Hardening, in the order a request meets it: with an API key, every route but /health needs
`Authorization: Bearer <key>` (compared in constant time, never logged; websockets, /docs and
/openapi.json too), checked before the body is read (`auth`: an empty key, or none on a
non-loopback host, is refused at start); a body larger than `Limits.max_body_bytes` is a 413
before it is parsed; the body must match the pydantic model (400 naming the field); a prompt
(or chat messages) of more than `Limits.max_prompt_chars` characters is a 400 before anything
tokenizes or renders it; prompts longer than `max_prompt_tokens`, a `max_tokens` above the limit
or a prompt the model's context cannot hold are 400s; a chat template that fails on the messages
(or runs out of steps) is a 400; more than `max_concurrent` prompts in flight is a 429.

The event loop never waits on a tokenizer or a template: both run in a few worker threads
(`PROMPT_WORKERS`), bounded before they start (characters) and while they run (the template's
step budget), and a request whose prompt is not ready within `PREPARE_TIMEOUT_S` is a 503, so
/health and every stream keep answering while a bad request is refused. A streaming client that goes away cancels its rows
(they leave the batch at the next step) and frees its slots; so does one waiting for a whole
answer. Draining on SIGTERM is uvicorn's graceful shutdown: it stops accepting, finishes the
requests in flight, then the lifespan stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmfoundry.models.generation import GenerationConfig
from llmfoundry.serving import protocol
from llmfoundry.serving.auth import BearerAuth
from llmfoundry.serving.engine import Completion, Engine, Event
from llmfoundry.serving.tokenizer import ChatTemplateError, ServedTokenizer
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["Limits", "create_app"]

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
# Characters a token may stand for, on average over a prompt, before the prompt is refused
# untokenized: generous (text averages ~4), so only what could never fit is refused this way.
CHARS_PER_TOKEN = 32
PROMPT_WORKERS = 4  # threads that tokenize prompts and render chat templates
PREPARE_TIMEOUT_S = 10.0  # a prompt not tokenized (and rendered) by then is a 503


@dataclass(frozen=True)
class Limits:
    """What one request (and all of them together) may ask of the server."""

    max_prompt_tokens: int = 1024
    max_tokens: int = 512
    max_body_bytes: int = 1 << 20
    max_concurrent: int = 32

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise UserError(f"limit {name} must be a positive integer, got {value!r}")

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt (or messages, in all) tokenized at all: longer ones could not
        hold `max_prompt_tokens` tokens, and tokenizing them would cost seconds."""
        return CHARS_PER_TOKEN * self.max_prompt_tokens


class BodyLimit:
    """ASGI middleware: a request body above `max_bytes` is answered 413 before any route
    reads it (declared Content-Length or counted while reading a chunked body)."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then the client's disconnect, when it comes

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"request body larger than the limit of {self.max_bytes} bytes"
        response = JSONResponse(protocol.error_body(message), status_code=413)
        await response(scope, receive, send)


class Lease:
    """Slots held by one request among `max_concurrent`; released once, however it ends."""

    def __init__(self, server: _Server, n: int) -> None:
        self.server, self.n, self.held = server, n, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.server.in_flight -= self.n


class _Server:
    """State behind the routes: the engine, the tokenizer and the slots in use."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: ServedTokenizer,
        model_name: str,
        limits: Limits,
        context: int,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.limits, self.context = limits, context
        self.vocab_size = engine.model.config.vocab_size
        self.in_flight = 0
        self.workers = ThreadPoolExecutor(PROMPT_WORKERS, thread_name_prefix="llmfoundry-prompt")

    def check(self, body: protocol.Sampling) -> None:
        if body.model is not None and body.model != self.model_name:
            raise HTTPException(
                404, f"model {body.model!r} is not served here; use {self.model_name!r}"
            )
        if body.max_tokens > self.limits.max_tokens:
            raise HTTPException(
                400,
                f"max_tokens {body.max_tokens} is above this server's limit of {self.limits.max_tokens}",
            )

    def check_chars(self, what: str, chars: int) -> None:
        """Refuse text too long to tokenize, before anything reads it."""
        if chars > self.limits.max_prompt_chars:
            raise HTTPException(
                400,
                f"{what} {chars} characters, more than this server's {self.limits.max_prompt_tokens} "
                f"tokens could hold (at most {self.limits.max_prompt_chars} characters); shorten it",
            )

    async def off_loop(self, work: Callable[[], Any]) -> Any:
        """`work()` in a worker thread: the event loop answers other requests meanwhile. A 503
        when it has not finished (or started: the workers are busy) in PREPARE_TIMEOUT_S."""
        future = asyncio.get_running_loop().run_in_executor(self.workers, work)
        try:
            return await asyncio.wait_for(future, PREPARE_TIMEOUT_S)
        except TimeoutError:
            raise HTTPException(
                503,
                f"preparing the prompt took more than {PREPARE_TIMEOUT_S:g} s (the server is "
                "busy); retry later",
                headers={"Retry-After": "1"},
            ) from None

    async def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat prompt of `messages`, rendered and tokenized off the event loop (400 when it
        cannot be)."""
        chars = sum(len(value) for m in messages for value in m.values())
        self.check_chars("the messages have", chars)
        try:
            text = await self.off_loop(functools.partial(self.tokenizer.render_chat, messages))
        except ChatTemplateError as err:
            raise HTTPException(400, str(err)) from None
        self.check_chars("the chat prompt has", len(text))
        return await self.off_loop(functools.partial(self.tokenizer.encode_chat, text))

    async def encode(self, prompts: Sequence[str | list[int]], max_tokens: int) -> list[list[int]]:
        """Each prompt's ids (texts tokenized off the event loop, ids as given), checked
        against the limits."""
        if len(prompts) > self.limits.max_concurrent:  # before any work on them
            raise HTTPException(
                400,
                f"{len(prompts)} prompts in one request; this server takes at most "
                f"{self.limits.max_concurrent}",
            )
        texts = [p for p in prompts if isinstance(p, str)]
        for text in texts:
            self.check_chars("a prompt has", len(text))
        encoded = iter(
            await self.off_loop(functools.partial(self.tokenizer.encode_batch, texts))
            if texts
            else []
        )
        ids = [next(encoded) if isinstance(p, str) else p for p in prompts]
        if not all(ids):
            raise HTTPException(400, "a prompt encodes to no tokens; give it some text")
        return [self.check_ids(i, max_tokens) for i in ids]

    def check_ids(self, ids: list[int], max_tokens: int) -> list[int]:
        """A prompt's token ids (encoded here, or given as ids), checked against the limits."""
        if len(ids) > self.limits.max_prompt_tokens:
            raise HTTPException(
                400,
                f"prompt is {len(ids)} tokens, above this server's limit of "
                f"{self.limits.max_prompt_tokens}; shorten it",
            )
        if len(ids) + max_tokens > self.context:
            raise HTTPException(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) is more than the model's "
                f"context of {self.context} tokens; shorten one",
            )
        if max(ids) >= self.vocab_size:
            raise HTTPException(
                400, f"the prompt has token id {max(ids)}, outside the model's vocabulary"
            )
        return ids

    def lease(self, n: int) -> Lease:
        if n > self.limits.max_concurrent:  # prompts x n choices: never servable, so not a 429
            raise HTTPException(
                400,
                f"{n} rows (prompts x n) in one request; this server takes at most "
                f"{self.limits.max_concurrent}",
            )
        if self.in_flight + n > self.limits.max_concurrent:
            raise HTTPException(
                429,
                f"the server is busy ({self.in_flight} of {self.limits.max_concurrent} requests "
                "in flight); retry later",
                headers={"Retry-After": "1"},
            )
        self.in_flight += n
        return Lease(self, n)

    def start(
        self, prompts: list[list[int]], body: protocol.Sampling
    ) -> tuple[Lease, asyncio.Queue, list[Completion]]:
        """Submit `body.n` choices of each prompt (choice i * n + j: prompt i's j-th, seeded
        seed + j), holding their slots (429 when busy)."""
        logprobs = getattr(body, "logprobs", None)
        config = GenerationConfig(
            max_new_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=None if body.top_p == 1 else body.top_p,
            stop=body.stops,
            eos_token_id=self.tokenizer.eos_id,
            seed=body.seed,
            logprobs=logprobs,
            prompt_logprobs=logprobs is not None and getattr(body, "echo", False),
        )
        lease = self.lease(len(prompts) * body.n)  # first: it bounds n
        configs = [
            config if body.seed is None else dataclasses.replace(config, seed=body.seed + j)
            for j in range(body.n)
        ]
        queue: asyncio.Queue[Event] = asyncio.Queue()
        completions = [
            self.engine.submit(i * body.n + j, ids, configs[j], queue)
            for i, ids in enumerate(prompts)
            for j in range(body.n)
        ]
        return lease, queue, completions


async def _events(
    request: Request, queue: asyncio.Queue, completions: list[Completion]
) -> AsyncIterator[Event]:
    """The completions' events until each has ended; cancels them all if the client leaves or
    the caller stops reading."""
    remaining = len(completions)
    checked = time.monotonic()
    try:
        while remaining:
            try:
                event = await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                event = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:
                checked = time.monotonic()
                if await request.is_disconnected():
                    log.info("client disconnected; cancelling %d completion(s)", remaining)
                    return
            if event is None:
                continue
            if event.finish_reason is not None or event.error is not None:
                remaining -= 1
            yield event
    finally:
        for completion in completions:
            completion.cancel()


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


def create_app(
    engine: Engine,
    tokenizer: ServedTokenizer,
    model_name: str,
    limits: Limits,
    context: int,
    api_key: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`; it starts the engine and stops it at shutdown.

    `context` is the most positions (prompt + max_tokens) one request may use.
    """
    server = _Server(engine, tokenizer, model_name, limits, context)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        log.info("serving %s (auth %s)", model_name, "on" if api_key else "off")
        try:
            yield
        finally:
            engine.stop()
            server.workers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="llmfoundry", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)  # outermost: before any body is read

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
        body = protocol.error_body(
            str(err.detail), kind.get(err.status_code, "invalid_request_error")
        )
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def bug(request: Request, err: Exception) -> JSONResponse:  # logged with its traceback
        log.error("%s %s failed", request.method, request.url.path, exc_info=err)
        body = protocol.error_body("internal error (logged by the server)", "server_error")
        return JSONResponse(body, status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
            if e.get("type") == "json_invalid":
                problems.append(
                    f"the body is not valid JSON ({e.get('ctx', {}).get('error', e['msg'])})"
                )
            else:
                problems.append(f"{where or 'body'}: {e['msg']}")
        return JSONResponse(protocol.error_body("; ".join(problems)), status_code=400)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> dict[str, Any]:
        return {**dataclasses.asdict(engine.metrics), "in_flight": server.in_flight}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": protocol.now(),
            "owned_by": "llmfoundry",
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request):
        server.check(body)
        prompts = await server.encode(body.prompts, body.max_tokens)
        lease, queue, running = server.start(prompts, body)
        id_ = protocol.new_id("cmpl")
        events = _events(request, queue, running)
        if body.stream:

            def chunk(event: Event) -> dict[str, Any]:
                text, reason = event.text, event.finish_reason
                return protocol.completion_chunk(id_, model_name, event.index, text, reason)

            usage = _usage_chunk(body, id_, model_name, "text_completion", sum(map(len, prompts)))
            return _streaming(events, lease, [], chunk, usage)
        try:
            ends = await _collect(events, len(running))
        finally:
            lease.release()
        choices = [
            _completion_choice(tokenizer, body, prompts[end.index // body.n], end) for end in ends
        ]
        usage = protocol.usage(sum(map(len, prompts)), sum(e.completion_tokens for e in ends))
        return protocol.completion_body(id_, model_name, choices, usage)

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest, request: Request):
        server.check(body)
        ids = await server.render([m.model_dump(exclude_none=True) for m in body.messages])
        [prompt] = await server.encode([ids], body.max_tokens)
        lease, queue, running = server.start([prompt], body)
        id_ = protocol.new_id("chatcmpl")
        events = _events(request, queue, running)
        if body.stream:

            def chunk(event: Event) -> dict[str, Any]:
                delta = {"content": event.text} if event.text else {}
                return protocol.chat_chunk(id_, model_name, delta, event.finish_reason)

            head = [protocol.chat_chunk(id_, model_name, {"role": "assistant"}, None)]
            usage = _usage_chunk(body, id_, model_name, "chat.completion.chunk", len(prompt))
            return _streaming(events, lease, head, chunk, usage)
        try:
            ends = await _collect(events, len(running))
        finally:
            lease.release()
        usage = protocol.usage(len(prompt), sum(e.completion_tokens for e in ends))
        texts, reasons = [e.text for e in ends], [e.finish_reason or "cancelled" for e in ends]
        return protocol.chat_body(id_, model_name, texts, reasons, usage)

    return app


def _usage_chunk(
    body: protocol.Sampling, id_: str, model: str, kind: str, prompt_tokens: int
) -> Callable[[int], dict[str, Any]] | None:
    """The last chunk's maker when the client asked for usage (`stream_options`), else None."""
    if not body.include_usage:
        return None
    return lambda completion_tokens: protocol.usage_chunk(
        id_, model, kind, protocol.usage(prompt_tokens, completion_tokens)
    )


def _streaming(
    events: AsyncIterator[Event],
    lease: Lease,
    head: list[dict[str, Any]],
    chunk: Callable[[Event], dict[str, Any]],
    usage: Callable[[int], dict[str, Any]] | None,
) -> StreamingResponse:
    """Server-sent events: `head`, a chunk per event with text or an end, the usage chunk when
    asked for, then [DONE]. An engine error ends the stream with an error event."""

    async def body() -> AsyncIterator[str]:
        tokens: dict[int, int] = {}
        try:
            for data in head:
                yield _sse(data)
            async for event in events:
                if event.error is not None:
                    yield _sse(protocol.error_body(event.error, "server_error"))
                    return
                tokens[event.index] = event.completion_tokens
                if event.text or event.finish_reason:
                    yield _sse(chunk(event))
            if usage is not None:
                yield _sse(usage(sum(tokens.values())))
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()  # type: ignore[attr-defined]
            lease.release()

    return StreamingResponse(
        body(), media_type="text/event-stream", background=BackgroundTask(lease.release)
    )


async def _collect(events: AsyncIterator[Event], n: int) -> list[Event]:
    """Whole answers of `n` completions, in index order: each one's last event with its whole
    text; an engine error becomes the HTTP error it names."""
    texts = [""] * n
    ends = [Event(i, finish_reason="cancelled") for i in range(n)]
    try:
        async for event in events:
            if event.error is not None:
                raise HTTPException(event.status, event.error)
            texts[event.index] += event.text
            ends[event.index] = event
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    return [dataclasses.replace(end, text=text) for end, text in zip(ends, texts, strict=True)]


def _completion_choice(
    tokenizer: ServedTokenizer, body: protocol.CompletionRequest, prompt: list[int], end: Event
) -> dict[str, Any]:
    """A completion's choice: its text (after the prompt's with `echo`) and, when asked, its
    tokens' log-probabilities (the prompt's too with `echo`)."""
    reason = end.finish_reason or "cancelled"
    echoed = tokenizer.decode(prompt) if body.echo else ""
    if body.logprobs is None:
        return protocol.completion_choice(end.index, echoed + end.text, reason)
    ids, entries = list(end.tokens), list(end.logprobs)
    if body.echo:
        ids, entries = prompt + ids, [None, *end.prompt_logprobs, *entries]
    offset = 0 if body.echo else len(tokenizer.decode(prompt))
    logprobs = protocol.completion_logprobs(ids, entries, tokenizer.decode, offset)
    return protocol.completion_choice(end.index, echoed + end.text, reason, logprobs)
