"""LlamaConfig: the shape and options of a Llama 3 style decoder, validated when it is built.

Every mistake a user can type is caught here, before any weight is allocated, with a message
that names the field and what is allowed (the checks the RoPE decoders share are
`llmfoundry.models.decoder_config`'s). The published shapes (Llama 3.2 1B,
Llama 3.1 8B and 70B) and a tiny one for tests are named presets (`LlamaConfig.preset`), not
and conf/model/llama-tiny.yaml, llama3-{1b,8b,70b}.yaml (on conf/model_base/llama.yaml) give the
same shapes to `model=`; `llmfoundry.models.llama.spec` is the family's spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from llmfoundry.models import decoder_config as check
from llmfoundry.models.layers.decoder import DecoderSpec
from llmfoundry.models.layers.position import RopeScaling
from llmfoundry.utils.errors import UserError

OWNER = "LlamaConfig"


def _rope_scaling(value: Any) -> RopeScaling | None:
    """`LlamaConfig.rope_scaling` from YAML (a mapping) or code (a RopeScaling); None when off."""
    if value is None or isinstance(value, RopeScaling):
        return value
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    allowed = [f.name for f in fields(RopeScaling)]
    if not isinstance(value, Mapping) or set(value) - set(allowed) or "factor" not in value:
        raise UserError(
            f"LlamaConfig.rope_scaling must be null or a mapping with factor and optionally "
            f"{allowed[1:]}, got {value!r}"
        )
    return RopeScaling(**value)


def ffn_hidden_size(d_model: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """The SwiGLU hidden width by Meta's Llama rule: 2/3 of 4 * d_model (so the three matrices
    cost what a 4x GELU MLP's two do), times `ffn_dim_multiplier`, rounded up to `multiple_of`.

    Llama 3 8B: d_model 4096, multiplier 1.3, multiple_of 1024 -> 14336.
    """
    hidden = int(2 * (4 * d_model) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * -(-hidden // multiple_of)


@dataclass
class LlamaConfig:
    """Hyperparameters of a Llama causal language model (Llama 2 and 3 are this architecture).

    Blocks are pre-RMSNorm (`rms_norm_eps`), with rotary position embeddings (`rope_theta`, and
    Llama 3.1's `rope_scaling` if set) on queries and keys, grouped-query attention (`n_kv_heads`
    key/value heads, each shared by n_heads // n_kv_heads query heads; unset: one per query head)
    and a SwiGLU MLP of width `ffn_hidden_size` (unset: Meta's rule from `multiple_of` and
    `ffn_dim_multiplier`, see `ffn_hidden_size`). `tie_word_embeddings` makes the output head the
    token embedding (Llama 3.2 1B/3B); otherwise it is its own matrix. `attn_impl` picks one of
    the shared kernels (`llmfoundry.models.layers.kernels`); all of them do document masking.

    `max_seq_len` is the context the model is meant for (transformers' max_position_embeddings);
    RoPE has no position table, so nothing is sized by it.

    Initialisation: every matrix and the embedding from N(0, init_std), the projections that write
    into the residual stream (attention out_proj, MLP down_proj) divided by sqrt(2 * n_layers),
    norms at 1. `init_device="meta"` builds without memory (then `to_empty` and `init_weights`).
    """

    d_model: int
    n_heads: int
    n_layers: int
    n_kv_heads: int | None = None
    ffn_hidden_size: int | None = None
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    vocab_size: int = 128256
    max_seq_len: int = 8192
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attn_impl: str = "sdpa"
    init_std: float = 0.02
    init_device: str = "cpu"

    def __post_init__(self) -> None:
        check.check_rope_decoder(self)
        check.positive_int(OWNER, "multiple_of", self.multiple_of)
        check.heads_divide_width(OWNER, self.d_model, self.n_heads)
        check.rope_head_dim(OWNER, self.head_dim, "d_model / n_heads")
        if self.ffn_dim_multiplier is not None and not self.ffn_dim_multiplier > 0:
            raise UserError(
                f"LlamaConfig.ffn_dim_multiplier must be null or > 0, got {self.ffn_dim_multiplier!r}"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = ffn_hidden_size(
                self.d_model, self.multiple_of, self.ffn_dim_multiplier
            )
        check.positive_int(OWNER, "ffn_hidden_size", self.ffn_hidden_size)
        self.rope_scaling = _rope_scaling(self.rope_scaling)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def decoder_spec(self) -> DecoderSpec:
        """The shared decoder this config describes (llmfoundry/models/layers/decoder.py)."""
        return check.rope_decoder_spec(
            self,
            self.head_dim,
            rope_scaling=self.rope_scaling,
            ffn="glu",
            ffn_hidden=self.ffn_hidden_size,
            ffn_act="silu",
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LlamaConfig:
        """The published shape `name` (see `PRESETS`), with any field overridden."""
        return cls(**{**check.preset_fields("Llama", PRESETS, name), **overrides})


_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, n_kv_heads=8)

# Meta's published configurations (params.json of the released checkpoints).
PRESETS: dict[str, dict[str, Any]] = {
    # For tests and the demo: 7.3M parameters, the demo's 8192-token vocabulary.
    "llama-tiny": dict(
        d_model=256,
        n_heads=4,
        n_kv_heads=2,
        n_layers=4,
        vocab_size=8192,
        max_seq_len=256,
        rope_theta=10000.0,
    ),
    # Llama 3.2 1B: 1,235,814,400 parameters (output head tied).
    "llama3-1b": dict(
        _LLAMA3,
        d_model=2048,
        n_heads=32,
        n_layers=16,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        max_seq_len=131072,
        rope_scaling=RopeScaling(factor=32.0),
        tie_word_embeddings=True,
    ),
    # Llama 3.1 8B: 8,030,261,248 parameters.
    "llama3-8b": dict(
        _LLAMA3,
        d_model=4096,
        n_heads=32,
        n_layers=32,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        max_seq_len=131072,
        rope_scaling=RopeScaling(factor=8.0),
    ),
    # Llama 3.1 70B: 70,553,706,496 parameters.
    "llama3-70b": dict(
        _LLAMA3,
        d_model=8192,
        n_heads=64,
        n_layers=80,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        max_seq_len=131072,
        rope_scaling=RopeScaling(factor=8.0),
    ),
}
