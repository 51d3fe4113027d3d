"""The Qwen3 and Qwen2 families against transformers' Qwen3ForCausalLM and Qwen2ForCausalLM
(built here from tiny random configs): weights both ways, logits, greedy decoding, a folder
exported and imported, the published shapes' parameter counts, and the configs' refusals.
Training under FSDP and tensor parallelism: tests/distributed/test_tensor_parallel.py."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import transformers
from hydra.utils import instantiate

from llmfoundry.config.preflight import check, compose_config
from llmfoundry.models.families import FAMILIES, family_of, family_of_hf
from llmfoundry.models.generation import GenerationConfig, generate, left_pad
from llmfoundry.models.qwen3 import (
    PRESETS,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from llmfoundry.models.qwen3.hf import (
    export_to_hf,
    from_hf,
    from_hf_config,
    from_hf_model,
    to_hf_config,
    to_hf_model,
)

REPO = Path(__file__).resolve().parents[2]
VOCAB = 128
# Heads 32 wide while d_model / n_heads is 16 (as Qwen3-0.6B's 128 and 64), GQA 4:2.
QWEN3 = dict(d_model=64, n_heads=4, n_kv_heads=2, head_dim=32, n_layers=2, ffn_hidden_size=96)
QWEN2 = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, ffn_hidden_size=96)
COMMON = dict(vocab_size=VOCAB, max_seq_len=256, rope_theta=10000.0, init_std=0.1)


def build(kind: str = "qwen3", seed: int = 0, **overrides) -> Qwen3ForCausalLM | Qwen2ForCausalLM:
    """A tiny model whose norm weights (q/k norms included) and biases are random too: at init
    they are 1 and 0, which would hide a norm or bias ignored, or two swapped by the adapter.
    init_std 0.1 keeps random logits far from ties, so greedy decoding is not float noise."""
    config_class, model_class, shape = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, QWEN3),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, QWEN2),
    }[kind]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**shape, **COMMON, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
    return model


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def imported(back, cfg) -> bool:
    """`back` (read from transformers) is `cfg`: all but the kernel, which is ours to pick."""
    return dataclasses.replace(back, attn_impl=cfg.attn_impl) == cfg


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


VARIANTS = {
    "qwen3-untied": ("qwen3", {}),
    "qwen3-tied-mqa-torch-kernel": (
        "qwen3",
        dict(tie_word_embeddings=True, n_kv_heads=1, attn_impl="torch"),
    ),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers_and_weights_round_trip(variant):
    kind, overrides = VARIANTS[variant]
    model = build(kind, **overrides)
    hf_model = to_hf_model(model)
    assert type(hf_model) is getattr(transformers, f"{kind.capitalize()}ForCausalLM")
    ids = random_ids(2, 48)
    with torch.no_grad():
        assert relative_error(model(ids), hf_model(ids).logits) < 1e-5
    # Back from transformers' model: the same tensors, the same config.
    back = from_hf_model(hf_model)
    assert type(back) is type(model) and imported(back.config, model.config)
    state = model.state_dict()
    assert back.state_dict().keys() == state.keys()
    assert all(torch.equal(back.state_dict()[k], t) for k, t in state.items())
    assert imported(from_hf_config(to_hf_config(model.config)), model.config)


def test_the_qk_norms_and_the_biases_are_computed():
    """The parity above could pass with Qwen3's q/k norms or Qwen2's biases dropped on both
    sides (the adapter reads what our model has): they change the logits."""
    ids = random_ids(1, 16)
    for kind, name in (("qwen3", "q_norm.weight"), ("qwen3", "k_norm.weight"), ("qwen2", "bias")):
        model = build(kind)
        with torch.no_grad():
            before = model(ids)
            for param_name, p in model.named_parameters():
                if param_name.endswith(name):
                    p.copy_(torch.ones_like(p) if "norm" in name else torch.zeros_like(p))
            assert (model(ids) - before).abs().max() > 1e-3, name


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_greedy_decoding_equals_transformers_generate(kind):
    """Our KV-cache decoding against transformers' generate, left-padded prompts of different
    lengths, token for token."""
    model = build(kind, tie_word_embeddings=True)
    hf_model = to_hf_model(model)
    prompts = [random_ids(1, 9, seed=2)[0].tolist(), random_ids(1, 5, seed=3)[0].tolist()]
    ids, mask = left_pad(prompts)
    new = 12
    ours = generate(model, ids, mask, GenerationConfig(max_new_tokens=new, temperature=0.0))
    with torch.no_grad():
        theirs = hf_model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0
        )
    assert ours.tokens == theirs[:, ids.shape[1] :].tolist()


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_export_folder_loads_in_transformers_and_imports_back(tmp_path, kind):
    model = build(kind)
    export_to_hf(model, tmp_path)
    assert family_of_hf(tmp_path) is family_of(model) is FAMILIES[kind]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded).__name__ == f"{kind.capitalize()}ForCausalLM"
    ids = random_ids(1, 40)
    with torch.no_grad():
        assert relative_error(model(ids), loaded(ids).logits) < 1e-5
    back = FAMILIES[kind].from_hf(tmp_path)
    assert imported(back.config, model.config)
    assert all(torch.equal(back.state_dict()[k], t) for k, t in model.state_dict().items())


PUBLISHED = {
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_shapes_count_what_transformers_counts(name):
    """Each preset (and its conf/model file) is the release's config.json: our model of it
    counts what transformers' model of it counts, the release's size."""
    config_class, _ = PRESETS[name]
    cfg = config_class.preset(name, init_device="meta")
    assert instantiate(compose_config(REPO / "conf", [f"model={name}"]).model) == (
        dataclasses.replace(cfg, init_device="cpu")
    )
    ours = family_of(cfg).build(cfg).num_params()
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(to_hf_config(cfg))
    assert ours == sum(p.numel() for p in hf_model.parameters()) == PUBLISHED[name]


def test_tiny_preset_is_the_conf_file_and_validates():
    cfg = instantiate(compose_config(REPO / "conf", ["model=qwen3-tiny"]).model)
    assert cfg == Qwen3Config.preset("qwen3-tiny")
    assert cfg.head_dim * cfg.n_heads > cfg.d_model  # the small releases' wide heads
    check(REPO / "conf", ["model=qwen3-tiny"])
    assert set(PRESETS) == {"qwen3-tiny", *PUBLISHED}
    with pytest.raises(ValueError, match="no Qwen3 preset 'qwen3-7b'; presets: qwen3-0.6b"):
        Qwen3Config.preset("qwen3-7b")
    with pytest.raises(ValueError, match="no Qwen2 preset 'qwen3-8b'; presets: qwen2.5-0.5b"):
        Qwen2Config.preset("qwen3-8b")


@pytest.mark.parametrize(
    "config_class, overrides, message",
    [
        (Qwen3Config, dict(n_kv_heads=3), "Qwen3Config.n_kv_heads must be a positive divisor"),
        (Qwen3Config, dict(head_dim=15), "Qwen3Config head dimension head_dim = 15 must be even"),
        (Qwen3Config, dict(ffn_hidden_size=0), "Qwen3Config.ffn_hidden_size must be a positive"),
        (Qwen3Config, dict(attn_impl="fast"), "Qwen3Config.attn_impl='fast' is not known"),
        (Qwen3Config, dict(rms_norm_eps=0), "Qwen3Config.rms_norm_eps must be > 0"),
        (Qwen2Config, dict(d_model=62), "Qwen2Config.d_model (62) must be divisible by"),
        (Qwen2Config, dict(init_device="cuda"), "Qwen2Config.init_device must be one of"),
    ],
)
def test_config_mistakes_are_named(config_class, overrides, message):
    shape = QWEN3 if config_class is Qwen3Config else QWEN2
    with pytest.raises(ValueError, match=re.escape(message)):
        config_class(**{**shape, **COMMON, **overrides})


@pytest.mark.parametrize(
    "kind, field, value, message",
    [
        ("qwen3", "attention_bias", True, "attention_bias=True"),
        ("qwen3", "use_sliding_window", True, "use_sliding_window=True"),
        ("qwen2", "hidden_act", "gelu", "hidden_act='gelu'"),
        (
            "qwen3",
            "rope_parameters",
            {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
            "rope_type='yarn'",
        ),
    ],
)
def test_import_refuses_what_our_model_would_misread(kind, field, value, message):
    hf = to_hf_config(build(kind).config)
    setattr(hf, field, value)
    with pytest.raises(
        ValueError, match=f"cannot import this transformers {kind} config.*{message}"
    ):
        from_hf_config(hf)


def test_an_import_reads_no_weight_of_a_refused_folder(tmp_path):
    model = build("qwen3")
    export_to_hf(model, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(
        config.replace('"use_sliding_window": false', '"use_sliding_window": true')
    )
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        from_hf(tmp_path)


def test_planned_activations_are_llama_s_with_the_wide_heads_and_the_qk_norms():
    """The planner's bytes per token per block (measured within 5% of a CPU peak, spec.py):
    Qwen2 is Llama's count; Qwen3 adds its q/k norms' inputs and outputs, and its heads'
    width (n_heads * head_dim) where Llama's count reads d_model."""
    from llmfoundry.models.llama import LlamaConfig

    shape = dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, ffn_hidden_size=96)
    q, kv = 64, 32
    for precision, norm_bytes in (("fp32", 4), ("amp_bf16", 2)):
        llama = FAMILIES["llama"].activation_bytes(LlamaConfig(**shape), precision)
        assert FAMILIES["qwen2"].activation_bytes(Qwen2Config(**shape), precision) == llama
        qwen3 = FAMILIES["qwen3"].activation_bytes(Qwen3Config(**shape, head_dim=16), precision)
        assert qwen3 == llama + 2 * norm_bytes * (q + kv)
        wide = FAMILIES["qwen3"].activation_bytes(Qwen3Config(**shape, head_dim=32), precision)
        assert wide > qwen3
