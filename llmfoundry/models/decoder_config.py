"""What the configs of the RoPE decoders with separate q/k/v (Llama, Qwen2, Qwen3, Qwen3-MoE,
Mixtral) share: the checks each runs on its fields when it is built, and the `DecoderSpec` they
all describe (`rope_decoder_spec`), so a family config states only what is its own.

A config is typed by the user (YAML, command-line overrides) or read from a checkpoint or a
transformers folder, so a wrong value is caught here, before any weight is allocated; a
dataclass annotation alone checks nothing. Each check is a one-line `UserError` that names the
field as the user's config class spells it (`owner.name`) and what is allowed. MPT keeps its
own checks (mpt/config.py): its fields (ALiBi, fused qkv, MPT's names) are not these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmfoundry.models.layers.decoder import DecoderSpec
from llmfoundry.models.layers.kernels import check_attn_impl
from llmfoundry.models.layers.moe import MoESpec
from llmfoundry.utils.errors import UserError

INIT_DEVICES = ("cpu", "meta")


def positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UserError(f"{owner}.{name} must be a positive integer, got {value!r}")


def positive_number(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise UserError(f"{owner}.{name} must be > 0, got {value!r}")


def non_negative_number(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise UserError(f"{owner}.{name} must be >= 0 (0: off), got {value!r}")


def boolean(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise UserError(f"{owner}.{name} must be true or false, got {value!r}")


def kv_heads(owner: str, n_heads: int, n_kv_heads: Any) -> None:
    """`n_kv_heads` groups the query heads: a positive divisor of `n_heads`."""
    if (
        isinstance(n_kv_heads, bool)
        or not isinstance(n_kv_heads, int)
        or n_kv_heads <= 0
        or n_heads % n_kv_heads != 0
    ):
        raise UserError(
            f"{owner}.n_kv_heads must be a positive divisor of n_heads ({n_heads}), "
            f"got {n_kv_heads!r}; null means one key/value head per query head"
        )


def heads_divide_width(owner: str, d_model: int, n_heads: int) -> None:
    """Heads d_model / n_heads wide (Llama, Qwen2, Mixtral) need n_heads to divide d_model."""
    if d_model % n_heads != 0:
        raise UserError(
            f"{owner}.d_model ({d_model}) must be divisible by {owner}.n_heads ({n_heads}); "
            "pick n_heads among the divisors of d_model"
        )


def rope_head_dim(owner: str, head_dim: int, what: str) -> None:
    """RoPE rotates pairs of dimensions: `head_dim` (spelled `what`, e.g. "head_dim" or
    "d_model / n_heads") must be even."""
    if head_dim % 2:
        raise UserError(
            f"{owner} head dimension {what} = {head_dim} must be even: RoPE rotates pairs of "
            "dimensions"
        )


def init_device(owner: str, value: Any) -> None:
    if value not in INIT_DEVICES:
        raise UserError(
            f"{owner}.init_device must be one of {', '.join(map(repr, INIT_DEVICES))}, "
            f"got {value!r}; to place the model on an accelerator build it on 'meta', then "
            "call to_empty(device=...) and init_weights()"
        )


def top_k_experts(owner: str, top_k: Any, n_experts: int) -> None:
    """Each token goes to `top_k` of the `n_experts` experts: 1 <= top_k <= n_experts."""
    positive_int(owner, "top_k", top_k)
    if top_k > n_experts:
        raise UserError(
            f"{owner}.top_k ({top_k}) must be at most n_experts ({n_experts}): a token goes "
            "to top_k different experts"
        )


def preset_fields(family: str, presets: Mapping[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """The fields of `family`'s published shape `name` in `presets`; a UserError listing them
    for a name it has not."""
    if name not in presets:
        raise UserError(f"no {family} preset {name!r}; presets: {', '.join(sorted(presets))}")
    return presets[name]


def check_rope_decoder(config: Any) -> None:
    """The checks of the fields every RoPE decoder config has (d_model, n_heads, n_layers,
    n_kv_heads, vocab_size, max_seq_len, rope_theta, rms_norm_eps, tie_word_embeddings,
    attn_impl, init_std, init_device); a null `n_kv_heads` becomes n_heads (one key/value head
    per query head). The head width is the family's own (stated or d_model / n_heads)."""
    owner = type(config).__name__
    for name in ("d_model", "n_heads", "n_layers", "vocab_size", "max_seq_len"):
        positive_int(owner, name, getattr(config, name))
    if config.n_kv_heads is None:
        config.n_kv_heads = config.n_heads
    kv_heads(owner, config.n_heads, config.n_kv_heads)
    for name in ("rope_theta", "rms_norm_eps", "init_std"):
        positive_number(owner, name, getattr(config, name))
    boolean(owner, "tie_word_embeddings", config.tie_word_embeddings)
    check_attn_impl(config.attn_impl, owner)
    init_device(owner, config.init_device)


def check_moe(config: Any) -> None:
    """The checks of the mixture-of-experts fields (n_experts, top_k, expert_hidden,
    aux_loss_weight, z_loss_weight) of an MoE family config."""
    owner = type(config).__name__
    positive_int(owner, "n_experts", config.n_experts)
    positive_int(owner, "expert_hidden", config.expert_hidden)
    top_k_experts(owner, config.top_k, config.n_experts)
    for name in ("aux_loss_weight", "z_loss_weight"):
        non_negative_number(owner, name, getattr(config, name))


def rope_decoder_spec(config: Any, head_dim: int, **own: Any) -> DecoderSpec:
    """The shared decoder of a RoPE decoder config: pre-RMSNorm blocks (eps rms_norm_eps),
    RoPE (rope_theta), grouped-query attention of `head_dim`-wide heads, no biases, and `own`:
    the family's own choices (the feed-forward, q/k norms, biases, RoPE scaling, a window)."""
    return DecoderSpec(
        d_model=config.d_model,
        n_layers=config.n_layers,
        vocab_size=config.vocab_size,
        max_seq_len=config.max_seq_len,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim=head_dim,
        positions="rope",
        rope_theta=config.rope_theta,
        norm="rmsnorm",
        norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
        attn_impl=config.attn_impl,
        init_std=config.init_std,
        **own,
    )


def moe_spec(config: Any, renormalize: bool) -> MoESpec:
    """The MoE feed-forward of an MoE family config's fields, the top-k weights renormalised
    to sum 1 when `renormalize`."""
    return MoESpec(
        n_experts=config.n_experts,
        top_k=config.top_k,
        expert_hidden=config.expert_hidden,
        renormalize=renormalize,
        aux_loss_weight=config.aux_loss_weight,
        z_loss_weight=config.z_loss_weight,
    )
