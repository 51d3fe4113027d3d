"""attn_impl=flex: PyTorch's FlexAttention, compiled, with ALiBi as a score_mod.

The mask description becomes a `BlockMask` (causal, sliding window, and per-document when
`sequence_id` is given), whose empty blocks the kernel skips, so packed documents cost only
their own attention. The causal/window BlockMask and the ALiBi score_mod do not depend on the
batch and are kept across forwards by the model's `AttentionMasks`; a per-document BlockMask is
built once per forward and shared by every layer. Both are built by `prepare`, in the model's
forward before the blocks run, so compiled blocks (model.compile=true) find them in the
forward's mask without building or looking anything up by length: a second sequence length
compiles the blocks once more, with dynamic shapes, and a third does not (tests/models/
test_mpt_kernels.py; on the H200, torch 2.11: 1, 2, 2 graphs over three lengths, then
documents once and once more at their second length). The dense [B, H, L, L] bias is never
built. A context-parallel rank's queries are not the last of the keys: its mask_mod and
score_mod read each query's position through the index of `query_positions`.

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
from llmfoundry.utils.errors import UserError

# FlexAttention's default block size; on CPU, sequences are padded to a multiple of it.
_CPU_BLOCK = 128


@functools.cache
def _compiled(device_type: str) -> Callable:
    """FlexAttention compiled on its own (when the blocks run eagerly). On CUDA, with dynamic
    shapes after the first (torch.compile's default): `dynamic=False` recompiled it for every
    sequence length and fell back to the eager kernel ([B, H, L, L] scores) after 8. On CPU
    (inference only), static: inductor's CPU lowering of FlexAttention fails to compile with
    a dynamic batch (torch 2.13)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False if device_type == "cpu" else None)


def _kernel(device: torch.device) -> Callable:
    """FlexAttention as this call can run it: inside a compiled block, the plain function (the
    block's compile takes it in); outside, the one compiled on its own."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention
    return _compiled(device.type)


def _padded(q_len: int, k_len: int, device: torch.device) -> tuple[int, int] | None:
    """(queries, keys) padded to whole blocks on CPU (module docstring), None elsewhere."""
    if device.type != "cpu" or not (q_len % _CPU_BLOCK or k_len % _CPU_BLOCK):
        return None
    return (-(-q_len // _CPU_BLOCK) * _CPU_BLOCK, -(-k_len // _CPU_BLOCK) * _CPU_BLOCK)


def _query_index(
    mask: AttentionMask, q_len: int, k_len: int, padded: tuple[int, int] | None
) -> torch.Tensor | None:
    """The queries' positions among the keys (`AttentionMask.query_positions`, a
    context-parallel rank's), padding queries placed past the last key; None when the queries
    are the last q_len (their position is q_idx + offset)."""
    positions = mask.query_positions
    if positions is None or padded is None:
        return positions
    return F.pad(positions, (0, padded[0] - q_len), value=k_len)


def block_mask(mask: AttentionMask, q_len: int, k_len: int, padded: tuple[int, int] | None):
    """The BlockMask of `mask` for queries at the last `q_len` of `k_len` key positions (or at
    its `query_positions`), over `padded` (queries, keys) positions when given: padding keys
    are masked out, padding queries attend to nothing (their rows are cut off). One per row
    with documents, else one for all.

    The length-dependent scalars are captured as tensors, not ints: torch.compile guards on a
    captured int, so every new offset or length would compile FlexAttention again.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    window, sid, pad = mask.source.window, mask.sequence_id, padded is not None
    offset, last = (torch.tensor(n, device=mask.device) for n in (k_len - q_len, k_len - 1))
    index = _query_index(mask, q_len, k_len, padded)

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos = q_idx + offset if index is None else index[q_idx]
        keep = q_pos >= kv_idx
        if pad:
            keep = keep & (q_pos <= last)
        if window is not None:
            keep = keep & (q_pos - kv_idx < window)
        if sid is not None:
            in_rows = torch.minimum(q_pos, last), torch.minimum(kv_idx, last)
            keep = keep & (sid[b, in_rows[0]] == sid[b, in_rows[1]])
        return keep

    rows = None if sid is None else sid.shape[0]
    q_size, k_size = padded or (q_len, k_len)
    return create_block_mask(mask_mod, rows, None, q_size, k_size, device=mask.device)


def alibi_score_mod(
    slopes: torch.Tensor, offset: torch.Tensor, index: torch.Tensor | None = None
) -> Callable:
    """score - slope_h * (i - j), the relative ALiBi bias, for queries offset by `offset` (a
    tensor, as `block_mask`'s scalars), or at positions `index` (`_query_index`)."""

    def score_mod(score, b, h, q_idx, kv_idx):
        q_pos = q_idx + offset if index is None else index[q_idx]
        return score - slopes[h] * (q_pos - kv_idx)

    return score_mod


def prepare(mask: AttentionMask, q_len: int, k_len: int) -> None:
    """Build the BlockMask and ALiBi score_mod `flex_attention` will use at these lengths
    (`AttentionMasks.forward` calls it before the blocks run)."""
    _products(mask, q_len, k_len)


def _products(mask: AttentionMask, q_len: int, k_len: int) -> tuple[object, Callable | None]:
    """(BlockMask, score_mod or None) of `mask` at these lengths: per forward in the mask's
    memo; the batch-free ones (no documents) also across forwards, keyed by length."""
    source, device = mask.source, mask.device

    def build() -> tuple[object, Callable | None]:
        padded = _padded(q_len, k_len, device)
        # Queries at given positions (a context-parallel rank's, the same every step) are
        # told apart by their runs (one host sync of the positions per forward).
        at = None if mask.query_positions is None else tuple(mask.query_runs())
        if mask.sequence_id is None:
            key = ("flex", q_len, k_len, at, device)
            blocks = source.shared_cached(key, lambda: block_mask(mask, q_len, k_len, padded))
        else:
            blocks = block_mask(mask, q_len, k_len, padded)
        slopes, offset = mask.alibi_slopes, k_len - q_len
        score_mod = None
        if slopes is not None:
            index = _query_index(mask, q_len, k_len, padded)
            score_mod = source.shared_cached(
                ("flex_alibi", offset, at, device),
                lambda: alibi_score_mod(slopes, torch.tensor(offset, device=device), index),
            )
        return blocks, score_mod

    return mask.cached("flex", build, (q_len, k_len))


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
        raise UserError("attn_impl='flex' has no attention dropout; set model.attn_pdrop=0")
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise UserError(
            "attn_impl='flex' cannot train on CPU: PyTorch has no CPU backward for "
            "FlexAttention. Train on a GPU, or use attn_impl=sdpa on CPU (same weights); flex "
            "runs CPU inference under torch.no_grad()"
        )
    q_len, k_len = q.shape[-2], k.shape[-2]
    blocks, score_mod = _products(mask, q_len, k_len)
    padded = _padded(q_len, k_len, q.device)
    if padded is not None:
        q = F.pad(q, (0, 0, 0, padded[0] - q_len))
        k, v = (F.pad(t, (0, 0, 0, padded[1] - k_len)) for t in (k, v))
    if q.device.type == "cpu" and torch.compiler.is_compiling():
        # Inductor's CPU lowering of FlexAttention fails on head views of a 3-D buffer
        # (MPT's fused projection, qk_ln's output); the block's compile fuses the copy.
        q, k, v = (t.contiguous() for t in (q, k, v))
    out = _kernel(q.device)(
        q,
        k,
        v,
        score_mod=score_mod,
        block_mask=blocks,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out if padded is None else out[:, :, :q_len]
