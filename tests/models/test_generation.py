"""Generation: the KV cache equals recomputation, left padding equals no padding, sampling
settings do what they say (checked against transformers' logits processors), stop strings,
EOS, seeds, and greedy decoding equal to transformers' `generate` on the exported model."""

import pytest
import torch
import transformers

from llmfoundry.models import MPTConfig, MPTForCausalLM
from llmfoundry.models.generation import (
    Decoder,
    GenerationConfig,
    TextStream,
    apply_repetition_penalty,
    generate,
    left_pad,
    new_cache,
    sampling_probs,
)
from llmfoundry.models.mpt.hf import export_to_hf
from llmfoundry.tokenizers.tokenizer import train_bpe

VOCAB = 50
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10], [3] * 11, [42], [5, 4, 3]]
GREEDY = GenerationConfig(max_new_tokens=12, temperature=0)

VARIANTS = {
    "alibi": {},
    "learned_pos": dict(alibi=False, no_bias=False),
    "gqa": dict(kv_n_heads=2, qk_ln=True, clip_qkv=0.5),
    "window": dict(sliding_window=5),
    "infini": dict(infini=dict(segment_len=4)),
    "infini_delta_mqa": dict(infini=dict(segment_len=5, update="delta"), kv_n_heads=1),
    # llm-foundry's Llama-like options: RoPE at cached offsets and under left padding.
    "rope_rmsnorm_glu_untied": dict(
        alibi=False, rope=True, norm_type="rmsnorm", ffn_type="glu", tie_word_embeddings=False
    ),
}


def tiny(**overrides) -> MPTForCausalLM:
    fields = dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=VOCAB)
    fields.update(overrides)
    torch.manual_seed(0)
    return MPTForCausalLM(MPTConfig(**fields)).eval()


@pytest.mark.parametrize("attn_impl", ["torch", "sdpa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_logits_equal_a_full_forward(variant, attn_impl):
    model = tiny(attn_impl=attn_impl, **VARIANTS[variant])
    ids = torch.randint(0, VOCAB, (2, 23))
    full = model(ids)
    cache = new_cache(model, 23)
    pieces = [model(ids[:, a:b], cache=cache) for a, b in [(0, 6), (6, 7), (7, 15), (15, 23)]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_gives_the_tokens_of_recomputation_and_padding_changes_nothing(variant):
    model = tiny(attn_impl="torch", **VARIANTS[variant])
    ids, mask = left_pad(PROMPTS)
    cached = generate(model, ids, mask, GREEDY)
    recomputed = generate(model, ids, mask, GREEDY, use_cache=False)
    assert cached.tokens == recomputed.tokens
    assert cached.finish_reasons == ["length"] * len(PROMPTS)
    for row, prompt in enumerate(PROMPTS):  # each prompt alone, without padding
        assert generate(model, torch.tensor([prompt]), None, GREEDY).tokens[0] == cached.tokens[row]
    # The greedy tokens really are the argmax of a full forward over prompt + tokens so far.
    full = torch.tensor([PROMPTS[0] + cached.tokens[0]])
    assert model(full[:, :-1])[0, len(PROMPTS[0]) - 1 :].argmax(-1).tolist() == cached.tokens[0]
    # Rows that finish early leave the batch; the others go on exactly as before.
    budgets = [12, 5, 12, 9, 3]
    configs = [GenerationConfig(max_new_tokens=n, temperature=0) for n in budgets]
    for use_cache in (True, False):
        short = generate(model, ids, mask, configs, use_cache=use_cache)
        assert short.tokens == [t[:n] for t, n in zip(cached.tokens, budgets, strict=True)]


def test_infini_cache_carries_the_memory_across_segments():
    """With the gate open, a token only the memory holds changes the last logits, and decoding
    token by token with the cache (folding each segment into the memory) gives the same."""
    model = tiny(attn_impl="torch", infini=dict(segment_len=4, gate_init=4.0))
    base = torch.arange(1, 14)[None]
    other = base.clone()
    other[0, 0] = 49  # differs only in the first segment
    last = model(other)[0, -1]
    assert not torch.allclose(model(base)[0, -1], last, atol=1e-3)
    cache = new_cache(model, 13)
    for t in range(13):
        step = model(other[:, t : t + 1], cache=cache)[0, -1]
    torch.testing.assert_close(step, last, rtol=0, atol=2e-5)


def test_repetition_penalty_top_k_top_p_match_transformers():
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB) * 3
    seen = torch.zeros(3, VOCAB, dtype=torch.bool)
    history = torch.randint(0, VOCAB, (3, 7))
    seen[torch.arange(3)[:, None], history] = True
    theirs = transformers.RepetitionPenaltyLogitsProcessor(1.3)(history, logits.clone())
    ours = apply_repetition_penalty(logits, seen, torch.full((3,), 1.3))
    torch.testing.assert_close(ours, theirs)
    for cfg in [
        GenerationConfig(temperature=0.7, top_k=5),
        GenerationConfig(temperature=1.3, top_p=0.6),
        GenerationConfig(temperature=0.9, top_k=7, top_p=0.8),
    ]:
        processors = transformers.LogitsProcessorList(
            [transformers.TemperatureLogitsWarper(cfg.temperature)]
        )
        if cfg.top_k:
            processors.append(transformers.TopKLogitsWarper(cfg.top_k))
        if cfg.top_p:
            processors.append(transformers.TopPLogitsWarper(cfg.top_p))
        expected = processors(history, logits.clone()).softmax(-1)
        torch.testing.assert_close(sampling_probs(logits, [cfg] * 3), expected)
    # Rows with different settings in one batch get their own.
    mixed = [GenerationConfig(top_k=1), GenerationConfig(top_p=1.0), GenerationConfig(top_k=3)]
    probs = sampling_probs(logits, mixed)
    assert (probs > 0).sum(-1).tolist() == [1, VOCAB, 3]


def test_sampling_seeds_are_per_row_and_reproducible():
    model = tiny()
    ids, mask = left_pad(PROMPTS[:2])
    seeded = GenerationConfig(max_new_tokens=10, temperature=1.5, seed=3)
    a = generate(model, ids, mask, seeded).tokens
    assert generate(model, ids, mask, seeded).tokens == a
    assert (
        generate(
            model, ids, mask, GenerationConfig(max_new_tokens=10, temperature=1.5, seed=4)
        ).tokens
        != a
    )
    # A row's samples do not depend on its batch neighbours.
    other = GenerationConfig(max_new_tokens=10, temperature=0.5, seed=9)
    assert generate(model, ids, mask, [seeded, other]).tokens[0] == a[0]
    # top_k=1 is greedy whatever the temperature.
    top1 = GenerationConfig(max_new_tokens=10, temperature=2.0, top_k=1)
    greedy = GenerationConfig(max_new_tokens=10, temperature=0)
    assert generate(model, ids, mask, top1).tokens == generate(model, ids, mask, greedy).tokens


@pytest.mark.parametrize("temperature", [1.18e-38, 1e-40])
def test_a_tiny_temperature_is_greedy_and_fails_no_other_row(temperature):
    """Dividing by such a temperature overflowed to inf and torch.multinomial raised for the
    whole batch; it is greedy now, in a batch from the start and when it joins one."""
    model = tiny()
    normal = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=3)
    cold = GenerationConfig(max_new_tokens=12, temperature=temperature)
    alone = generate(model, torch.tensor([PROMPTS[0]]), None, normal).tokens[0]
    greedy = generate(model, torch.tensor([PROMPTS[1]]), None, GREEDY).tokens[0]
    ids, mask = left_pad(PROMPTS[:2])
    out = generate(model, ids, mask, [normal, cold])
    assert out.tokens == [alone, greedy] and out.finish_reasons == ["length", "length"]
    decoder = Decoder(model, torch.tensor([PROMPTS[0]]), None, normal)
    decoder.step()
    decoder.add(PROMPTS[1], cold)
    while not decoder.done:
        decoder.step()
    assert decoder.output().tokens == [alone, greedy]


@pytest.mark.parametrize(("poison", "temperature"), [(float("nan"), 0.0), (float("inf"), 1.0)])
def test_a_row_with_non_finite_scores_fails_alone(poison, temperature):
    """A row whose logits turn NaN (greedy) or +inf (sampled: softmax makes NaN) ends with
    "error" and a message; the other row decodes exactly as it would alone."""
    model = tiny()
    config = GenerationConfig(max_new_tokens=12, temperature=temperature, seed=1)
    alone = generate(model, torch.tensor([PROMPTS[0]]), None, config).tokens[0]

    def poison_second_row(module, args, logits):
        if logits.shape[0] == 2:
            logits = logits.clone()
            logits[1, :, :5] = poison
        return logits

    handle = model.register_forward_hook(poison_second_row)
    try:
        out = generate(model, *left_pad(PROMPTS[:2]), config)
    finally:
        handle.remove()
    assert out.tokens[0] == alone and out.finish_reasons == ["length", "error"]
    assert out.tokens[1] == [] and out.errors[0] is None
    assert "not finite" in out.errors[1] and "probability tensor" not in out.errors[1]


def test_sampling_probs_of_a_tiny_temperature_are_one_hot():
    logits = torch.tensor([[1.0, 3.0, -2.0], [5.0, 5.0, 0.0]])
    probs = sampling_probs(logits, [GenerationConfig(temperature=1e-30)] * 2)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]]))


def test_prompt_and_token_logprobs_equal_a_forward_of_the_row_alone():
    model = tiny()
    config = GenerationConfig(max_new_tokens=4, temperature=0, logprobs=2, prompt_logprobs=True)
    decoder = Decoder(model, *left_pad(PROMPTS[:3]), config)
    decoder.cancel(0)  # before the first step: the other rows still score their own prompts
    while not decoder.done:
        decoder.step()
    assert decoder.prompt_logprobs[0] == [] and decoder.logprobs[0] == []
    for row in (1, 2):
        sequence = torch.tensor([PROMPTS[row] + decoder.tokens[row]])
        with torch.no_grad():
            logprobs = model(sequence)[0].float().log_softmax(dim=-1)[:-1]
        expected = logprobs.gather(1, sequence[0, 1:, None])[:, 0]
        entries = decoder.prompt_logprobs[row] + decoder.logprobs[row]
        assert [e.token for e in entries] == sequence[0, 1:].tolist()
        assert torch.allclose(torch.tensor([e.logprob for e in entries]), expected, atol=1e-5)
        top = logprobs.topk(2, dim=-1).indices.tolist()
        assert [[t for t, _ in e.top] for e in entries] == top


def test_text_stream_adds_whole_characters_only():
    tokenizer = train_bpe(["hello world"], vocab_size=300)  # no merges: é is 2 tokens, 😀 4
    ids = tokenizer.encode("é€😀 gu").ids
    stream = TextStream(tokenizer.decode)
    pieces = [stream.push(i) for i in ids]
    assert pieces[:2] == ["", "é"] and not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == stream.text == tokenizer.decode(ids)
    # Bytes that never form a character are U+FFFD, as in the whole decode, once that is known.
    broken = TextStream(tokenizer.decode)
    assert [broken.push(i) for i in [*ids[2:4], *tokenizer.encode(" g").ids]] == [
        "",
        "",
        "\ufffd ",
        "g",
    ]
    cut = TextStream(tokenizer.decode)
    assert cut.push(ids[0]) == "" and cut.flush() == "\ufffd" == cut.text  # ended mid-character
    # A run of stray continuation bytes is sent as it goes: only the last 3 may still change.
    stray = TextStream(tokenizer.decode)
    pieces = [stray.push(ids[1]) for _ in range(6)]  # é's second byte, alone, six times
    assert "".join(pieces) == "\ufffd" * 3 and stray.flush() == "\ufffd" * 3


def test_repetition_penalty_changes_greedy_output():
    model = tiny()
    prompt = torch.tensor([[7, 7, 7]])
    plain = generate(model, prompt, None, GREEDY).tokens[0]
    assert len(set(plain)) < len(plain)  # the tiny random model repeats itself
    penalised = generate(
        model,
        prompt,
        None,
        GenerationConfig(max_new_tokens=12, temperature=0, repetition_penalty=1e4),
    ).tokens[0]
    assert len(set(penalised)) == len(penalised) and not set(penalised) & {7}


def test_eos_stop_strings_and_cancel():
    model = tiny()
    ids, mask = left_pad(PROMPTS[:2])
    tokens = generate(model, ids, mask, GREEDY).tokens
    eos = tokens[0][3]
    out = generate(
        model, ids, mask, GenerationConfig(max_new_tokens=12, temperature=0, eos_token_id=eos)
    )
    assert out.tokens[0] == tokens[0][:4] and out.finish_reasons[0] == "eos"
    cut = tokens[1].index(eos) + 1 if eos in tokens[1] else 12
    assert out.tokens[1] == tokens[1][:cut]

    def decode(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    stop = decode(tokens[0][4:6])
    out = generate(
        model,
        ids,
        mask,
        GenerationConfig(max_new_tokens=12, temperature=0, stop=[stop]),
        decode=decode,
    )
    assert out.finish_reasons[0] == "stop" and out.tokens[0] == tokens[0][:6]
    assert out.texts[0] == decode(tokens[0][:4])
    with pytest.raises(ValueError, match="stop strings need `decode`"):
        generate(model, ids, mask, GenerationConfig(stop=["x"]))

    decoder = Decoder(model, ids, mask, GREEDY)
    first = decoder.step()
    decoder.cancel(1)
    second = decoder.step()
    assert first == [tokens[0][0], tokens[1][0]] and second == [tokens[0][1], None]
    assert decoder.cache.layers[0].k.shape[0] == 1  # the cancelled row left the batch
    while not decoder.done:
        decoder.step()
    assert decoder.output().finish_reasons == ["length", "cancelled"]
    assert decoder.output().tokens[0] == tokens[0]


def test_model_mode_restored_and_bad_input_refused():
    model = tiny().train()
    generate(model, torch.tensor([[1, 2]]), None, GenerationConfig(max_new_tokens=2))
    assert model.training
    with pytest.raises(ValueError, match="left padding"):
        generate(model, torch.tensor([[1, 2]]), torch.tensor([[1, 0]]))
    with pytest.raises(ValueError, match="max_seq_len 64"):
        generate(
            tiny(alibi=False), torch.tensor([[1] * 60]), None, GenerationConfig(max_new_tokens=5)
        )
    with pytest.raises(ValueError, match=r"token ids in \[0, 50\)"):
        generate(model, torch.tensor([[1, 50]]))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        GenerationConfig(temperature=-1)
    with pytest.raises(ValueError, match="top_p must be in"):
        GenerationConfig(top_p=0)
    with pytest.raises(ValueError, match="cannot be padded"):
        Decoder(tiny(infini=dict(segment_len=4)), *left_pad(PROMPTS[:2]))
    with pytest.raises(ValueError, match="KV cache holds 3 positions"):
        model(torch.tensor([[1, 2, 3, 4]]), cache=new_cache(model, 3))


@pytest.mark.parametrize("n_heads", [4, 3])
def test_greedy_equals_transformers_generate(tmp_path, n_heads):
    model = tiny(n_heads=n_heads, d_model=48, max_seq_len=32)
    export_to_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = left_pad(PROMPTS)
    ours = generate(model, ids, mask, GREEDY)
    theirs = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert theirs[:, ids.shape[1] :].tolist() == ours.tokens


def test_compiled_model_decodes_eagerly_with_the_same_tokens():
    """Each decoding step has new shapes; compiling them would recompile at every step."""
    from torch._dynamo.utils import counters

    from llmfoundry.distributed import SingleDevice  # which compiles the blocks

    ids, mask = left_pad(PROMPTS[:2])
    eager = generate(tiny(), ids, mask, GREEDY)
    counters.clear()
    compiled = generate(SingleDevice("cpu").prepare(tiny(compile=True)), ids, mask, GREEDY)
    assert compiled.tokens == eager.tokens
    assert not counters["frames"]["total"], "decoding went through torch.compile"


@pytest.mark.parametrize(
    "variant", ["alibi", "learned_pos", "gqa", "window", "rope_rmsnorm_glu_untied"]
)
def test_prompts_joining_a_running_batch_decode_as_if_alone(variant):
    model = tiny(attn_impl="torch", **VARIANTS[variant])
    sampled = GenerationConfig(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=5)
    penalised = GenerationConfig(max_new_tokens=4, temperature=0, repetition_penalty=2.0)
    decoder = Decoder(model, *left_pad(PROMPTS[:2]), GREEDY)
    decoder.step()
    decoder.step()
    joins = [([3] * 11, GREEDY), ([42], penalised)]  # longer, then shorter than the batch so far
    rows = [decoder.add(prompt, config) for prompt, config in joins]
    decoder.step()
    rows.append(decoder.add([5, 4, 3], sampled))
    while not decoder.done:
        decoder.step()
    out = decoder.output()
    assert rows == [2, 3, 4] and out.finish_reasons == ["length"] * 5
    expected = [(p, GREEDY) for p in PROMPTS[:2]] + joins + [([5, 4, 3], sampled)]
    for row, (prompt, config) in enumerate(expected):
        alone = generate(model, torch.tensor([prompt]), None, config).tokens[0]
        assert out.tokens[row] == alone, row
    with pytest.raises(ValueError, match="step\\(\\) once first"):
        Decoder(model, torch.tensor([[1]]), None, GREEDY).add([2])
