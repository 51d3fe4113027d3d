"""The attention kernels by name (`MPTConfig.attn_impl`), and the check that names them.

Every entry has the signature of `attention.AttnFn`; see `attention.py` for the contract.
"""

from __future__ import annotations

from llmfoundry.models.mpt.attention import AttnFn, sdpa_attention, torch_attention

ATTN_IMPLS: dict[str, AttnFn] = {"torch": torch_attention, "sdpa": sdpa_attention}


def check_attn_impl(name: str) -> None:
    """Raise a ValueError that says what to do if `name` is not a usable attention kernel."""
    if name not in ATTN_IMPLS:
        allowed = ", ".join(repr(n) for n in ATTN_IMPLS)
        raise ValueError(f"MPTConfig.attn_impl={name!r} is not known; allowed: {allowed}")
