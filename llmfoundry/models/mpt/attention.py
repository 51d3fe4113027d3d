"""Causal self-attention for MPT: ALiBi, the shared attention bias, and the attention kernels.

The block calls one seam, `ATTN_IMPLS[name](q, k, v, bias, dropout_p)`, with q, k, v shaped
[batch, heads, seq, head_dim] and `bias` built once per forward by `AttentionBias`. A new kernel
(flash, flex, infini) is one more entry in `ATTN_IMPLS`; until it exists, `check_attn_impl`
explains why it cannot be chosen.

Bias convention: `bias` is an additive float mask broadcastable to [batch, heads, seq, seq] that
already holds ALiBi, causality (-inf above the diagonal) and, given `sequence_id`, the document
mask (-inf across documents). `bias=None` means plain causal attention with nothing else, which
lets `sdpa` take its fastest (is_causal) path.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

AttnFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor
]


def alibi_slopes(n_heads: int, alibi_bias_max: float = 8) -> torch.Tensor:
    """ALiBi slope of each head, float32 [n_heads], exactly as MPT computes them.

    For a head count that is not a power of two, the slopes of the next power of two are
    interleaved (odd positions first) and truncated, so every head count gets a geometric spread.
    """
    n = 2 ** math.ceil(math.log2(n_heads))
    m = torch.arange(1, n + 1, dtype=torch.float32) * (alibi_bias_max / n)
    slopes = 1.0 / torch.pow(2, m)
    if n != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


def causal_alibi_bias(
    n_heads: int,
    seq_len: int,
    alibi_bias_max: float | None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Additive bias [1, H, L, L]: -slope_h * (i - j) for keys j <= i, -inf for j > i.

    The bias is relative to the query (0 on the diagonal) rather than MPT's key-only form
    (j - (L - 1)) * slope. Both give the same softmax (they differ by a per-row constant), but the
    relative form keeps the values near the diagonal small, which keeps bf16 scores precise.
    With `alibi_bias_max=None` (no ALiBi) the result is the causal mask alone, shaped [1, 1, L, L].
    """
    pos = torch.arange(seq_len, device=device)
    distance = pos[:, None] - pos[None, :]  # i - j
    if alibi_bias_max is None:
        bias = torch.zeros(1, 1, seq_len, seq_len, device=device, dtype=torch.float32)
    else:
        slopes = alibi_slopes(n_heads, alibi_bias_max).to(device)
        bias = -(distance[None, None] * slopes[None, :, None, None])
    bias = bias.masked_fill(distance < 0, float("-inf"))
    return bias.to(dtype)


class AttentionBias(nn.Module):
    """Builds the attention bias every block shares, caching the part that does not change.

    The ALiBi-plus-causal tensor depends only on (seq_len, device, dtype), so it is built once (for
    at least `max_seq_len` tokens), cached, and sliced for shorter inputs; only the per-batch
    document mask is made per forward. The cache is a plain attribute, not a buffer: it is derived
    data, so it must stay out of state dicts, FSDP sharding and DDP's per-step buffer broadcast;
    its key (device, dtype, length) rebuilds it after the model moves.
    """

    def __init__(self, n_heads: int, max_seq_len: int, alibi: bool, alibi_bias_max: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.max_seq_len = max_seq_len
        self.alibi_bias_max = alibi_bias_max if alibi else None
        self.cached: torch.Tensor | None = None

    def _alibi_causal(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        cached = self.cached
        stale = cached is None or cached.device != device or cached.dtype != dtype
        if stale or cached.shape[-1] < seq_len:
            size = max(seq_len, self.max_seq_len)
            self.cached = cached = causal_alibi_bias(
                self.n_heads, size, self.alibi_bias_max, device, dtype
            )
        return cached[..., :seq_len, :seq_len]

    def forward(
        self,
        seq_len: int,
        sequence_id: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        if self.alibi_bias_max is None and sequence_id is None:
            return None
        bias = self._alibi_causal(seq_len, device, dtype)
        if sequence_id is not None:
            other_doc = sequence_id[:, None, :, None] != sequence_id[:, None, None, :]
            bias = bias.masked_fill(other_doc, float("-inf"))
        return bias


def torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """The reference: softmax(q k^T / sqrt(d) + bias) v, written out, softmax in float32."""
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    if bias is None:
        seq_len = q.shape[-2]
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    else:
        scores = scores + bias
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, dropout_p: float
) -> torch.Tensor:
    """PyTorch's fused scaled_dot_product_attention; the bias goes in as its float attn_mask."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout_p, is_causal=bias is None
    )


ATTN_IMPLS: dict[str, AttnFn] = {"torch": torch_attention, "sdpa": sdpa_attention}

# Kernels a later issue adds; named here so choosing one says why it is not available.
_PLANNED = {
    "flash": "flash_attn",
    "flex": None,
    "infini": None,
}


def check_attn_impl(name: str) -> None:
    """Raise a ValueError that says what to do if `name` is not a usable attention kernel."""
    if name in ATTN_IMPLS:
        return
    allowed = ", ".join(repr(n) for n in ATTN_IMPLS)
    if name not in _PLANNED:
        raise ValueError(f"MPTConfig.attn_impl={name!r} is not known; allowed: {allowed}")
    package = _PLANNED[name]
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(
            f"MPTConfig.attn_impl={name!r} needs the {package} package, which is not installed "
            f"(on a CUDA machine: pip install 'llmfoundry[gpu]'); otherwise use one of: {allowed}"
        )
    raise ValueError(
        f"MPTConfig.attn_impl={name!r} is not implemented in this version; use one of: {allowed}"
    )
