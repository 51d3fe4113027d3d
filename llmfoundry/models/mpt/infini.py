"""Infini-attention's segment recurrence: local attention per segment plus a compressive memory.

Per head, for segment s of a sequence, with sigma = ELU + 1 (Munkhdalai et al. 2024, eq. 3-9):

    A_mem = sigma(Q) M_{s-1} / (sigma(Q) z_{s-1} + eps)
    linear: M_s = M_{s-1} + sigma(K)^T V
    delta:  M_s = M_{s-1} + sigma(K)^T (V - sigma(K) M_{s-1} / (sigma(K) z_{s-1} + eps))
            z_s = z_{s-1} + sum_t sigma(K_t)
    A = sigmoid(beta) * A_mem + (1 - sigmoid(beta)) * A_dot

A_dot is the model's ordinary causal kernel inside the segment, ALiBi included (so ALiBi never
reaches across segments; the memory has no positions). The choices that public implementations
get wrong, made explicit here:

- the memory is a local variable of each forward, started at zero for every row: never a
  module buffer, so batch rows and calls cannot see each other's memory (and DDP's buffer
  broadcast cannot clobber it);
- the gradient flows through M and z across segments (truncated every `truncate_every`
  segments if asked), so keys and values learn what to store;
- M, z and the retrieval are float32 under autocast, and the normaliser has an epsilon (the
  first segment reads an empty memory: 0 / eps = 0);
- with `sequence_id`, the memory also restarts at each document: a query reads the memory only
  if the previous segment ended inside its own document, and a segment writes only the keys of
  the document it ends in.

Key/value heads may be grouped (kv_n_heads < n_heads): each kv head has one memory, read by its
group of query heads, each with its own gate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmfoundry.models.mpt.attention import AttentionMask
from llmfoundry.models.mpt.cache import InfiniState

LocalFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], torch.Tensor]


def sigma(x: torch.Tensor) -> torch.Tensor:
    """The memory's feature map, ELU + 1 (positive, so the normaliser is positive)."""
    return F.elu(x) + 1.0


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    segment_len: int,
    local: LocalFn,
) -> torch.Tensor:
    """A_dot: causal attention inside each segment, every segment in one kernel call.

    The sequence is padded to whole segments and the segments folded into the batch, so the
    kernel sees [batch * n_segments, heads, segment_len, head_dim]. Padding sits after every real
    token, so causality keeps real queries from seeing it; padded queries are cut off.
    """
    batch, _, seq_len, _ = q.shape
    n_seg = -(-seq_len // segment_len)
    pad = n_seg * segment_len - seq_len

    def fold(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0, 0, pad)) if pad else t
        heads, dim = t.shape[1], t.shape[-1]
        t = t.view(batch, heads, n_seg, segment_len, dim).transpose(1, 2)
        return t.reshape(batch * n_seg, heads, segment_len, dim)

    def build_mask() -> AttentionMask:
        sid = mask.sequence_id
        if sid is not None:
            sid = F.pad(sid, (0, pad), value=-1) if pad else sid
            sid = sid.reshape(batch * n_seg, segment_len)
        return mask.with_sequence_id(sid)

    seg_mask = mask.cached(("infini_segments", segment_len, seq_len), build_mask)
    out = local(fold(q), fold(k), fold(v), seg_mask)
    heads, dim = out.shape[1], out.shape[-1]
    out = out.view(batch, n_seg, heads, segment_len, dim).transpose(1, 2)
    return out.reshape(batch, heads, n_seg * segment_len, dim)[:, :, :seq_len]


def read_memory(
    sq: torch.Tensor, memory: torch.Tensor, norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """A_mem = sigma(Q) M / (sigma(Q) z + eps) for sigma(Q) [B, kv_heads, groups, S, D]."""
    retrieved = torch.einsum("bkgsd,bkde->bkgse", sq, memory)
    scale = torch.einsum("bkgsd,bkd->bkgs", sq, norm)[..., None] + eps
    return retrieved / scale


def write_memory(
    sk: torch.Tensor,
    v: torch.Tensor,
    memory: torch.Tensor,
    norm: torch.Tensor,
    update: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M_s, z_s) after a segment with sigma(K) `sk` [B, kv_heads, S, D] and values `v`."""
    if update == "delta":
        known = (sk @ memory) / ((sk @ norm[..., None]) + eps)
        v = v - known
    return memory + sk.transpose(-2, -1) @ v, norm + sk.sum(dim=-2)


def memory_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sequence_id: torch.Tensor | None,
    segment_len: int,
    update: str,
    eps: float,
    truncate_every: int | None,
) -> torch.Tensor:
    """A_mem for every query, [batch, n_heads, seq, head_dim] in float32 (or wider): the
    segment recurrence."""
    batch, n_heads, seq_len, dim = q.shape
    kv_heads = k.shape[1]
    groups = n_heads // kv_heads
    dtype = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 if given
    with torch.autocast(q.device.type, enabled=False):
        sq = sigma(q.to(dtype)).view(batch, kv_heads, groups, seq_len, dim)
        sk, vf = sigma(k.to(dtype)), v.to(dtype)
        memory = sq.new_zeros(batch, kv_heads, dim, v.shape[-1])
        norm = sq.new_zeros(batch, kv_heads, dim)
        outputs = []
        prev_doc = None
        for index, start in enumerate(range(0, seq_len, segment_len)):
            end = min(start + segment_len, seq_len)
            q_s, k_s, v_s = sq[..., start:end, :], sk[:, :, start:end], vf[:, :, start:end]
            write = None
            if sequence_id is not None:
                doc = sequence_id[:, start:end]
                if prev_doc is not None:
                    # Only the document the previous segment ended in is in the memory.
                    reads = (doc == prev_doc[:, None]).to(q_s.dtype)  # [B, S]
                    carry = (doc[:, -1] == prev_doc).to(q_s.dtype)[:, None, None]  # [B, 1, 1]
                    q_s = q_s * reads[:, None, None, :, None]
                    memory, norm = memory * carry[..., None], norm * carry
                write = (doc == doc[:, -1:]).to(k_s.dtype)[:, None, :, None]  # [B, 1, S, 1]
                prev_doc = doc[:, -1]
            retrieved = read_memory(q_s, memory, norm, eps)
            outputs.append(retrieved.reshape(batch, n_heads, end - start, -1))
            if write is not None:
                k_s = k_s * write
            memory, norm = write_memory(k_s, v_s, memory, norm, update, eps)
            if truncate_every is not None and (index + 1) % truncate_every == 0:
                memory, norm = memory.detach(), norm.detach()
        return torch.cat(outputs, dim=2)


def infini_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    gate: torch.Tensor,
    segment_len: int,
    update: str,
    eps: float,
    truncate_every: int | None,
    local: LocalFn,
) -> torch.Tensor:
    """sigmoid(gate) * A_mem + (1 - sigmoid(gate)) * A_dot, [batch, n_heads, seq, head_dim].

    `gate` is the per-head logit beta [n_heads]; `local(q, k, v, mask)` is the causal kernel.
    """
    a_dot = local_attention(q, k, v, mask, segment_len, local)
    a_mem = memory_attention(q, k, v, mask.sequence_id, segment_len, update, eps, truncate_every)
    return gated(gate, a_mem, a_dot)


def gated(gate: torch.Tensor, a_mem: torch.Tensor, a_dot: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate) * A_mem + (1 - sigmoid(gate)) * A_dot, in A_dot's dtype."""
    g = torch.sigmoid(gate.float())[None, :, None, None]
    return (g * a_mem + (1.0 - g) * a_dot.float()).to(a_dot.dtype)


def infini_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    gate: torch.Tensor,
    segment_len: int,
    update: str,
    eps: float,
    local: LocalFn,
    state: InfiniState,
) -> torch.Tensor:
    """`infini_attention` for new positions only, continuing from `state` (updated in place).

    q [B, n_heads, n, D] and k, v [B, kv_heads, n, D] are the next n positions of the rows whose
    earlier positions `state` summarises (a KV cache, `cache.py`). The new positions are cut where
    segments end: a completed segment is folded into the memory when the next one starts, and
    each piece attends locally to its segment so far (bottom-right aligned, ALiBi included) and
    reads the memory of the segments before. The result equals `infini_attention` over the whole
    sequence (without `sequence_id`: every row is one document starting at position 0).
    """
    if mask.sequence_id is not None:
        raise ValueError(
            "infini-attention with a KV cache needs rows that each hold one document starting at "
            "position 0 (no padding, no sequence_id); decode rows of different lengths separately"
        )
    batch, n_heads, n_new, dim = q.shape
    kv_heads = k.shape[1]
    dtype = torch.promote_types(q.dtype, torch.float32)
    if state.memory is None:
        state.memory = torch.zeros(batch, kv_heads, dim, v.shape[-1], dtype=dtype, device=q.device)
        state.norm = torch.zeros(batch, kv_heads, dim, dtype=dtype, device=q.device)
    outputs = []
    start = 0
    while start < n_new:
        if state.k is not None and state.k.shape[2] == segment_len:
            with torch.autocast(q.device.type, enabled=False):
                state.memory, state.norm = write_memory(
                    sigma(state.k.to(dtype)),
                    state.v.to(dtype),
                    state.memory,
                    state.norm,
                    update,
                    eps,
                )
            state.k = state.v = None
        filled = 0 if state.k is None else state.k.shape[2]
        end = start + min(segment_len - filled, n_new - start)
        k_s, v_s = k[:, :, start:end], v[:, :, start:end]
        state.k = k_s if state.k is None else torch.cat([state.k, k_s], dim=2)
        state.v = v_s if state.v is None else torch.cat([state.v, v_s], dim=2)
        q_s = q[:, :, start:end]
        a_dot = local(q_s, state.k, state.v, mask)
        with torch.autocast(q.device.type, enabled=False):
            sq = sigma(q_s.to(dtype)).view(batch, kv_heads, n_heads // kv_heads, end - start, dim)
            a_mem = read_memory(sq, state.memory, state.norm, eps)
        outputs.append(gated(gate, a_mem.reshape(batch, n_heads, end - start, -1), a_dot))
        start = end
    return torch.cat(outputs, dim=2)
