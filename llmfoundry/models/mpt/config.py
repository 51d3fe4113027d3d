"""MPTConfig: the shape and options of an MPT decoder, validated when it is built.

Hydra builds it from `conf/model/*.yaml` (`_target_: llmfoundry.models.mpt.MPTConfig`), so every
mistake a user can type on the command line is caught here, before any weight is allocated, with a
message that names the field and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from llmfoundry.utils.errors import UserError

if TYPE_CHECKING:
    from llmfoundry.models.layers.decoder import DecoderSpec

INIT_DEVICES = ("cpu", "meta")
SIZE_FIELDS = ("d_model", "n_heads", "n_layers", "expansion_ratio", "max_seq_len", "vocab_size")
INFINI_UPDATES = ("linear", "delta")
NORM_TYPES = ("layernorm", "rmsnorm")
FFN_TYPES = ("mlp", "glu")
FFN_ACTS = ("gelu", "gelu_tanh", "silu", "relu")  # models/layers/ffn.py's ACTIVATIONS


@dataclass
class InfiniConfig:
    """Infini-attention (Munkhdalai et al. 2024): local attention per segment plus a memory.

    Each sequence is cut into segments of `segment_len` tokens. Inside a segment, attention is
    the ordinary causal kernel (`attn_impl`, with ALiBi); across segments, each head reads a
    compressive memory of the earlier segments' keys and values, and a learned per-head gate
    mixes the two. `update` picks the memory rule ("linear" adds sigma(K)^T V; "delta" adds only
    what the memory does not already retrieve). `gate_init` is the gate's logit at init (0: half
    memory, half local). `gate_lr` is the gate's own learning rate (null: the optimizer's); the
    gate never gets weight decay. `truncate_every` detaches the memory every that many segments
    (null: the gradient flows through the memory across the whole sequence). `eps` keeps the
    memory's normaliser away from 0.
    """

    segment_len: int
    update: str = "linear"
    gate_init: float = 0.0
    gate_lr: float | None = None
    truncate_every: int | None = None
    eps: float = 1e-6

    def __post_init__(self) -> None:
        counts = {"segment_len": self.segment_len}
        if self.truncate_every is not None:
            counts["truncate_every"] = self.truncate_every
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(
                    f"MPTConfig.infini.{name} must be a positive integer, got {value!r}"
                )
        if self.update not in INFINI_UPDATES:
            raise UserError(
                f"MPTConfig.infini.update must be one of {', '.join(map(repr, INFINI_UPDATES))}, "
                f"got {self.update!r}"
            )
        if self.gate_lr is not None and not self.gate_lr > 0:
            raise UserError(f"MPTConfig.infini.gate_lr must be null or > 0, got {self.gate_lr!r}")
        if not self.eps > 0:
            raise UserError(f"MPTConfig.infini.eps must be > 0, got {self.eps!r}")


def _infini_config(value: Any) -> InfiniConfig | None:
    """`MPTConfig.infini` from YAML (a mapping) or code (an InfiniConfig); None when off."""
    if value is None or isinstance(value, InfiniConfig):
        return value
    if isinstance(value, DictConfig):
        value = OmegaConf.to_container(value, resolve=True)
    if not isinstance(value, Mapping):
        raise UserError(
            f"MPTConfig.infini must be null or a mapping of infini-attention options, got {value!r}"
        )
    allowed = [f.name for f in fields(InfiniConfig)]
    unknown = sorted(set(value) - set(allowed))
    if unknown or "segment_len" not in value:
        raise UserError(
            f"MPTConfig.infini: unknown key(s) {unknown} or missing segment_len; allowed: {allowed}"
        )
    return InfiniConfig(**value)


@dataclass
class MPTConfig:
    """Hyperparameters of an MPT causal language model.

    Position information comes from ALiBi (`alibi=True`, as the released MPT-7B and MPT-30B),
    from a learned table (`learned_pos_emb=True`, the pretraining recipes' default) or from
    rotary embeddings (`rope=True`: Llama's rotate-half RoPE at `rope_theta`, frequencies divided
    by `rope_linear_scaling` if set). Leaving `learned_pos_emb` unset picks it exactly when
    neither of the others is on, so `alibi=false` alone switches a model to learned positions.

    Layers: `norm_type` layernorm or rmsnorm (`low_precision_layernorm` runs either in the
    autocast dtype); `ffn_type` mlp (down(act(up(x)))) or glu (down(act(gate(x)) * up(x))), with
    `ffn_act` gelu (exact), gelu_tanh, silu or relu; `tie_word_embeddings=false` gives the output
    head its own weight (`lm_head`) instead of the token embedding's.

    Attention: `kv_n_heads` < `n_heads` shares each key/value head among n_heads // kv_n_heads
    query heads (grouped-query attention; 1 is multi-query; unset: one per query head).
    `softmax_scale` multiplies q k^T (unset: 1 / sqrt(head_dim)). `qk_ln` normalises queries and
    keys before they are split into heads; `clip_qkv` clamps the fused q/k/v projection.
    `sliding_window` lets each token attend to itself and the window - 1 tokens before it.
    `infini` (an `InfiniConfig`, or its fields as a mapping) makes every block's attention
    infini-attention; `conf/model/infini/*.yaml` select it (`+model/infini=linear`).
    `compile=true` compiles each block with torch.compile (the parameters keep their names);
    the strategy does, when it prepares the model (its plan: `models/mpt/parallelize.py`).

    Initialisation: with `init_std` unset, every matrix and embedding is drawn with
    `kaiming_normal_(fan_in, relu)` (MPT's default); with `init_std` set, from N(0, init_std).
    Either way the projections that write into the residual stream (attention `out_proj`, MLP
    `down_proj`) are divided by sqrt(2 * n_layers) so the residual variance does not grow with
    depth. `init_device="meta"` builds the model without memory; call `to_empty(device=...)` and
    then `init_weights()` to materialise it.
    """

    d_model: int
    n_heads: int
    n_layers: int
    kv_n_heads: int | None = None
    expansion_ratio: int = 4
    max_seq_len: int = 2048
    vocab_size: int = 50368
    attn_impl: str = "sdpa"
    alibi: bool = True
    alibi_bias_max: float = 8
    learned_pos_emb: bool | None = None
    no_bias: bool = True
    low_precision_layernorm: bool = False
    norm_type: str = "layernorm"
    ffn_type: str = "mlp"
    ffn_act: str = "gelu"
    tie_word_embeddings: bool = True
    rope: bool = False
    rope_theta: float = 10000.0
    rope_linear_scaling: float | None = None
    qk_ln: bool = False
    clip_qkv: float | None = None
    softmax_scale: float | None = None
    sliding_window: int | None = None
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    emb_pdrop: float = 0.0
    init_std: float | None = None
    init_device: str = "cpu"
    infini: InfiniConfig | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"MPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise UserError(
                f"MPTConfig.d_model ({self.d_model}) must be divisible by MPTConfig.n_heads "
                f"({self.n_heads}); pick n_heads among the divisors of d_model"
            )
        if self.kv_n_heads is None:
            self.kv_n_heads = self.n_heads
        if (
            isinstance(self.kv_n_heads, bool)
            or not isinstance(self.kv_n_heads, int)
            or self.kv_n_heads <= 0
            or self.n_heads % self.kv_n_heads != 0
        ):
            raise UserError(
                f"MPTConfig.kv_n_heads must be a positive divisor of n_heads ({self.n_heads}), "
                f"got {self.kv_n_heads!r}; null means one key/value head per query head"
            )
        if self.softmax_scale is not None and not self.softmax_scale > 0:
            raise UserError(
                f"MPTConfig.softmax_scale must be null (1/sqrt(head_dim)) or > 0, "
                f"got {self.softmax_scale!r}"
            )
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window <= 0
        ):
            raise UserError(
                f"MPTConfig.sliding_window must be null (full causal attention) or a positive "
                f"integer, got {self.sliding_window!r}"
            )
        # The kernels load torch: imported here, so the config check reads the fields without it.
        from llmfoundry.models.layers.kernels import check_attn_impl

        check_attn_impl(self.attn_impl, "MPTConfig", self.attn_pdrop)
        self._check_positions()
        self._check_layers()
        if not self.alibi_bias_max > 0:
            raise UserError(f"MPTConfig.alibi_bias_max must be > 0, got {self.alibi_bias_max!r}")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise UserError(f"MPTConfig.clip_qkv must be null or > 0, got {self.clip_qkv!r}")
        if self.init_std is not None and not self.init_std > 0:
            raise UserError(
                f"MPTConfig.init_std must be null (kaiming-normal init) or > 0, got {self.init_std!r}"
            )
        for name in ("attn_pdrop", "resid_pdrop", "emb_pdrop"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise UserError(f"MPTConfig.{name} must be in [0, 1), got {value!r}")
        if self.init_device not in INIT_DEVICES:
            raise UserError(
                f"MPTConfig.init_device must be one of {', '.join(map(repr, INIT_DEVICES))}, "
                f"got {self.init_device!r}; to place the model on an accelerator build it on "
                "'meta', then call to_empty(device=...) and init_weights()"
            )
        self.infini = _infini_config(self.infini)
        if self.infini is not None and self.rope:
            raise UserError(
                "MPTConfig.infini with rope=true is not supported (its memory keeps unrotated "
                "keys); use alibi=true with infini"
            )
        if not isinstance(self.compile, bool):
            raise UserError(f"MPTConfig.compile must be true or false, got {self.compile!r}")

    def decoder_spec(self) -> DecoderSpec:
        """The shared decoder this config describes (llmfoundry/models/layers/decoder.py):
        fused [q | k | v], biases everywhere unless `no_bias`, q/k LayerNorms over the full
        width, LayerNorm eps 1e-5, and a causal bias cache of max_seq_len positions."""
        # The decoder loads torch: imported here, so the config check reads fields without it.
        from llmfoundry.models.layers.decoder import DecoderSpec
        from llmfoundry.models.layers.position import LinearRopeScaling

        bias = not self.no_bias
        positions = "alibi" if self.alibi else "rope" if self.rope else "learned"
        scaling = self.rope_linear_scaling
        return DecoderSpec(
            d_model=self.d_model,
            n_layers=self.n_layers,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            n_heads=self.n_heads,
            n_kv_heads=self.kv_n_heads,
            head_dim=self.d_model // self.n_heads,
            qkv_fused=True,
            qkv_bias=bias,
            out_bias=bias,
            qk_norm="full" if self.qk_ln else None,
            clip_qkv=self.clip_qkv,
            softmax_scale=self.softmax_scale,
            positions=positions,
            rope_theta=self.rope_theta,
            rope_scaling=None if scaling is None else LinearRopeScaling(scaling),
            alibi_bias_max=self.alibi_bias_max,
            sliding_window=self.sliding_window,
            norm=self.norm_type,
            norm_bias=bias,
            low_precision_norm=self.low_precision_layernorm,
            ffn=self.ffn_type,
            ffn_hidden=self.expansion_ratio * self.d_model,
            ffn_act=self.ffn_act,
            ffn_bias=bias,
            tie_word_embeddings=self.tie_word_embeddings,
            emb_pdrop=self.emb_pdrop,
            resid_pdrop=self.resid_pdrop,
            attn_pdrop=self.attn_pdrop,
            attn_impl=self.attn_impl,
            init_std=self.init_std,
            mask_cache_len=self.max_seq_len,
        )

    def _check_positions(self) -> None:
        """Exactly one source of positions: alibi, learned_pos_emb or rope."""
        if self.learned_pos_emb is None:
            self.learned_pos_emb = not self.alibi and not self.rope
        sources = {"alibi": self.alibi, "learned_pos_emb": self.learned_pos_emb, "rope": self.rope}
        on = [name for name, value in sources.items() if value]
        if not on:
            raise UserError(
                "MPTConfig.alibi, learned_pos_emb and rope are all false, so the model would get "
                "no position information; set one of them to true"
            )
        if len(on) > 1:
            raise UserError(
                f"MPTConfig.{' and MPTConfig.'.join(on)} are all true; use one source of position "
                "information (alibi, learned_pos_emb or rope)"
            )
        if not self.rope_theta > 0:
            raise UserError(f"MPTConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.rope_linear_scaling is not None and not self.rope_linear_scaling > 0:
            raise UserError(
                f"MPTConfig.rope_linear_scaling must be null (none) or > 0, "
                f"got {self.rope_linear_scaling!r}"
            )

    def _check_layers(self) -> None:
        """norm_type, ffn_type, ffn_act and tie_word_embeddings among what the model builds."""
        for name, allowed in (
            ("norm_type", NORM_TYPES),
            ("ffn_type", FFN_TYPES),
            ("ffn_act", FFN_ACTS),
        ):
            if getattr(self, name) not in allowed:
                raise UserError(
                    f"MPTConfig.{name} must be one of {', '.join(map(repr, allowed))}, "
                    f"got {getattr(self, name)!r}"
                )
        if not isinstance(self.tie_word_embeddings, bool):
            raise UserError(
                f"MPTConfig.tie_word_embeddings must be true or false, "
                f"got {self.tie_word_embeddings!r}"
            )
