"""Checks a family config runs on its fields when it is built, each a one-line `UserError` that
names the field as the config class spells it (`owner.name`) and what is allowed.

A config is typed by the user (YAML, command-line overrides) or read from a checkpoint or a
transformers folder, so a wrong value is caught here, before any weight is allocated; a
dataclass annotation alone checks nothing.
"""

from __future__ import annotations

from typing import Any

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


def rope_head_dim(owner: str, head_dim: int) -> None:
    if head_dim % 2:
        raise UserError(
            f"{owner} head dimension {head_dim} must be even: RoPE rotates pairs of dimensions"
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
