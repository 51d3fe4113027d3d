"""Qwen3Config and Qwen2Config: the shapes and options of Qwen's dense decoders, validated when
built, and the `DecoderSpec` each one is (`decoder_spec`).

Both are the shared decoder (models/layers/decoder.py) with Llama's parts: pre-RMSNorm blocks,
RoPE (rotate-half pairing), grouped-query attention, a SwiGLU MLP. What makes each its own:

- Qwen2 (transformers' ``model_type: qwen2``, Qwen2 and Qwen2.5): biases on q, k and v (not on
  the output projection); head_dim is d_model / n_heads.
- Qwen3 (``qwen3``): no biases, an RMSNorm over each query and key head (`q_norm`, `k_norm`,
  eps rms_norm_eps) before RoPE, and head_dim its own number (128 in every release, though
  d_model / n_heads is 64 for Qwen3-0.6B and 1.7B).

Neither has a sliding window here (every Qwen3 release turns it off) nor RoPE scaling (YaRN);
an import that sets them is refused (hf.py). The published shapes are `PRESETS`
(conf/model/qwen3-*.yaml and qwen2.5-*.yaml, on conf/model_base/qwen3.yaml and qwen2.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmfoundry.models import decoder_config as check
from llmfoundry.models.layers.decoder import DecoderSpec


@dataclass
class QwenConfig:
    """What Qwen2 and Qwen3 share (each subclass adds what is its own; see the module).

    `n_kv_heads` key/value heads (unset: one per query head), each shared by n_heads //
    n_kv_heads query heads; `ffn_hidden_size` the SwiGLU width (transformers'
    intermediate_size, stated by every release). `tie_word_embeddings` makes the output head
    the token embedding (the small releases). `max_seq_len` is the context the model is meant
    for (transformers' max_position_embeddings): RoPE has no position table, so nothing is
    sized by it. `attn_impl` picks a shared kernel (`llmfoundry.models.layers.kernels`).

    Initialisation (ours, as Llama's): every matrix and the embedding from N(0, init_std), the
    projections into the residual stream divided by sqrt(2 * n_layers), norms at 1.
    `init_device="meta"` builds without memory (then `to_empty` and `init_weights`).
    """

    d_model: int
    n_heads: int
    n_layers: int
    ffn_hidden_size: int
    n_kv_heads: int | None = None
    vocab_size: int = 151936
    max_seq_len: int = 32768
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attn_impl: str = "sdpa"
    init_std: float = 0.02
    init_device: str = "cpu"

    def __post_init__(self) -> None:
        check.check_rope_decoder(self)
        check.positive_int(type(self).__name__, "ffn_hidden_size", self.ffn_hidden_size)

    def _spec(self, head_dim: int, **own: Any) -> DecoderSpec:
        return check.rope_decoder_spec(
            self, head_dim, ffn="glu", ffn_hidden=self.ffn_hidden_size, ffn_act="silu", **own
        )


@dataclass
class Qwen3Config(QwenConfig):
    """Hyperparameters of a Qwen3 dense causal language model: a `QwenConfig` whose heads are
    `head_dim` wide whatever d_model / n_heads is (q_proj maps d_model to n_heads * head_dim,
    out_proj back), each query and key head RMS-normalised before RoPE, no biases."""

    head_dim: int = 128
    max_seq_len: int = 40960

    def __post_init__(self) -> None:
        super().__post_init__()
        check.positive_int("Qwen3Config", "head_dim", self.head_dim)
        check.rope_head_dim("Qwen3Config", self.head_dim, "head_dim")

    def decoder_spec(self) -> DecoderSpec:
        return self._spec(self.head_dim, qk_norm="head")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Qwen3Config:
        """The published shape `name` (see `PRESETS`), with any field overridden."""
        return cls(**{**_preset(name, cls), **overrides})


@dataclass
class Qwen2Config(QwenConfig):
    """Hyperparameters of a Qwen2 (and Qwen2.5) causal language model: a `QwenConfig` with
    biases on the q, k and v projections and heads d_model / n_heads wide."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check.heads_divide_width("Qwen2Config", self.d_model, self.n_heads)
        check.rope_head_dim("Qwen2Config", self.head_dim, "d_model / n_heads")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def decoder_spec(self) -> DecoderSpec:
        return self._spec(self.head_dim, qkv_bias=True)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Qwen2Config:
        """The published shape `name` (see `PRESETS`), with any field overridden."""
        return cls(**{**_preset(name, cls), **overrides})


def _preset(name: str, cls: type) -> dict[str, Any]:
    own = {n: fields for n, (config_class, fields) in PRESETS.items() if config_class is cls}
    return check.preset_fields(cls.__name__.removesuffix("Config"), own, name)


_QWEN3 = dict(n_kv_heads=8, head_dim=128, vocab_size=151936, max_seq_len=40960)
_QWEN2_5 = dict(rope_theta=1000000.0, rms_norm_eps=1e-6, max_seq_len=32768)

# name -> (config class, fields): Qwen's published config.json files. The counts are the model
# built from them (tests/models/test_qwen.py asserts each, and that transformers' model of the
# same config counts the same); the model cards round them (0.6B of which 0.44B are not the
# embedding, 1.7B / 1.4B, 4.0B / 3.6B, 8.2B / 6.95B; Qwen2.5: 0.49B, 7.61B).
PRESETS: dict[str, tuple[type, dict[str, Any]]] = {
    # For tests and the demo: the demo's 8192-token vocabulary, heads wider than d_model /
    # n_heads as the small releases'.
    "qwen3-tiny": (
        Qwen3Config,
        dict(
            d_model=256,
            n_heads=4,
            n_kv_heads=2,
            head_dim=128,
            n_layers=4,
            ffn_hidden_size=768,
            vocab_size=8192,
            max_seq_len=256,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-0.6B: 596,049,920 parameters (output head tied).
    "qwen3-0.6b": (
        Qwen3Config,
        dict(
            _QWEN3,
            d_model=1024,
            n_heads=16,
            n_layers=28,
            ffn_hidden_size=3072,
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    # Qwen3-1.7B: 1,720,574,976 parameters (tied).
    "qwen3-1.7b": (
        Qwen3Config,
        dict(
            _QWEN3,
            d_model=2048,
            n_heads=16,
            n_layers=28,
            ffn_hidden_size=6144,
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    # Qwen3-4B: 4,022,468,096 parameters (tied).
    "qwen3-4b": (
        Qwen3Config,
        dict(
            _QWEN3,
            d_model=2560,
            n_heads=32,
            n_layers=36,
            ffn_hidden_size=9728,
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    # Qwen3-8B: 8,190,735,360 parameters.
    "qwen3-8b": (
        Qwen3Config,
        dict(_QWEN3, d_model=4096, n_heads=32, n_layers=36, ffn_hidden_size=12288),
    ),
    # Qwen2.5-0.5B: 494,032,768 parameters (tied).
    "qwen2.5-0.5b": (
        Qwen2Config,
        dict(
            _QWEN2_5,
            d_model=896,
            n_heads=14,
            n_kv_heads=2,
            n_layers=24,
            ffn_hidden_size=4864,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),  # fmt: skip
    # Qwen2.5-7B: 7,615,616,512 parameters.
    "qwen2.5-7b": (
        Qwen2Config,
        dict(
            _QWEN2_5,
            d_model=3584,
            n_heads=28,
            n_kv_heads=4,
            n_layers=28,
            ffn_hidden_size=18944,
            vocab_size=152064,
        ),
    ),  # fmt: skip
}
