"""Batched scoring and greedy continuing (llmfoundry/eval/scoring.py): the same answers as
one row at a time, and as the KV-cached decoder."""

import pytest
import torch
import torch.nn.functional as F

from llmfoundry.eval.scoring import (
    Continuation,
    Forward,
    ModelForward,
    continue_prompts,
    greedy_continue,
    score_continuations,
)
from llmfoundry.models.generation import GenerationConfig, generate
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM


def tiny_model() -> MPTForCausalLM:
    torch.manual_seed(0)
    config = MPTConfig(d_model=32, n_heads=2, n_layers=2, max_seq_len=32, vocab_size=50)
    return MPTForCausalLM(config).eval()


def by_hand(model: MPTForCausalLM, request: Continuation) -> tuple[float, bool]:
    ids = list(request.context) + list(request.continuation)
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), dim=-1)
    start = len(request.context)
    rows = logprobs[start - 1 :]
    target = torch.tensor(list(request.continuation))
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def test_batched_scores_equal_one_row_at_a_time():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    requests = [
        Continuation(
            torch.randint(
                50, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g
            ).tolist(),
            torch.randint(50, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist(),
        )
        for _ in range(11)
    ]
    scored = score_continuations(ModelForward(model), requests, max_seq_len=32, batch_size=4)
    for request, got in zip(requests, scored, strict=True):
        logprob, greedy = by_hand(model, request)
        assert abs(got.logprob - logprob) < 1e-4 and got.greedy == greedy
        assert got.tokens == len(request.continuation)


def test_a_window_of_max_seq_len_plus_one_keeps_its_context():
    """lm-eval's rolling windows are max_seq_len + 1 tokens (one of context, max_seq_len
    predicted): the last is never an input, so the model sees max_seq_len and the one context
    token stays."""
    model = tiny_model()
    request = Continuation([7, 8, 9], list(range(10, 42)))
    (got,) = score_continuations(ModelForward(model), [request], max_seq_len=32)
    logprob, greedy = by_hand(model, Continuation([9], request.continuation))
    assert abs(got.logprob - logprob) < 1e-4 and got.greedy == greedy


def recomputing(model: MPTForCausalLM) -> Forward:
    """The model's `Forward` as a mesh's is: not a `ModelForward`, so continuing recomputes
    every sequence per token rather than decoding with the KV cache."""
    return lambda ids, reduce: ModelForward(model)(ids, reduce)


@pytest.mark.parametrize("by", ["cache", "recompute"])
def test_greedy_continue_equals_the_cached_decoder(by):
    model = tiny_model()
    forward = ModelForward(model) if by == "cache" else recomputing(model)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    got = greedy_continue(forward, prompts, max_new_tokens=6, max_seq_len=32)
    for prompt, tokens in zip(prompts, got, strict=True):
        config = GenerationConfig(max_new_tokens=6, temperature=0.0)
        assert tokens == generate(model, torch.tensor([prompt]), None, config).tokens[0]
    stopped = greedy_continue(forward, prompts, 6, 32, stop=lambda new: len(new) == 2)
    assert stopped == [tokens[:2] for tokens in got]


@pytest.mark.parametrize("by", ["cache", "recompute"])
def test_sampled_continuations_equal_the_cached_decoder_for_the_same_seed(by):
    """Each row draws from its own generator seeded with the config's seed, as the decoder's
    rows do, so recomputing gives the KV-cached decoder's tokens (what a mesh generates
    equals one process's); the repetition penalty and eos act alike too."""
    model = tiny_model()
    forward = ModelForward(model) if by == "cache" else recomputing(model)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10]]
    configs = [
        GenerationConfig(max_new_tokens=8, temperature=0.9, top_k=20, seed=5),
        GenerationConfig(max_new_tokens=8, temperature=1.3, top_p=0.8, seed=11),
        GenerationConfig(max_new_tokens=8, temperature=0.0, repetition_penalty=1.5),
    ]
    for config in configs:
        got = continue_prompts(forward, prompts, config, max_seq_len=32, batch_size=2)
        for prompt, tokens in zip(prompts, got, strict=True):
            assert tokens == generate(model, torch.tensor([prompt]), None, config).tokens[0]
    sampled = continue_prompts(forward, prompts, configs[0], max_seq_len=32)
    other_seed = GenerationConfig(max_new_tokens=8, temperature=0.9, top_k=20, seed=6)
    assert continue_prompts(forward, prompts, other_seed, 32) != sampled
    third = greedy_continue(forward, prompts[:1], 8, 32)[0][2]
    eos = GenerationConfig(max_new_tokens=8, temperature=0.0, eos_token_id=third)
    greedy_eos = continue_prompts(forward, prompts, eos, 32)
    assert greedy_eos[0][-1] == third and len(greedy_eos[0]) <= 3
    for prompt, tokens in zip(prompts, greedy_eos, strict=True):
        assert tokens == generate(model, torch.tensor([prompt]), None, eos).tokens[0]
