"""How a model knows where each token is: the position schemes every family can choose from.

- ALiBi (`ALiBi`, `alibi_slopes`, `causal_alibi_bias`): a per-head bias on the attention scores,
  so it is an option of the mask description (`AttentionMasks(alibi=ALiBi(...))` in
  attention.py; None there for every other scheme). MPT's default.
- RoPE (`RotaryEmbedding`, `apply_rope`; `rope_inv_freq` with Llama 3.1's `RopeScaling` or
  `LinearRopeScaling`): a rotation of queries and keys by their positions, which the family's
  attention applies before the kernel. Llama's, and MPT's with `rope=true`.
- A learned position table is the decoder's `transformer.wpe` (decoder.py; MPT's `learned_pos_emb`).

A family picks by its config (MPT's `alibi`, `alibi_bias_max`, `learned_pos_emb`, `rope`; Llama's
`rope_theta`, `rope_scaling`); nothing here names a family. `positions_in_document` numbers the
tokens of each packed document from 0, for a position table and RoPE alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from llmfoundry.utils.errors import UserError


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


@dataclass(frozen=True)
class ALiBi:
    """ALiBi (Press et al.): head h adds -slope_h * (i - j) to query i's score for key j, with
    geometric slopes set by `bias_max` (`alibi_slopes`). Relative, so a KV cache or left
    padding shifts nothing."""

    bias_max: float = 8

    def slopes(self, n_heads: int) -> torch.Tensor:
        """float32 [n_heads], on the CPU."""
        return alibi_slopes(n_heads, self.bias_max)


def causal_alibi_bias(
    n_heads: int,
    seq_len: int,
    alibi_bias_max: float | None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    heads: slice | None = None,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive bias [1, H, L, L]: -slope_h * (i - j) for keys j <= i, -inf for j > i.

    `queries` (positions among the L keys, [Q]) builds only those rows, [1, H, Q, L]: the
    same values as the full bias's rows, without the L x L tensor (a context-parallel rank's
    queries, llmfoundry/distributed/context.py).

    With a sliding `window`, keys `window` or more positions back are -inf too. `heads` selects
    the heads built (all `n_heads` by default; a tensor-parallel rank's range).

    The bias is relative to the query (0 on the diagonal) rather than MPT's key-only form
    (j - (L - 1)) * slope. Both give the same softmax (they differ by a per-row constant), but the
    relative form keeps the values near the diagonal small, which keeps bf16 scores precise.
    With `alibi_bias_max=None` (no ALiBi) the result is the causal mask alone, shaped [1, 1, L, L].

    It is written into its `dtype` result a block of rows at a time, each value computed in
    float32 (exact distances) and rounded once: the build's temporaries (a block's float32
    distances and mask) stay a fraction of the result (mpt-30b's bf16 bias at 8k is 7 GiB;
    building it through whole-tensor float32 and int64 intermediates took five times that).
    """
    slopes = torch.zeros(1)  # no ALiBi: one head of zeros, the causal mask alone
    if alibi_bias_max is not None:
        slopes = alibi_slopes(n_heads, alibi_bias_max)[heads or slice(None)]
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)  # exact below 2^24
    q_pos = pos if queries is None else queries.to(device=device, dtype=torch.float32)
    bias = torch.empty(1, len(slopes), len(q_pos), seq_len, device=device, dtype=dtype)
    # Temporaries: 5 bytes per element of 1/8 of the rows.
    rows_per_block = max(1, -(-len(q_pos) // 8))
    for start in range(0, len(q_pos), rows_per_block):
        rows = slice(start, start + rows_per_block)
        distance = q_pos[rows, None] - pos[None, :]  # i - j
        hidden = distance < 0
        if window is not None:
            hidden |= distance >= window
        for head in range(len(slopes)):
            block = bias[0, head, rows]
            torch.mul(distance, -slopes[head], out=block)  # float32, rounded once to `dtype`
            block.masked_fill_(hidden, float("-inf"))
    return bias


def positions_in_document(sequence_id: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document: 0 at each document's first token.

    Packed rows hold several documents; restarting positions at each one gives a learned position
    table or RoPE the same view of a document as if it were alone. Documents are contiguous runs
    of equal `sequence_id`.
    """
    seq_len = sequence_id.shape[1]
    pos = torch.arange(seq_len, device=sequence_id.device).expand_as(sequence_id)
    starts = torch.ones_like(sequence_id, dtype=torch.bool)
    starts[:, 1:] = sequence_id[:, 1:] != sequence_id[:, :-1]
    start_pos = torch.where(starts, pos, torch.zeros_like(pos)).cummax(dim=1).values
    return pos - start_pos


def token_positions(
    sequence_id: torch.Tensor | None,
    seq_len: int,
    k_len: int,
    queries: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Positions [batch or 1, seq_len] of a forward's `seq_len` tokens among its `k_len` keys:
    the last seq_len (after cached ones), or the key positions `queries` [seq_len] (a
    context-parallel rank's, which are not the last). With `sequence_id` [batch, k_len], each
    document's tokens count from 0 (`positions_in_document` over every key, then indexed), so
    a token gets the position it has in the whole sequence whichever of them this forward
    holds."""
    if sequence_id is None:
        if queries is None:
            return torch.arange(k_len - seq_len, k_len, device=device)[None]
        return queries[None]
    in_document = positions_in_document(sequence_id)
    return in_document[:, -seq_len:] if queries is None else in_document[:, queries]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (transformers' rope_type "llama3").

    A model pretrained at `original_max_seq_len` positions is stretched to longer contexts by
    dividing the rotation frequencies whose wavelength exceeds original_max_seq_len /
    low_freq_factor by `factor`, keeping those whose wavelength is under original_max_seq_len /
    high_freq_factor, and interpolating smoothly between the two. Llama 3.1: factor 8, low 1,
    high 4, original 8192; Llama 3.2 1B/3B: factor 32.
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise UserError(f"rope_scaling.{name} must be > 0, got {value!r}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise UserError(
                f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor}): they bound the smoothed band"
            )
        value = self.original_max_seq_len
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(
                f"rope_scaling.original_max_seq_len must be a positive integer, got {value!r}"
            )


@dataclass(frozen=True)
class LinearRopeScaling:
    """Linear RoPE scaling (position interpolation; transformers' rope_type "linear"): every
    frequency divided by `factor`, as if positions were factor times closer together."""

    factor: float

    def __post_init__(self) -> None:
        value = self.factor
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise UserError(f"linear rope scaling factor must be > 0, got {value!r}")


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: RopeScaling | LinearRopeScaling | None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The rotation frequency of each pair of dimensions, float32 [head_dim / 2].

    theta^(-2i / head_dim); with Llama 3.1's `scaling`, low frequencies (wavelength above
    original / low_freq_factor) are divided by `factor`, high ones (below original /
    high_freq_factor) kept, and the band between interpolated (transformers' "llama3"); with
    `LinearRopeScaling`, all divided by its factor (transformers' "linear").
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    original = scaling.original_max_seq_len
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's rotation angles, [batch or 1, seq, head_dim], float32,
    for heads of `head_dim` rotated at `rope_inv_freq(head_dim, theta, scaling)`.

    The frequencies are derived data, kept as a plain attribute per device (as `AttentionMasks`
    keeps its masks), not a buffer: they stay out of state dicts and sharding, and a model built
    on the meta device gets real ones on its first forward.
    """

    def __init__(
        self, head_dim: int, theta: float, scaling: RopeScaling | LinearRopeScaling | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.reset()

    def reset(self) -> None:
        """Drop the cached frequencies (after the model is re-initialised or moved)."""
        self._inv_freq: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for integer `positions` [batch or 1, seq]."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(
                self.head_dim, self.theta, self.scaling, positions.device
            )
        angles = positions[..., None].float() * self._inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, heads, L, head_dim] by the angles of `cos`, `sin` [B or 1, L, head_dim]:
    x * cos + rotate_half(x) * sin, in float32, returned in x's dtype."""
    cos, sin = cos[:, None], sin[:, None]
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)
