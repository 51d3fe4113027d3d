"""attn_impl=flex: PyTorch's FlexAttention, compiled, with ALiBi as a score_mod.

The mask description becomes a `BlockMask` (causal, sliding window, and per-document when
`sequence_id` is given), whose empty blocks the kernel skips, so packed documents cost only
their own attention. The causal/window BlockMask and the ALiBi score_mod do not depend on the
batch and are kept across forwards by the model's `AttentionMasks`; a per-document BlockMask is
built once per forward and shared by every layer.

PyTorch has no CPU backward for FlexAttention: on CPU it runs inference only (training there
raises an error that says to use sdpa, which takes the same weights).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from llmfoundry.models.mpt.attention import AttentionMask


@functools.cache
def _compiled() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask(mask: AttentionMask, batch: int, q_len: int, k_len: int, device: torch.device):
    """The BlockMask of `mask` for queries at the last `q_len` of `k_len` key positions."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset, window, sid = k_len - q_len, mask.source.window, mask.sequence_id

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset
        keep = q_pos >= kv_idx
        if window is not None:
            keep = keep & (q_pos - kv_idx < window)
        if sid is not None:
            keep = keep & (sid[b, q_pos] == sid[b, kv_idx])
        return keep

    rows = batch if sid is not None else None
    return create_block_mask(mask_mod, rows, None, q_len, k_len, device=device)


def alibi_score_mod(slopes: torch.Tensor, offset: int) -> Callable:
    """score - slope_h * (i - j), the relative ALiBi bias, for queries offset by `offset`."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx + offset - kv_idx)

    return score_mod


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """The `AttnFn` for attn_impl=flex (see attention.py for the contract)."""
    if dropout_p > 0:
        raise ValueError("attn_impl='flex' has no attention dropout; set model.attn_pdrop=0")
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise RuntimeError(
            "attn_impl='flex' cannot train on CPU: PyTorch has no CPU backward for "
            "FlexAttention. Train on a GPU, or use attn_impl=sdpa on CPU (same weights); flex "
            "runs CPU inference under torch.no_grad()"
        )
    batch, q_len, k_len, device = q.shape[0], q.shape[-2], k.shape[-2], q.device
    key = ("flex", q_len, k_len, device)
    if mask.sequence_id is None:
        blocks = mask.source.shared_cached(
            key, lambda: block_mask(mask, batch, q_len, k_len, device)
        )
    else:
        blocks = mask.cached(key, lambda: block_mask(mask, batch, q_len, k_len, device))
    score_mod = None
    slopes = mask.alibi_slopes
    if slopes is not None:
        score_mod = mask.source.shared_cached(
            ("flex_alibi", k_len - q_len, device), lambda: alibi_score_mod(slopes, k_len - q_len)
        )
    return _compiled()(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=blocks,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
