"""The mixture-of-experts families (Qwen3-MoE, Mixtral) against transformers' Qwen3MoeForCausalLM
and MixtralForCausalLM: weights both ways, logits, the load-balancing loss, greedy decoding, a
folder round trip, the exact parameter counts of the published shapes, and the config checks."""

from __future__ import annotations

import dataclasses
import re
from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from llmfoundry.models.families import build_model, family_of, family_of_hf
from llmfoundry.models.hf_lib import transformers
from llmfoundry.models.mixtral import MixtralConfig, MixtralForCausalLM
from llmfoundry.models.mixtral import hf as mixtral_hf
from llmfoundry.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from llmfoundry.models.qwen3_moe import hf as qwen3_moe_hf
from llmfoundry.planning import moe_activation_bytes

VOCAB = 128
ADAPTERS: dict[str, ModuleType] = {"qwen3_moe": qwen3_moe_hf, "mixtral": mixtral_hf}
HF_CLASSES = {
    "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    "mixtral": transformers.MixtralForCausalLM,
}
# Two layers, grouped-query attention, 8 experts; Qwen3's head width its own (32, where
# d_model / n_heads is 16) and top 3 unrenormalised (Qwen3-MoE's norm_topk_prob false), Mixtral
# top 2 renormalised. init_std 0.1: the random logits are far from ties, so neither greedy
# decoding nor the routing is decided by float noise.
TINY = dict(
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    n_layers=2,
    n_experts=8,
    expert_hidden=32,
    vocab_size=VOCAB,
    max_seq_len=256,
    rope_theta=10000.0,
    init_std=0.1,
)


def tiny(family: str, **overrides):
    if family == "qwen3_moe":
        fields = dict(TINY, head_dim=32, top_k=3, norm_topk_prob=False)
        return Qwen3MoeConfig(**{**fields, **overrides})
    return MixtralConfig(**{**TINY, "top_k": 2, **overrides})


def build(family: str, seed: int = 0, **overrides):
    """A tiny model whose norm weights are random too (at init they are 1, which would hide a
    norm that ignores its weight, or two norms swapped by the adapter)."""
    torch.manual_seed(seed)
    model = build_model(tiny(family, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def random_ids(batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


VARIANTS = {
    "qwen3_moe": dict(
        plain={},
        renormalised=dict(norm_topk_prob=True),
        tied_mha=dict(tie_word_embeddings=True, n_kv_heads=4, head_dim=None),
    ),
    "mixtral": dict(
        plain={},
        tied_mqa=dict(tie_word_embeddings=True, n_kv_heads=1),
        top1=dict(top_k=1, attn_impl="torch"),
        window=dict(sliding_window=16),  # of the 48 tokens: most keys out of reach
    ),
}
CASES = [(f, v) for f, variants in VARIANTS.items() for v in variants]


@pytest.mark.parametrize("family, variant", CASES)
def test_logits_equal_transformers(family, variant):
    model = build(family, **VARIANTS[family][variant])
    hf_model = ADAPTERS[family].to_hf_model(model)
    ids = random_ids(2, 48)
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    assert relative_error(ours, theirs) < 1e-5


def test_the_families_are_found_by_config_and_model():
    """Each its own family, though both models are the shared DecoderLM (test_families.py finds
    every family by its target and model_type)."""
    for family, config_class, model_class in (
        ("qwen3_moe", Qwen3MoeConfig, Qwen3MoeForCausalLM),
        ("mixtral", MixtralConfig, MixtralForCausalLM),
    ):
        model = build(family)
        assert type(model) is model_class and family_of(model).name == family
        assert family_of(model.config).config_class is config_class


@pytest.mark.parametrize("family", ADAPTERS)
@pytest.mark.parametrize("tie", [False, True])
def test_hf_round_trip_is_exact(family, tie):
    model = build(family, tie_word_embeddings=tie)
    adapter = ADAPTERS[family]
    hf_model = adapter.to_hf_model(model)
    state = model.state_dict()
    hf_state = hf_model.state_dict()
    assert len(hf_state) == len(state) - model.config.n_layers + tie  # w_gate, w_up: gate_up
    gate_up = hf_state["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[:, :32], state["transformer.blocks.1.ffn.experts.w_gate"])
    again = adapter.from_hf_model(hf_model)
    assert again.config == model.config
    assert all(torch.equal(again.state_dict()[k], t) for k, t in state.items())
    back = adapter.from_hf_config(adapter.to_hf_config(model.config))
    assert back == model.config


@pytest.mark.parametrize("family", ADAPTERS)
def test_export_folder_loads_in_transformers_and_imports_back(family, tmp_path):
    """The folder holds the per-expert tensors of the released checkpoints (transformers
    converts its fused experts on save), and transformers' AutoModel computes ours from it
    (Mixtral's with a sliding window, which the folder carries)."""
    window = dict(sliding_window=16) if family == "mixtral" else {}
    model = build(family, tie_word_embeddings=True, **window)
    ADAPTERS[family].export_to_hf(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    expert = {
        "qwen3_moe": "model.layers.0.mlp.experts.7.gate_proj.weight",
        "mixtral": "model.layers.0.block_sparse_moe.experts.7.w1.weight",
    }[family]
    assert expert in names
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded) is HF_CLASSES[family]
    ids = random_ids(1, 40)
    with torch.no_grad():
        assert relative_error(model(ids), loaded(ids).logits) < 1e-5
    back = family_of_hf(tmp_path).from_hf(tmp_path)
    assert back.config == model.config
    assert all(torch.equal(back.state_dict()[k], t) for k, t in model.state_dict().items())


def test_a_qwen_release_names_its_experts_num_experts(tmp_path):
    """Qwen's config.json says num_experts, transformers 5 writes num_local_experts (its
    attribute_map): either imports; neither is refused, not read as transformers' default."""
    import json

    model = build("qwen3_moe")
    qwen3_moe_hf.export_to_hf(model, tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    path.write_text(json.dumps(raw))
    assert qwen3_moe_hf.from_hf(tmp_path).config == model.config
    del raw["num_experts"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="config.json has no 'num_experts'"):
        qwen3_moe_hf.from_hf(tmp_path)


@pytest.mark.parametrize("family", ADAPTERS)
def test_the_loss_adds_transformers_load_balancing_loss(family):
    """transformers' loss with output_router_logits is the cross entropy plus
    router_aux_loss_coef * aux_loss; ours has the same cross entropy, the aux weight carried as
    router_aux_loss_coef, and as aux loss load_balancing_loss_func per layer's router logits,
    averaged (transformers passes it every layer's at once: models/layers/moe.py says why not)."""
    weight = 0.5  # large, so the aux term is far above the float noise of the cross entropy
    model = build(family, aux_loss_weight=weight).train()
    ids = random_ids(2, 32)
    batch = {"input_ids": ids, "labels": ids}
    hf_model = ADAPTERS[family].to_hf_model(model).train()
    unweighted = type(model)(dataclasses.replace(model.config, aux_loss_weight=0.0))
    unweighted.load_state_dict(model.state_dict())
    with torch.no_grad():
        theirs = hf_model(ids, labels=ids, output_router_logits=True)
        ours = model.loss(model(batch), batch)
        cross_entropy = unweighted.loss(unweighted(batch), batch)
    spec = model.spec.moe
    per_layer = [
        load_balancing_loss_func((logits,), spec.n_experts, spec.top_k)
        for logits in theirs.router_logits
    ]
    aux = float(torch.stack(per_layer).mean())
    assert weight * aux > 0.1  # the aux term is a real part of the loss
    their_cross_entropy = float(theirs.loss) - weight * float(theirs.aux_loss)
    assert float(cross_entropy) == pytest.approx(their_cross_entropy, rel=1e-5)
    assert float(ours - cross_entropy) == pytest.approx(weight * aux, rel=1e-5)


@pytest.mark.parametrize("family", ADAPTERS)
def test_greedy_decoding_equals_transformers_generate(family):
    """Left-padded prompts of different lengths, token for token."""
    from llmfoundry.models.generation import GenerationConfig, generate, left_pad

    model = build(family, tie_word_embeddings=True)
    hf_model = ADAPTERS[family].to_hf_model(model)
    prompts = [random_ids(1, 9, seed=2)[0].tolist(), random_ids(1, 5, seed=3)[0].tolist()]
    ids, mask = left_pad(prompts)
    new = 12
    ours = generate(model, ids, mask, GenerationConfig(max_new_tokens=new, temperature=0.0))
    with torch.no_grad():
        theirs = hf_model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=new, pad_token_id=0
        )
    assert ours.tokens == theirs[:, ids.shape[1] :].tolist()


def saved_bytes(model, ids: torch.Tensor, autocast: bool) -> int:
    """Bytes of the tensors autograd keeps in a training forward, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (storage := t.untyped_storage()).data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(ids)
    return sum(saved.values())


@pytest.mark.parametrize("family", ADAPTERS)
@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_activation_bytes_are_what_autograd_keeps(family, precision):
    """The planner's bytes per token per block (the family's activation_bytes, and the MoE
    layer's: planning.moe_activation_bytes) against the
    tensors a training forward keeps: one block's (two layers less one) per token (four rows
    less two), which leaves out what does not grow with either (the head, RoPE's tables, the
    bf16 copies of the weights)."""
    seq = 64
    kept = {}
    for n_layers in (1, 2):
        model = build(family, n_layers=n_layers).train()
        model(random_ids(1, seq))  # the grouped multiply's one-time probe, not counted
        for rows in (2, 4):
            kept[n_layers, rows] = saved_bytes(model, random_ids(rows, seq), precision != "fp32")
    measured = (kept[2, 4] - kept[1, 4] - kept[2, 2] + kept[1, 2]) / (2 * seq)
    moe = moe_activation_bytes(model.spec.moe, model.config.d_model, precision)
    planned = family_of(model).activation_bytes(model.config, precision) + moe
    assert planned == pytest.approx(measured, rel=0.02)


PUBLISHED = {
    # (total, active per token): Qwen's model card (30.5B total, 3.3B activated) and Mistral's
    # (46.7B, 12.9B), exactly as the published config.json shapes give them.
    "qwen3-30b-a3b": (30_532_122_624, 3_353_032_704),
    "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_shapes_count_exactly(name):
    family = "qwen3_moe" if name.startswith("qwen") else "mixtral"
    config_class = {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}[family]
    cfg = config_class.preset(name, init_device="meta")
    model = build_model(cfg)
    assert (model.num_params(), model.num_params(active=True)) == PUBLISHED[name]
    with torch.device("meta"):
        hf_model = HF_CLASSES[family](ADAPTERS[family].to_hf_config(cfg))
    assert sum(p.numel() for p in hf_model.parameters()) == PUBLISHED[name][0]


def test_the_tiny_sizes_go_through_llama_tiny_s_parameters_per_token():
    """mixtral-tiny and qwen3-moe-tiny: llama-tiny's attention and, per token, its FFN width,
    so a token goes through llama-tiny's parameters plus the routers (and Qwen3's q/k norms),
    out of about twice as many."""
    from llmfoundry.models.llama import LlamaConfig

    llama = build_model(LlamaConfig.preset("llama-tiny", init_device="meta")).num_params()
    layers, d_model, head_dim = 4, 256, 64
    for cfg, extra in (
        (MixtralConfig.preset("mixtral-tiny", init_device="meta"), layers * 8 * d_model),
        (
            Qwen3MoeConfig.preset("qwen3-moe-tiny", init_device="meta"),
            layers * (16 * d_model + 2 * head_dim),
        ),
    ):
        model = build_model(cfg)
        assert model.num_params(active=True) == llama + extra
        assert 1.9 * llama < model.num_params() < 2 * llama


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("mixtral", dict(top_k=9), "MixtralConfig.top_k (9) must be at most n_experts (8)"),
        ("mixtral", dict(n_kv_heads=3), "MixtralConfig.n_kv_heads must be a positive divisor"),
        ("mixtral", dict(aux_loss_weight=-1.0), "MixtralConfig.aux_loss_weight must be >= 0"),
        ("mixtral", dict(sliding_window=0), "MixtralConfig.sliding_window must be a positive"),
        (
            "qwen3_moe",
            dict(head_dim=15),
            "Qwen3MoeConfig head dimension head_dim = 15 must be even",
        ),
        ("qwen3_moe", dict(n_experts=0), "Qwen3MoeConfig.n_experts must be a positive integer"),
        ("qwen3_moe", dict(norm_topk_prob="yes"), "Qwen3MoeConfig.norm_topk_prob must be true"),
        ("qwen3_moe", dict(init_device="cuda"), "Qwen3MoeConfig.init_device must be one of"),
    ],
)
def test_config_mistakes_are_named(family, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tiny(family, **overrides)


@pytest.mark.parametrize(
    "family, field, value, message",
    [
        ("qwen3_moe", "mlp_only_layers", [1], "mlp_only_layers=[1]"),
        ("qwen3_moe", "decoder_sparse_step", 2, "decoder_sparse_step=2"),
        ("qwen3_moe", "attention_bias", True, "attention_bias=True"),
        ("qwen3_moe", "sliding_window", 64, "sliding_window=64"),
        ("mixtral", "hidden_act", "gelu", "hidden_act='gelu'"),
        (
            "mixtral",
            "rope_parameters",
            {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
            "rope_type='linear'",
        ),
    ],
)
def test_import_refuses_what_our_model_would_misread(family, field, value, message):
    hf = ADAPTERS[family].to_hf_config(tiny(family))
    setattr(hf, field, value)
    what = {"qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral"}[family]
    with pytest.raises(
        ValueError, match=f"cannot import this transformers {what} config.*{re.escape(message)}"
    ):
        ADAPTERS[family].from_hf_config(hf)
