"""The batching engine in-process: rows join and leave, bounded batches, failures end requests
(not the thread)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from llmfoundry.models.generation import GenerationConfig, generate
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.serving.engine import Engine, Event
from llmfoundry.tokenizers.tokenizer import EOS_TOKEN, train_bpe

VOCAB = 50


@pytest.fixture(scope="module")
def model() -> MPTForCausalLM:
    torch.manual_seed(0)
    config = MPTConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=64, vocab_size=VOCAB)
    return MPTForCausalLM(config).eval()


def decode(ids: list[int]) -> str:
    return " ".join(map(str, ids)) + (" " if ids else "")


async def answer(engine: Engine, prompt: list[int], config: GenerationConfig) -> list[Event]:
    queue: asyncio.Queue[Event] = asyncio.Queue()
    engine.submit(0, prompt, config, queue)
    events = []
    while not events or (events[-1].finish_reason is None and events[-1].error is None):
        events.append(await asyncio.wait_for(queue.get(), 30))
    return events


def alone(model, prompt: list[int], config: GenerationConfig) -> str:
    return generate(model, torch.tensor([prompt]), None, config, decode=decode).texts[0]


def run(engine: Engine, coroutine):
    engine.start()
    try:
        return asyncio.run(coroutine)
    finally:
        engine.stop()
        assert not engine.alive


def test_a_request_that_does_not_fit_waits_for_the_next_batch(model):
    engine = Engine(model, decode, max_rows=4, max_len=40)
    config = GenerationConfig(30, temperature=0)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]

    async def late_second():
        queue: asyncio.Queue[Event] = asyncio.Queue()
        engine.submit(0, prompts[0], config, queue)
        first = [await asyncio.wait_for(queue.get(), 30)]
        while first[-1].completion_tokens < 15:  # the batch's cache holds 18+ positions now
            first.append(await asyncio.wait_for(queue.get(), 30))
        second = asyncio.create_task(answer(engine, prompts[1], config))
        while first[-1].finish_reason is None:
            first.append(await asyncio.wait_for(queue.get(), 30))
        return first, await second

    results = run(engine, late_second())
    texts = ["".join(e.text for e in events) for events in results]
    assert texts == [alone(model, p, config) for p in prompts]
    assert engine.metrics.batches_total == 2  # 18 + 30 positions > max_len: it waited
    assert engine.metrics.max_rows_in_step == 1


def test_rows_join_a_running_batch(model):
    engine = Engine(model, decode, max_rows=4, max_len=128)
    config = GenerationConfig(30, temperature=0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]

    async def all_():
        return await asyncio.gather(*(answer(engine, p, config) for p in prompts))

    results = run(engine, all_())
    assert ["".join(e.text for e in r) for r in results] == [
        alone(model, p, config) for p in prompts
    ]
    assert engine.metrics.batches_total == 1 and engine.metrics.max_rows_in_step == 3
    assert [r[-1].completion_tokens for r in results] == [30, 30, 30]


def test_a_refused_prompt_and_a_failed_step_end_only_their_requests(model, monkeypatch):
    engine = Engine(model, decode, max_rows=4, max_len=128)
    config = GenerationConfig(5, temperature=0)

    async def scenario():
        refused = await answer(engine, [VOCAB + 3], config)  # outside the vocabulary
        real_step = engine._step
        calls = []

        def failing_step():  # the first step that decodes a row fails
            if engine._rows and not calls:  # not the empty step that may follow the refusal
                calls.append(1)
                raise RuntimeError("device lost")
            real_step()

        monkeypatch.setattr(engine, "_step", failing_step)
        failed = await answer(engine, [1, 2], config)
        ok = await answer(engine, [1, 2], config)
        return refused, failed, ok

    refused, failed, ok = run(engine, scenario())
    assert refused[-1].status == 400 and "vocab_size" in refused[-1].error
    assert failed[-1].status == 500 and "device lost" in failed[-1].error
    assert ok[-1].finish_reason == "length"
    assert "".join(e.text for e in ok) == alone(model, [1, 2], config)


def test_a_bad_row_fails_alone_and_a_tiny_temperature_is_greedy(model):
    """Issue 20: a tiny temperature made the whole batch's step raise ("generation failed" for
    every stream); a row whose scores are NaN now fails alone, with a message and a 500."""
    engine = Engine(model, decode, max_rows=4, max_len=128)
    normal = GenerationConfig(20, temperature=1.0, seed=5)
    cold = GenerationConfig(20, temperature=1.18e-38)
    greedy = GenerationConfig(20, temperature=0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]

    def poison_third_row(module, args, logits):
        if logits.shape[0] == 3:
            logits = logits.clone()
            logits[2] = float("nan")
        return logits

    async def together():
        configs = [normal, cold, greedy]
        return await asyncio.gather(
            *(answer(engine, p, c) for p, c in zip(prompts, configs, strict=True))
        )

    handle = model.register_forward_hook(poison_third_row)
    try:
        ok, cold_events, failed = run(engine, together())
    finally:
        handle.remove()
    assert "".join(e.text for e in ok) == alone(model, prompts[0], normal)
    assert "".join(e.text for e in cold_events) == alone(model, prompts[1], greedy)
    assert ok[-1].finish_reason == cold_events[-1].finish_reason == "length"
    assert failed[-1].status == 500 and "not finite" in failed[-1].error
    assert engine.metrics.max_rows_in_step == 3 and engine.metrics.errors_total == 1


def byte_fallback_tokenizer() -> Tokenizer:
    """Llama's kind: a token per byte (<0xE2>), decoded one U+FFFD per byte until they form a
    character (a partial character of 3 bytes is 3 marks, not 1)."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁gu": 256, "a": 257, "</s>": 258}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.add_special_tokens(["</s>"])
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return tokenizer


def scripted(vocab: int, script: list[int], eos: int) -> MPTForCausalLM:
    """A model that continues each token of `script` with the next one (then EOS): its logits
    are replaced by a bigram table, so a test decides which tokens it generates."""
    torch.manual_seed(0)
    config = MPTConfig(d_model=16, n_heads=2, n_layers=1, max_seq_len=64, vocab_size=vocab)
    model = MPTForCausalLM(config).eval()
    table = torch.full((vocab,), eos)
    table[torch.tensor(script[:-1])] = torch.tensor(script[1:])

    def bigram(module, args, logits):
        return torch.nn.functional.one_hot(table[args[0]], vocab).float() * 10

    model.register_forward_hook(bigram)
    return model


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_streamed_text_never_splits_a_character(kind):
    """Issue 24: a token ending inside a multi-byte character was streamed as U+FFFD (and with
    byte fallback the completed character was then lost). Each event holds whole characters,
    and a stop string that is such a character cuts the text before it."""
    answer_text = "€ gu😀é"
    if kind == "byte_level":
        tokenizer = train_bpe(["hello world"], vocab_size=300)
        prompt, eos = tokenizer.token_to_id("a"), tokenizer.token_to_id(EOS_TOKEN)
        generated = tokenizer.encode(answer_text).ids
    else:
        tokenizer, prompt, eos = byte_fallback_tokenizer(), 257, 258
        generated = [0xE2, 0x82, 0xAC, 256, 0xF0, 0x9F, 0x98, 0x80, 0xC3, 0xA9]
    assert tokenizer.decode(generated) == answer_text and len(generated) > 7  # split characters
    model = scripted(tokenizer.get_vocab_size(), [prompt, *generated], eos)
    engine = Engine(model, tokenizer.decode, max_rows=2, max_len=64)
    whole = GenerationConfig(30, temperature=0, eos_token_id=eos)
    stopped = GenerationConfig(30, temperature=0, eos_token_id=eos, stop=("😀",))

    async def both():
        return await asyncio.gather(
            answer(engine, [prompt], whole), answer(engine, [prompt], stopped)
        )

    for events, text, reason in zip(
        run(engine, both()), [answer_text, "€ gu"], ["eos", "stop"], strict=True
    ):
        assert all("\ufffd" not in e.text for e in events), [e.text for e in events]
        assert "".join(e.text for e in events) == text and events[-1].finish_reason == reason


def test_a_llama_model_is_served_as_mpt_is():
    from llmfoundry.models.llama import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig.preset("llama-tiny", d_model=32, n_layers=2, vocab_size=VOCAB)
    llama = LlamaForCausalLM(config).eval()
    engine = Engine(llama, decode, max_rows=4, max_len=64)
    config = GenerationConfig(12, temperature=0)
    prompts = [[1, 2, 3], [4, 5]]

    async def both():
        return await asyncio.gather(*(answer(engine, p, config) for p in prompts))

    results = run(engine, both())
    assert ["".join(e.text for e in r) for r in results] == [
        alone(llama, p, config) for p in prompts
    ]
