"""Dynamic batching: one background thread decodes every request in flight, together.

A request (`Engine.submit`) joins the running `Decoder` at the next step (`Decoder.add`: its
prompt is run alone, then its KV cache joins the batch's), decodes with the others one token per
step, and leaves the batch when it finishes or its client goes away (`Completion.cancel`). So a
server answering 16 clients runs one forward of 16 rows per token, not 16 forwards of one.

The thread owns the model and the decoder; the event loop of the HTTP server only puts requests
in a queue and reads events back (`Completion.events`, an asyncio queue filled with
`loop.call_soon_threadsafe`), so no lock is held while the model runs.

The running batch's cache grows by one position per step and a newcomer is left-padded to it,
so a batch that is joined forever would grow forever. A request joins only while the batch's
cache plus its own budget stays within `max_len`; otherwise it waits until the batch drains and
starts the next one. Memory is bounded by `max_rows * max_len` positions.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llmfoundry.models.family import CausalLM
from llmfoundry.models.generation import Decoder, GenerationConfig, TokenLogprob
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)

__all__ = ["Completion", "Engine", "Event", "stream_safe_length"]


@dataclass(frozen=True)
class Event:
    """What a completion reports: new `text` (may be ""), and at its end `finish_reason`
    ("eos", "stop", "length", "cancelled") or `error` (a message, with the HTTP `status` it
    deserves: 400 a prompt the model refused, 500 a failed step, 503 shutting down), with the
    number of tokens generated so far. A row that asked for log-probabilities gets them, and
    its tokens, with its end (`GenerationConfig.logprobs`, `prompt_logprobs`)."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    completion_tokens: int = 0
    status: int = 200
    tokens: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(eq=False)
class Completion:
    """One prompt being served; its events go to `events` on the event loop `loop`."""

    index: int
    prompt: list[int]
    config: GenerationConfig
    events: asyncio.Queue[Event]
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False
    sent: int = 0  # characters of text already reported

    def cancel(self) -> None:
        """Leave the batch at the next step (the client went away); thread-safe."""
        self.cancelled = True

    def report(self, event: Event) -> None:
        """Hand `event` to the event loop (from the decode thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


def stream_safe_length(text: str, stops: Sequence[str]) -> int:
    """How much of `text` can be sent before the row ends: not a tail that may still become a
    stop string (the decoder would cut it). The decoder's text holds whole characters only
    (`TextStream`), so no cut here splits one."""
    for i in range(max(0, len(text) - max(map(len, stops), default=0)), len(text)):
        if any(s.startswith(text[i:]) for s in stops):
            return i
    return len(text)


@dataclass
class Metrics:
    """Counters since start; `max_rows_in_step` > 1 shows that requests were decoded together."""

    completions_total: int = 0
    steps_total: int = 0
    tokens_total: int = 0
    batched_steps_total: int = 0
    max_rows_in_step: int = 0
    cancelled_total: int = 0
    errors_total: int = 0
    active: int = 0
    queued: int = 0
    batches_total: int = 0


class Engine:
    """Decodes submitted prompts in one background thread with continuous batching.

    `decode` turns token ids into text (stop strings and the streamed text need it). At most
    `max_rows` prompts decode at once (the rest wait in order); `max_len` bounds the positions
    of a batch's KV cache (see the module docstring).
    """

    def __init__(
        self,
        model: CausalLM,
        decode: Callable[[list[int]], str],
        max_rows: int,
        max_len: int,
    ) -> None:
        if max_rows < 1:
            raise UserError(f"max_rows must be at least 1, got {max_rows}")
        self.model, self.decode = model, decode
        self.max_rows, self.max_len = max_rows, max_len
        self.metrics = Metrics()
        self._pending: deque[Completion] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._decoder: Decoder | None = None
        self._rows: dict[int, Completion] = {}  # decoder row -> completion still decoding

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="llmfoundry-decode", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; completions still in flight are ended with
        an error (the server drains requests before it stops the engine)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the decode thread runs (what the liveness probe checks)."""
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self, index: int, prompt: list[int], config: GenerationConfig, events: asyncio.Queue
    ) -> Completion:
        """Queue `prompt`; its events arrive on `events` (from the running event loop)."""
        completion = Completion(index, list(prompt), config, events, asyncio.get_running_loop())
        with self._lock:
            self._pending.append(completion)
            self.metrics.queued = len(self._pending)
        self._wake.set()
        return completion

    def _run(self) -> None:
        while not self._stopping:
            if self._decoder is None and not self._pending:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                self._admit()
                self._step()
            except Exception as err:  # never let one bad batch kill the server
                log.exception("decode step failed; ending the batch's requests")
                self._fail_batch(f"generation failed: {type(err).__name__}: {err}", 500)
        self._fail_batch("the server is shutting down", 503)
        with self._lock:
            pending, self._pending = list(self._pending), deque()
        for completion in pending:
            completion.report(
                Event(completion.index, error="the server is shutting down", status=503)
            )

    def _admit(self) -> None:
        """Move waiting completions into the batch while they fit (in arrival order)."""
        while True:
            with self._lock:
                if not self._pending:
                    break
                completion = self._pending[0]
                if not completion.cancelled and not self._fits(completion):
                    break
                self._pending.popleft()
                self.metrics.queued = len(self._pending)
            if completion.cancelled:
                completion.report(Event(completion.index, finish_reason="cancelled"))
                self.metrics.cancelled_total += 1
                continue
            try:
                if self._decoder is None:
                    ids = torch.tensor([completion.prompt])
                    decoder = Decoder(self.model, ids, None, completion.config, self.decode)
                    decoder.step()
                    self._decoder, row = decoder, 0
                    self.metrics.batches_total += 1
                else:
                    row = self._decoder.add(completion.prompt, completion.config)
            except (ValueError, RuntimeError) as err:  # e.g. a prompt the model cannot take
                completion.report(Event(completion.index, error=str(err), status=400))
                self.metrics.errors_total += 1
                continue
            self.metrics.completions_total += 1
            self._rows[row] = completion
            self._report_progress()
            if self._decoder.done:  # every row ended at its first token
                self._decoder = None

    def _fits(self, completion: Completion) -> bool:
        if self._decoder is None:
            return True
        if len(self._rows) >= self.max_rows:
            return False
        cache = self._decoder.cache
        length = max(cache.length if cache is not None else 0, len(completion.prompt))
        return length + completion.config.max_new_tokens <= self.max_len

    def _step(self) -> None:
        decoder = self._decoder
        if decoder is None:
            return
        for row, completion in self._rows.items():
            if completion.cancelled:
                decoder.cancel(row)
        self._report_progress()
        if decoder.done:
            self._decoder = None
            return
        rows = len(self._rows)
        decoder.step()
        self.metrics.steps_total += 1
        self.metrics.tokens_total += rows
        self.metrics.max_rows_in_step = max(self.metrics.max_rows_in_step, rows)
        if rows > 1:
            self.metrics.batched_steps_total += 1
        self._report_progress()
        if decoder.done:
            self._decoder = None

    def _report_progress(self) -> None:
        """Send each row's new text; end the rows that finished."""
        decoder = self._decoder
        if decoder is None:
            return
        for row, completion in list(self._rows.items()):
            text, reason = decoder.texts[row], decoder.finish_reasons[row]
            end = len(text) if reason else stream_safe_length(text, completion.config.stop)
            delta = text[completion.sent : end]
            completion.sent = max(completion.sent, end)
            tokens = len(decoder.tokens[row])
            if reason == "error":  # this row alone failed (non-finite scores); the rest go on
                del self._rows[row]
                self.metrics.errors_total += 1
                error = decoder.errors[row]
                completion.report(Event(completion.index, delta, None, error, tokens, 500))
            elif reason is not None:
                del self._rows[row]
                if reason == "cancelled":
                    self.metrics.cancelled_total += 1
                scored = (tuple(decoder.tokens[row]), tuple(decoder.logprobs[row]))
                scored += (tuple(decoder.prompt_logprobs[row]),)
                completion.report(
                    Event(completion.index, delta, reason, None, tokens, 200, *scored)
                )
            elif delta:
                completion.report(Event(completion.index, delta, completion_tokens=tokens))
        self.metrics.active = len(self._rows)

    def _fail_batch(self, message: str, status: int) -> None:
        for completion in self._rows.values():
            completion.report(Event(completion.index, error=message, status=status))
            self.metrics.errors_total += 1
        self._rows.clear()
        self._decoder = None
        self.metrics.active = 0
