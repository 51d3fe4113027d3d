"""Every conf/model size: it builds, and its parameter count matches transformers and the papers.

Each family's sizes share its conf/model_base/<family>.yaml; the llama, qwen3-moe and mixtral
files are their families' PRESETS (whose counts test_llama.py and test_moe_families.py check).
"""

import re
from pathlib import Path

import pytest
import torch
import transformers
from hydra.utils import instantiate
from omegaconf import OmegaConf

from llmfoundry.config import ConfigError
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.models import MPTConfig, MPTForCausalLM
from llmfoundry.models.llama import PRESETS, LlamaConfig

REPO = Path(__file__).resolve().parents[2]
# Every size; model=from_checkpoint takes a checkpoint's (tests/e2e/test_finetune.py), and
# model=custom your own module's (tests/e2e/test_user_model.py).
MODEL_CONFS = sorted(
    p
    for p in (REPO / "conf" / "model").glob("*.yaml")
    if p.stem not in ("from_checkpoint", "custom")
)
SIZES = [
    "mpt-tiny",
    "mpt-125m",
    "mpt-350m",
    "mpt-760m",
    "mpt-1b",
    "mpt-3b",
    "mpt-7b",
    "mpt-13b",
    "mpt-30b",
    "mpt-70b",
]
LLAMA_SIZES = ["llama-tiny", "llama3-1b", "llama3-8b", "llama3-70b"]
# The mixture-of-experts families' sizes: their presets (whose counts test_moe_families.py checks).
MOE_SIZES = {
    "qwen3_moe": ["qwen3-moe-tiny", "qwen3-30b-a3b"],
    "mixtral": ["mixtral-tiny", "mixtral-8x7b"],
}
FAMILY_SIZES = {"mpt": SIZES, "llama": LLAMA_SIZES, **MOE_SIZES}
# What a size file may state on top of its family's base: its shape (and the options of its
# published release that differ from the base).
OWN_KEYS = {
    "mpt": {"d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size"},
    "llama": {
        "d_model",
        "n_heads",
        "n_kv_heads",
        "n_layers",
        "max_seq_len",
        "vocab_size",
        "multiple_of",
        "ffn_dim_multiplier",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
    },
    "qwen3_moe": {
        "d_model",
        "n_heads",
        "n_kv_heads",
        "head_dim",
        "n_layers",
        "n_experts",
        "top_k",
        "expert_hidden",
        "max_seq_len",
        "vocab_size",
        "rope_theta",
    },
    "mixtral": {
        "d_model",
        "n_heads",
        "n_kv_heads",
        "n_layers",
        "expert_hidden",
        "max_seq_len",
        "vocab_size",
        "rope_theta",
    },
}
REFERENCE = REPO.parent / "shared" / "docs" / "reference-numbers.md"


def load(name: str, **overrides) -> MPTConfig:
    """The model config `model=<name>` composes to (its shape on top of conf/model_base/mpt.yaml)."""
    return instantiate(compose_config(REPO / "conf", [f"model={name}"]).model, **overrides)


def test_sizes_state_only_their_shape_and_share_the_base_options():
    base = OmegaConf.load(REPO / "conf" / "model_base" / "mpt.yaml")
    for path in MODEL_CONFS:
        conf = OmegaConf.load(path)
        family = next(f for f, sizes in FAMILY_SIZES.items() if path.stem in sizes)
        assert list(conf.defaults) == [f"/model_base/{family}@_here_", "_self_"], path.name
        assert set(conf) - {"defaults"} <= OWN_KEYS[family], path.name
    cfg = compose_config(REPO / "conf", ["model=mpt-1b", "model.alibi=false"]).model
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers) == (2048, 16, 24)
    assert cfg.alibi is False and cfg.max_seq_len == base.max_seq_len == 2048
    check(REPO / "conf", ["model=mpt-1b"])  # the composed config still validates
    with pytest.raises(ConfigError, match=r"model.alibii: unknown key; did you mean 'alibi'"):
        check(REPO / "conf", ["model=mpt-1b", "+model.alibii=true"])


def test_every_size_has_a_config():
    assert sorted(p.stem for p in MODEL_CONFS) == sorted(sum(FAMILY_SIZES.values(), []))


@pytest.mark.parametrize("name", LLAMA_SIZES)
def test_llama_sizes_are_the_published_shapes(name):
    cfg = load(name)
    assert isinstance(cfg, LlamaConfig)
    assert cfg == LlamaConfig.preset(name)
    check(REPO / "conf", [f"model={name}"])
    assert set(PRESETS) == set(LLAMA_SIZES)


@pytest.mark.parametrize("family, name", [(f, n) for f, names in MOE_SIZES.items() for n in names])
def test_moe_sizes_are_the_presets(family, name):
    from llmfoundry.models.mixtral import MixtralConfig
    from llmfoundry.models.qwen3_moe import Qwen3MoeConfig

    config_class = {"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig}[family]
    cfg = load(name)
    assert isinstance(cfg, config_class) and cfg == config_class.preset(name)
    check(REPO / "conf", [f"model={name}"])


def published_counts() -> dict[str, tuple[int, int, int, int]]:
    """name -> (d_model, n_heads, n_layers, published parameter count) from the reference table."""
    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} is absent")
    rows = re.findall(
        r"^\| (mpt-\w+) \| (\d+) \| (\d+) \| (\d+) \|[^|]*\|[^|]*\|\s*([\d,]*)\s*\|$",
        REFERENCE.read_text(),
        flags=re.MULTILINE,
    )
    assert len(rows) == 9, "the reference table changed shape"
    return {r[0]: (int(r[1]), int(r[2]), int(r[3]), int(r[4].replace(",", "") or 0)) for r in rows}


@pytest.mark.parametrize("name", SIZES)
def test_param_count_equals_transformers(name):
    cfg = load(name, init_device="meta")
    assert cfg.alibi and cfg.no_bias and cfg.attn_impl == "sdpa"
    model = MPTForCausalLM(cfg)
    hf_config = transformers.MptConfig(
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        expansion_ratio=cfg.expansion_ratio,
        max_seq_len=cfg.max_seq_len,
        vocab_size=cfg.vocab_size,
    )
    with torch.device("meta"):
        hf = transformers.MptForCausalLM(hf_config)
    assert model.num_params() == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("name", [s for s in SIZES if s != "mpt-tiny"])
def test_shapes_and_published_counts(name):
    d_model, n_heads, n_layers, published = published_counts()[name]
    cfg = load(name, init_device="meta", alibi=False, no_bias=False)
    assert (cfg.d_model, cfg.n_heads, cfg.n_layers) == (d_model, n_heads, n_layers)
    assert (cfg.vocab_size, cfg.max_seq_len, cfg.expansion_ratio) == (50368, 2048, 4)
    assert cfg.learned_pos_emb
    if published:  # the table gives counts for some sizes only
        assert MPTForCausalLM(cfg).num_params() == published


def test_tiny_is_cpu_sized():
    model = MPTForCausalLM(load("mpt-tiny", init_device="meta"))
    assert 2_000_000 < model.num_params() < 10_000_000
    assert (model.config.vocab_size, model.config.max_seq_len) == (8192, 256)
