"""attn_impl=flex: PyTorch's FlexAttention, compiled, with ALiBi as a score_mod.

The mask description becomes a `BlockMask` (causal, sliding window, and per-document when
`sequence_id` is given), whose empty blocks the kernel skips, so packed documents cost only
their own attention. The causal/window BlockMask and the ALiBi score_mod do not depend on the
batch and are kept across forwards by the model's `AttentionMasks`; a per-document BlockMask is
built once per forward and shared by every layer.

PyTorch has no CPU backward for FlexAttention: on CPU it runs inference only (training there
raises an error that says to use sdpa, which takes the same weights). On CPU, torch 2.13's
compiled kernel returns wrong values (garbage, sometimes NaN) for some batch rows when the
sequence length is not a multiple of its 128-token block on CPUs without AVX-512 (seen on an AVX2
EPYC; pure torch reproduces it), so there queries and keys are padded to whole blocks and the
padding is masked out and cut off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmfoundry.models.layers.attention import AttentionMask

# FlexAttention's default block size; on CPU, sequences are padded to a multiple of it.
_CPU_BLOCK = 128


@functools.cache
def _compiled() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_mask(
    mask: AttentionMask,
    batch: int,
    q_len: int,
    k_len: int,
    device: torch.device,
    padded: tuple[int, int] | None = None,
):
    """The BlockMask of `mask` for queries at the last `q_len` of `k_len` key positions, over
    `padded` (queries, keys) positions when given: padding keys are masked out, padding queries
    attend to nothing (their rows are cut off)."""
    from torch.nn.attention.flex_attention import create_block_mask

    offset, window, sid = k_len - q_len, mask.source.window, mask.sequence_id
    q_size, k_size = padded or (q_len, k_len)

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset
        keep = q_pos >= kv_idx
        if padded is not None:
            keep = keep & (q_pos < k_len)
        if window is not None:
            keep = keep & (q_pos - kv_idx < window)
        if sid is not None:
            last = k_len - 1
            keep = keep & (sid[b, q_pos.clamp(max=last)] == sid[b, kv_idx.clamp(max=last)])
        return keep

    rows = batch if sid is not None else None
    return create_block_mask(mask_mod, rows, None, q_size, k_size, device=device)


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
    padded = None
    if device.type == "cpu" and (q_len % _CPU_BLOCK or k_len % _CPU_BLOCK):
        padded = (-(-q_len // _CPU_BLOCK) * _CPU_BLOCK, -(-k_len // _CPU_BLOCK) * _CPU_BLOCK)
    key = ("flex", q_len, k_len, device)

    def build() -> object:
        return block_mask(mask, batch, q_len, k_len, device, padded)

    if mask.sequence_id is None:
        blocks = mask.source.shared_cached(key, build)
    else:
        blocks = mask.cached(key, build)
    score_mod = None
    slopes = mask.alibi_slopes
    if slopes is not None:
        score_mod = mask.source.shared_cached(
            ("flex_alibi", k_len - q_len, device), lambda: alibi_score_mod(slopes, k_len - q_len)
        )
    if padded is not None:
        q = F.pad(q, (0, 0, 0, padded[0] - q_len))
        k, v = (F.pad(t, (0, 0, 0, padded[1] - k_len)) for t in (k, v))
    out = _compiled()(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=blocks,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out if padded is None else out[:, :, :q_len]
