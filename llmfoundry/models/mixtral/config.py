"""MixtralConfig: the shape and options of a Mixtral mixture-of-experts decoder, validated when
it is built.

Mixtral is Llama's decoder (RMSNorm, RoPE, grouped-query attention, no biases) with the SwiGLU
MLP of every block replaced by `n_experts` SwiGLU experts of which a router picks `top_k` per
token, their softmax weights renormalised to sum 1. The published shape (Mixtral-8x7B) and a
tiny one for tests are named presets (`MixtralConfig.preset`); conf/model/mixtral-tiny.yaml and
mixtral-8x7b.yaml (on conf/model_base/mixtral.yaml) give the same shapes to `model=`.
`decoder_spec()` is what the shared decoder (`llmfoundry.models.layers.decoder`) builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmfoundry.models import decoder_config as check
from llmfoundry.models.layers.decoder import DecoderSpec

OWNER = "MixtralConfig"


@dataclass
class MixtralConfig:
    """Hyperparameters of a Mixtral causal language model.

    Blocks are pre-RMSNorm (`rms_norm_eps`), with rotary position embeddings (`rope_theta`) on
    queries and keys and grouped-query attention (`n_kv_heads` key/value heads; unset: one per
    query head). The feed-forward of every block is a mixture of `n_experts` SwiGLU experts of
    width `expert_hidden` (transformers' intermediate_size): a linear router (no bias) scores
    the experts, each token goes to the `top_k` best, weighted by their softmax probabilities
    renormalised over those top_k. No token is dropped (no capacity limit).

    `aux_loss_weight` (transformers' router_aux_loss_coef, 0.02 in Mixtral's release) weighs the
    load-balancing loss the model's `loss` adds to the cross entropy; `z_loss_weight` the
    router z-loss (ST-MoE; Mixtral has none: 0). Both are logged as metrics in training.

    `sliding_window` (Mistral's; null in Mixtral-8x7B's release): each token attends to itself
    and the sliding_window - 1 tokens before it; null: to every earlier token.

    `max_seq_len` is the context the model is meant for (transformers' max_position_embeddings);
    RoPE has no position table, so nothing is sized by it. Initialisation as Llama's: N(0,
    init_std), the projections into the residual stream divided by sqrt(2 * n_layers), norms 1.
    `init_device="meta"` builds without memory (then `to_empty` and `init_weights`).
    """

    d_model: int
    n_heads: int
    n_layers: int
    n_kv_heads: int | None = None
    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 14336
    vocab_size: int = 32000
    max_seq_len: int = 32768
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    aux_loss_weight: float = 0.02
    z_loss_weight: float = 0.0
    attn_impl: str = "sdpa"
    init_std: float = 0.02
    init_device: str = "cpu"

    def __post_init__(self) -> None:
        check.check_rope_decoder(self)
        check.heads_divide_width(OWNER, self.d_model, self.n_heads)
        check.rope_head_dim(OWNER, self.head_dim, "d_model / n_heads")
        check.check_moe(self)
        if self.sliding_window is not None:
            check.positive_int(OWNER, "sliding_window", self.sliding_window)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def decoder_spec(self) -> DecoderSpec:
        """Llama's decoder with an MoE feed-forward in every block."""
        moe = check.moe_spec(self, renormalize=True)
        return check.rope_decoder_spec(
            self, self.head_dim, sliding_window=self.sliding_window, ffn="moe", moe=moe
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> MixtralConfig:
        """The published shape `name` (see `PRESETS`), with any field overridden."""
        return cls(**{**check.preset_fields("Mixtral", PRESETS, name), **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # For tests and the demo: llama-tiny's attention and, per token, its FFN width (top 2 of 8
    # experts of 384 = llama-tiny's 768); the demo's 8192-token vocabulary.
    "mixtral-tiny": dict(
        d_model=256,
        n_heads=4,
        n_kv_heads=2,
        n_layers=4,
        n_experts=8,
        top_k=2,
        expert_hidden=384,
        vocab_size=8192,
        max_seq_len=256,
        rope_theta=10000.0,
    ),
    # Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json): 46,702,792,704 parameters,
    # 12,879,925,248 of them active per token.
    "mixtral-8x7b": dict(
        d_model=4096,
        n_heads=32,
        n_kv_heads=8,
        n_layers=32,
        n_experts=8,
        top_k=2,
        expert_hidden=14336,
        vocab_size=32000,
        max_seq_len=32768,
        rope_theta=1e6,
        rms_norm_eps=1e-5,
        aux_loss_weight=0.02,
    ),
}
