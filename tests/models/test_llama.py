"""The Llama family against transformers' LlamaForCausalLM: weights, logits, greedy decoding,
packed documents, parameter counts of the published shapes, and a backward pass."""

import dataclasses
import re

import pytest
import torch
import transformers
from hydra.utils import instantiate
from omegaconf import OmegaConf

from llmfoundry.config import ConfigError
from llmfoundry.config.schema import validate_node
from llmfoundry.models.generation import Decoder, GenerationConfig, generate, left_pad
from llmfoundry.models.hf_decoder import from_hf_state_dict, to_hf_state_dict
from llmfoundry.models.llama import PRESETS, LlamaConfig, LlamaForCausalLM, RopeScaling
from llmfoundry.models.llama.hf import (
    export_to_hf,
    from_hf,
    from_hf_config,
    from_hf_model,
    to_hf_config,
    to_hf_model,
)

VOCAB = 128
# Llama 3.1-style scaling shrunk to the tiny model: with head_dim 16 and theta 10000 the
# wavelengths run from 6 to 35000 positions, so original 64 (high band < 16, low band > 64)
# leaves some frequencies alone, divides some by the factor and smooths some between.
SCALING = RopeScaling(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=64
)


def tiny(**overrides) -> LlamaConfig:
    """A 2-layer Llama with GQA (4 query heads, 2 key/value heads); init_std 0.1 so the random
    logits are far from ties and greedy decoding is not decided by float noise."""
    fields = dict(
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        n_layers=2,
        vocab_size=VOCAB,
        max_seq_len=256,
        multiple_of=32,
        rope_theta=10000.0,
        init_std=0.1,
    )
    return LlamaConfig(**{**fields, **overrides})


def build(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A tiny model whose norm weights are random too (at init they are 1, which would hide a
    norm that ignores its weight, or two norms swapped by the HF adapter)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def imported(back: LlamaConfig, cfg: LlamaConfig) -> bool:
    """`back` (read from transformers) is `cfg`: transformers stores the FFN width itself, not
    the rule (multiple_of, ffn_dim_multiplier) that gave it."""
    rule = dict(multiple_of=cfg.multiple_of, ffn_dim_multiplier=cfg.ffn_dim_multiplier)
    return dataclasses.replace(back, **rule) == cfg


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


VARIANTS = {
    "untied-mha": dict(n_kv_heads=4),
    "tied-gqa": dict(tie_word_embeddings=True),
    "gqa-rope-scaling": dict(rope_scaling=SCALING),
    "mqa-torch-kernel": dict(n_kv_heads=1, attn_impl="torch"),
}


@pytest.mark.parametrize("tie", [False, True])
def test_hf_round_trip_is_exact(tie):
    model = build(tie_word_embeddings=tie, rope_scaling=SCALING)
    state = model.state_dict()
    hf_state = to_hf_state_dict(state, tie)
    assert ("lm_head.weight" in hf_state) and (len(hf_state) == len(state) + tie)
    back = from_hf_state_dict(hf_state, tie, "LlamaForCausalLM")
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    # Through transformers' model itself (the copy), and the configs both ways.
    hf_model = to_hf_model(model)
    assert set(hf_model.state_dict()) == set(hf_state)
    again = from_hf_model(hf_model)
    assert all(torch.equal(again.state_dict()[k], t) for k, t in state.items())
    assert imported(from_hf_config(to_hf_config(model.config)), model.config)


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(variant):
    model = build(**VARIANTS[variant])
    hf_model = to_hf_model(model)
    ids = random_ids(2, 96)  # past original_max_seq_len: the scaled frequencies matter
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    assert (ours - theirs).abs().max() < 1e-5


def test_rope_scaling_changes_the_logits():
    """The scaling test above could pass with scaling ignored on both sides: it is not."""
    scaled = build(rope_scaling=SCALING)
    plain = build()
    ids = random_ids(1, 96)
    with torch.no_grad():
        assert (scaled(ids) - plain(ids)).abs().max() > 1e-2


def test_greedy_decoding_equals_transformers_generate():
    """Our KV-cache Decoder (MPT's generation code) against transformers' generate, left-padded
    prompts of different lengths included, token for token."""
    model = build(rope_scaling=SCALING, tie_word_embeddings=True)
    hf_model = to_hf_model(model)
    prompts = [random_ids(1, 9, seed=2)[0].tolist(), random_ids(1, 5, seed=3)[0].tolist()]
    ids, mask = left_pad(prompts)
    new = 16
    ours = generate(model, ids, mask, GenerationConfig(max_new_tokens=new, temperature=0.0))
    with torch.no_grad():
        theirs = hf_model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0
        )
    assert ours.tokens == theirs[:, ids.shape[1] :].tolist()
    assert ours.finish_reasons == ["length", "length"]


def test_a_request_joining_a_running_batch_decodes_as_alone():
    """Continuous batching (Decoder.add, the server's path) keeps each row's RoPE positions."""
    model = build()
    greedy = GenerationConfig(max_new_tokens=8, temperature=0.0)
    first, second = random_ids(1, 7, seed=4), random_ids(1, 11, seed=5)
    alone = generate(model, second, None, greedy).tokens[0]
    decoder = Decoder(model, first, None, greedy)
    for _ in range(2):
        decoder.step()
    row = decoder.add(second[0].tolist(), greedy)
    while not decoder.done:
        decoder.step()
    assert decoder.output().tokens[row] == alone
    assert decoder.output().tokens[0] == generate(model, first, None, greedy).tokens[0]


@pytest.mark.parametrize("attn_impl", ["torch", "sdpa"])
def test_a_packed_document_sees_what_it_sees_alone(attn_impl):
    model = build(attn_impl=attn_impl, rope_scaling=SCALING)
    first, second = random_ids(1, 10, seed=6), random_ids(1, 14, seed=7)
    packed = torch.cat([first, second], dim=1)
    sequence_id = torch.tensor([[0] * 10 + [1] * 14])
    with torch.no_grad():
        in_pack = model(packed, sequence_id)
        assert (in_pack[:, 10:] - model(second)).abs().max() < 1e-5
        assert (in_pack[:, :10] - model(first)).abs().max() < 1e-5
        # Without the ids the second document attends to the first.
        assert (model(packed)[:, 10:] - model(second)).abs().max() > 1e-3


def test_rope_positions_restart_at_each_document():
    """RoPE is relative, so a document's logits barely show a shift of all its positions; the
    positions themselves must still be the document's own (as transformers gives a document
    alone, and as a cache joined from rows of other lengths needs)."""
    model = build()
    seen = []
    model.transformer.rope.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    with torch.no_grad():
        model(random_ids(1, 24), torch.tensor([[0] * 10 + [1] * 14]))
        model(random_ids(1, 5))
    assert seen[0].tolist() == [list(range(10)) + list(range(14))]
    assert seen[1].tolist() == [list(range(5))]


@pytest.mark.parametrize("name", ["llama3-1b", "llama3-8b", "llama3-70b"])
def test_published_shapes_count_what_transformers_counts(name):
    published = {
        "llama3-1b": 1_235_814_400,
        "llama3-8b": 8_030_261_248,
        "llama3-70b": 70_553_706_496,
    }
    cfg = LlamaConfig.preset(name, init_device="meta")
    ours = LlamaForCausalLM(cfg).num_params()
    with torch.device("meta"):
        hf_model = transformers.LlamaForCausalLM(to_hf_config(cfg))
    theirs = sum(p.numel() for p in hf_model.parameters())
    assert abs(ours - theirs) <= 1e-3 * theirs
    assert ours == theirs == published[name]  # Meta's model cards


def test_backward_reaches_every_parameter():
    model = build(tie_word_embeddings=False).train()
    ids = random_ids(2, 32)
    labels = ids.clone()
    labels[0, :5] = -100
    batch = {
        "input_ids": ids,
        "labels": labels,
        "sequence_id": torch.tensor([[0] * 16 + [1] * 16] * 2),
    }
    loss = model.loss(model(batch), batch)
    assert loss.item() > 0
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_bf16_autocast_trains_close_to_float32():
    """The recipe's precision (amp_bf16): RMSNorm and RoPE run in float32 inside, so the loss
    stays within 1% of float32's and every gradient is finite."""
    model = build().train()
    ids = random_ids(2, 32)
    batch = {"input_ids": ids, "labels": ids}
    reference = model.loss(model(batch), batch).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(batch)
        loss = model.loss(logits, batch)
    assert logits.dtype == torch.bfloat16
    assert abs(loss.item() - reference) < 1e-2 * reference
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_flops_count_every_matmul_weight():
    """N in 6N is every parameter but the embedding lookup and the norms (untied head: counted)."""
    model = build()
    cfg = model.config
    norms = (2 * cfg.n_layers + 1) * cfg.d_model
    n_matmul = model.num_params(exclude_embeddings=True) - norms
    assert model.flops_per_token(64) == 6 * n_matmul + 12 * cfg.n_layers * cfg.d_model * 64


def test_export_folder_loads_in_transformers_and_imports_back(tmp_path):
    model = build(tie_word_embeddings=True, rope_scaling=SCALING)
    export_to_hf(model, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    ids = random_ids(1, 80)
    with torch.no_grad():
        assert (loaded(ids).logits - model(ids)).abs().max() < 1e-5
    back = from_hf(tmp_path)
    assert imported(back.config, model.config)
    assert all(torch.equal(back.state_dict()[k], t) for k, t in model.state_dict().items())


def test_presets_and_the_ffn_rule():
    assert LlamaConfig.preset("llama3-8b").ffn_hidden_size == 14336
    assert LlamaConfig.preset("llama3-70b").ffn_hidden_size == 28672
    assert LlamaConfig.preset("llama3-1b").ffn_hidden_size == 8192
    assert set(PRESETS) == {"llama-tiny", "llama3-1b", "llama3-8b", "llama3-70b"}
    with pytest.raises(ValueError, match="no Llama preset 'llama3-7b'; presets: llama-tiny"):
        LlamaConfig.preset("llama3-7b")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(n_kv_heads=3), "n_kv_heads must be a positive divisor of n_heads"),
        (dict(attn_impl="fast"), "attn_impl='fast' is not known; allowed: 'torch', 'sdpa'"),
        (dict(d_model=60, n_heads=4), "head dimension d_model / n_heads = 15 must be even"),
        (dict(rope_scaling={"factor": 8, "low_freq": 1}), "rope_scaling must be null or a mapping"),
        (dict(rope_scaling={"factor": 8, "high_freq_factor": 1}), "must exceed low_freq_factor"),
        (dict(init_device="cuda"), "init_device must be one of 'cpu', 'meta'"),
    ],
)
def test_config_mistakes_are_named(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny(**overrides)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("attention_bias", True, "attention_bias=True"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, "'linear'"),
    ],
)
def test_import_refuses_what_our_model_would_misread(field, value, message):
    hf = to_hf_config(tiny())
    setattr(hf, field, value)
    with pytest.raises(
        ValueError, match=f"cannot import this transformers Llama config.*{message}"
    ):
        from_hf_config(hf)


def test_meta_model_materialises_with_real_rope():
    """Built on meta (as build.py does), moved and initialised, it computes as one built on cpu."""
    model = LlamaForCausalLM(dataclasses.replace(tiny(), init_device="meta"))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    torch.manual_seed(0)
    reference = LlamaForCausalLM(tiny())
    ids = random_ids(1, 16)
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_config_schema_takes_a_llama_node():
    """What conf/model/llama-*.yaml will hold once build.py asks the family: the schema checks it
    like an MPT node (a misspelt key named), and Hydra builds it, rope_scaling from a mapping."""
    node = OmegaConf.create(
        {"_target_": "llmfoundry.models.llama.LlamaConfig", **PRESETS["llama-tiny"]}
    )
    node.rope_scaling = {"factor": 8.0, "original_max_seq_len": 128}
    validate_node("model", node)
    cfg = instantiate(node)
    assert cfg.rope_scaling == RopeScaling(factor=8.0, original_max_seq_len=128)
    node.n_kv_head = 2
    with pytest.raises(
        ConfigError, match="model.n_kv_head: unknown key; did you mean 'n_kv_heads'"
    ):
        validate_node("model", node)
