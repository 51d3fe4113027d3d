"""Causal self-attention every family shares: the mask description and the torch/sdpa kernels.

The seam between a block and a kernel is one call,

    ATTN_IMPLS[name](q, k, v, mask, dropout_p, scale) -> [batch, n_heads, q_len, head_dim]

with q shaped [batch, n_heads, q_len, head_dim] and k, v [batch, kv_n_heads, k_len, head_dim]
(kv_n_heads divides n_heads: grouped-query attention; 1 is multi-query). `mask` is an
`AttentionMask`: a description of what each query may see (causality, ALiBi slopes when the
family's position scheme is ALiBi (position.py), sliding window, document ids), not a tensor.
Each kernel turns it into what it consumes (a dense additive bias for `torch` and `sdpa`, a
`score_mod` and `BlockMask` for `flex`, `alibi_slopes` and `cu_seqlens` for `flash`) through
`mask.cached(key, build)`, so the product is built once per forward and shared by every layer;
the part that does not depend on the batch is cached across forwards by the `AttentionMasks`
module that made the mask. RoPE rotates q and k before the kernel; the mask never sees it.

Positions: queries are the last `q_len` of the `k_len` key positions (bottom-right aligned, as
flash-attn's causal mode). A full forward has q_len == k_len; a decoding step with a cache of
past keys passes only the new queries and every key, and ALiBi, causality and document masking
line up without another argument. ALiBi is relative (-slope * (i - j)), so left padding does not
shift it either. Document ids (`sequence_id`, [batch, k_len]) cover the key positions; a query's
id is the one of its own position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.models.layers.position import ALiBi, causal_alibi_bias

AttnFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "AttentionMask", float, float], torch.Tensor
]


@dataclass(eq=False)
class AttentionMask:
    """What each query may attend to: causal, with the source's `alibi` bias (or none), sliding
    window (its `window`: keys at most window - 1 positions back) and document masking.

    Made once per model forward by `AttentionMasks` (its `source`) and passed to every layer.
    `sequence_id` is [batch, k_len] (None: every row is one document); `dtype` is the dtype the
    scores are computed in (autocast's). Kernels memoise what they derive from it with `cached`.
    """

    source: AttentionMasks
    sequence_id: torch.Tensor | None
    device: torch.device
    dtype: torch.dtype
    _built: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def alibi_slopes(self) -> torch.Tensor | None:
        """float32 [heads] on the mask's device (the source's `heads`), or None without ALiBi."""
        return self.source.slopes(self.device)

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """`build()` the first time `key` is asked for in this forward, the same object after."""
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def with_sequence_id(self, sequence_id: torch.Tensor | None) -> AttentionMask:
        """The same mask for other rows (e.g. a sequence cut into segments), with its own memo."""
        return AttentionMask(self.source, sequence_id, self.device, self.dtype)

    def query_sequence_id(self, q_len: int) -> torch.Tensor | None:
        """Document id of each query position: the last `q_len` columns of `sequence_id`."""
        return None if self.sequence_id is None else self.sequence_id[:, -q_len:]

    def dense_bias(self, q_len: int, k_len: int) -> torch.Tensor | None:
        """Additive float bias broadcastable to [batch, n_heads, q_len, k_len], or None.

        It holds ALiBi, causality (-inf for future keys), the sliding window and the document
        mask (-inf across documents). None means plain causal attention with q_len == k_len and nothing else, which
        lets `sdpa` take its fastest (is_causal) path.
        """
        src = self.source
        if src.alibi is None and src.window is None and self.sequence_id is None:
            if q_len == k_len:
                return None
        return self.cached(("dense", q_len, k_len), lambda: self._dense(q_len, k_len))

    def _dense(self, q_len: int, k_len: int) -> torch.Tensor:
        full = self.source.causal_bias(k_len, self.device, self.dtype)
        bias = full[..., k_len - q_len : k_len, :k_len]
        if self.sequence_id is not None:
            q_sid = self.query_sequence_id(q_len)
            other_doc = q_sid[:, None, :, None] != self.sequence_id[:, None, None, :]
            bias = bias.masked_fill(other_doc, float("-inf"))
        return bias


class AttentionMasks(nn.Module):
    """Makes each forward's `AttentionMask`, caching what does not change between forwards.

    `alibi` is ALiBi's score bias (`position.ALiBi`), None for families whose positions are
    elsewhere (RoPE, a position table). The causal tensor (-inf above the diagonal and outside the
    window, plus ALiBi's bias) depends only on (length, device, dtype), so it is built once (for
    at least `max_seq_len` tokens), cached, and sliced for shorter inputs; the ALiBi slopes are
    cached per device, and kernels may keep batch-free products (a causal BlockMask) in
    `shared_cached`. The caches are plain attributes, not buffers: they are derived data, so
    they stay out of state dicts, FSDP sharding and DDP's per-step buffer broadcast; their keys
    (device, dtype, length) rebuild them after the model moves.

    `heads` are the heads whose attention the model's blocks compute: all of them, unless the
    model's projections were split by head from outside (tensor parallelism gives each rank a
    contiguous range; `select_heads`). ALiBi's per-head slopes and bias follow that range: only
    those heads' bias is built.
    """

    def __init__(
        self,
        n_heads: int,
        max_seq_len: int,
        alibi: ALiBi | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.window = window
        self.max_seq_len = max_seq_len
        self.alibi = alibi
        self.heads = slice(0, n_heads)
        self.reset()

    def select_heads(self, start: int, stop: int) -> None:
        """Describe only heads [start, stop) from now on (their slopes, their bias)."""
        if not 0 <= start < stop <= self.n_heads:
            raise ValueError(f"heads [{start}, {stop}) are not within the {self.n_heads} heads")
        self.heads = slice(start, stop)
        self.reset()

    def reset(self) -> None:
        """Drop the caches (after the model is re-initialised or moved)."""
        self.cached: torch.Tensor | None = None
        self._slopes: torch.Tensor | None = None
        self._shared: dict[Any, Any] = {}

    def slopes(self, device: torch.device) -> torch.Tensor | None:
        """ALiBi slopes of the `heads`, float32 [len(heads)] on `device`; None without ALiBi."""
        if self.alibi is None:
            return None
        if self._slopes is None or self._slopes.device != device:
            self._slopes = self.alibi.slopes(self.n_heads)[self.heads].to(device)
        return self._slopes

    def causal_bias_shape(self, seq_len: int) -> tuple[int, int, int, int]:
        """The shape of the cache `causal_bias` keeps for inputs of `seq_len` tokens:
        [1, len(heads) with ALiBi (else 1), size, size], size the longer of seq_len and
        max_seq_len (the memory planner counts it)."""
        size = max(seq_len, self.max_seq_len)
        heads = 1 if self.alibi is None else len(range(self.n_heads)[self.heads])
        return (1, heads, size, size)

    def causal_bias(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The causal bias (window, ALiBi) [1, len(heads) or 1, seq_len, seq_len], sliced from
        the cache."""
        cached = self.cached
        stale = cached is None or cached.device != device or cached.dtype != dtype
        if stale or cached.shape[-1] < seq_len:
            size = self.causal_bias_shape(seq_len)[-1]
            bias_max = None if self.alibi is None else self.alibi.bias_max
            self.cached = cached = causal_alibi_bias(
                self.n_heads, size, bias_max, device, dtype, self.window, self.heads
            )
        return cached[..., :seq_len, :seq_len]

    def shared_cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """Like `AttentionMask.cached`, but kept across forwards (for batch-free products)."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def forward(
        self, sequence_id: torch.Tensor | None, device: torch.device, dtype: torch.dtype
    ) -> AttentionMask:
        return AttentionMask(self, sequence_id, device, dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the attention scores will have: autocast's if it is on, else the input's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def repeat_kv(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, kv_heads, L, D] -> [B, n_heads, L, D]: each kv head serves n_heads // kv_heads queries."""
    groups = n_heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """The reference: softmax(scale * q k^T + bias) v, written out, softmax in float32."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    scores = (q @ k.transpose(-2, -1)) * scale
    q_len, k_len = q.shape[-2], k.shape[-2]
    bias = mask.dense_bias(q_len, k_len)
    if bias is None:
        future = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    else:
        scores = scores + bias
    weights = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """PyTorch's fused scaled_dot_product_attention; the dense bias goes in as its attn_mask."""
    bias = mask.dense_bias(q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=bias,
        dropout_p=dropout_p,
        is_causal=bias is None,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
