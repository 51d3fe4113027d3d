"""Qwen3MoeConfig: the shape and options of a Qwen3-MoE mixture-of-experts decoder, validated
when it is built.

Qwen3-MoE is Qwen3's decoder (RMSNorm, RoPE, grouped-query attention with an RMSNorm over each
query and key head, no biases, a head width of its own) with the MLP of every block replaced by
`n_experts` small SwiGLU experts of which a router picks `top_k` per token. The published shape
(Qwen3-30B-A3B) and a tiny one for tests are named presets (`Qwen3MoeConfig.preset`);
conf/model/qwen3-moe-tiny.yaml and qwen3-30b-a3b.yaml (on conf/model_base/qwen3_moe.yaml) give
the same shapes to `model=`. `decoder_spec()` is what the shared decoder builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmfoundry.models import decoder_config as check
from llmfoundry.models.layers.decoder import DecoderSpec
from llmfoundry.utils.errors import UserError

OWNER = "Qwen3MoeConfig"


@dataclass
class Qwen3MoeConfig:
    """Hyperparameters of a Qwen3-MoE causal language model.

    Blocks are pre-RMSNorm (`rms_norm_eps`, also the eps of the per-head q/k norms), with rotary
    position embeddings (`rope_theta`) and grouped-query attention (`n_kv_heads` key/value
    heads; unset: one per query head) of `n_heads` heads of width `head_dim` (unset: d_model /
    n_heads; Qwen3-30B-A3B's is 128 where d_model / n_heads is 64). The feed-forward of every
    block is a mixture of `n_experts` SwiGLU experts of width `expert_hidden` (transformers'
    moe_intermediate_size): a linear router scores the experts, each token goes to the `top_k`
    best, weighted by their softmax probabilities, renormalised over those top_k when
    `norm_topk_prob` (Qwen3-30B-A3B: true). No token is dropped (no capacity limit).

    `aux_loss_weight` (transformers' router_aux_loss_coef, 0.001 in Qwen's release) weighs the
    load-balancing loss the model's `loss` adds to the cross entropy; `z_loss_weight` the
    router z-loss (ST-MoE; Qwen3-MoE has none: 0). Both are logged as metrics in training.

    `max_seq_len` is the context the model is meant for (transformers' max_position_embeddings);
    nothing is sized by it. Initialisation: N(0, init_std), the projections into the residual
    stream divided by sqrt(2 * n_layers), norms 1; `init_device="meta"` builds without memory.
    """

    d_model: int
    n_heads: int
    n_layers: int
    n_kv_heads: int | None = None
    head_dim: int | None = None
    n_experts: int = 128
    top_k: int = 8
    expert_hidden: int = 768
    norm_topk_prob: bool = True
    vocab_size: int = 151936
    max_seq_len: int = 40960
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    aux_loss_weight: float = 0.001
    z_loss_weight: float = 0.0
    attn_impl: str = "sdpa"
    init_std: float = 0.02
    init_device: str = "cpu"

    def __post_init__(self) -> None:
        check.positive_int(OWNER, "n_heads", self.n_heads)
        if self.head_dim is None:
            check.positive_int(OWNER, "d_model", self.d_model)
            if self.d_model % self.n_heads != 0:
                raise UserError(
                    f"{OWNER}.d_model ({self.d_model}) is not divisible by n_heads "
                    f"({self.n_heads}): set head_dim, or pick n_heads among its divisors"
                )
            self.head_dim = self.d_model // self.n_heads
        check.check_rope_decoder(self)
        check.positive_int(OWNER, "head_dim", self.head_dim)
        check.rope_head_dim(OWNER, self.head_dim, "head_dim")
        check.check_moe(self)
        check.boolean(OWNER, "norm_topk_prob", self.norm_topk_prob)

    def decoder_spec(self) -> DecoderSpec:
        """Qwen3's decoder (per-head q/k RMSNorm) with an MoE feed-forward in every block."""
        moe = check.moe_spec(self, renormalize=self.norm_topk_prob)
        return check.rope_decoder_spec(self, self.head_dim, qk_norm="head", ffn="moe", moe=moe)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Qwen3MoeConfig:
        """The published shape `name` (see `PRESETS`), with any field overridden."""
        return cls(**{**check.preset_fields("Qwen3-MoE", PRESETS, name), **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # For tests and the demo: llama-tiny's attention (plus q/k norms) and, per token, its FFN
    # width (top 4 of 16 experts of 192 = llama-tiny's 768); the demo's 8192-token vocabulary.
    "qwen3-moe-tiny": dict(
        d_model=256,
        n_heads=4,
        n_kv_heads=2,
        n_layers=4,
        n_experts=16,
        top_k=4,
        expert_hidden=192,
        vocab_size=8192,
        max_seq_len=256,
        rope_theta=10000.0,
    ),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 30,532,122,624 parameters, 3,353,032,704
    # of them active per token.
    "qwen3-30b-a3b": dict(
        d_model=2048,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        n_layers=48,
        n_experts=128,
        top_k=8,
        expert_hidden=768,
        norm_topk_prob=True,
        vocab_size=151936,
        max_seq_len=40960,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        aux_loss_weight=0.001,
    ),
}
