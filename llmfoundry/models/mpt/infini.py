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
- with `sequence_id` (packed documents), segments are counted from each document's first
  token, not the row's: every token sees what it would see if its document were alone, the same
  local segment and the same memory (a document that ends mid-segment still reads the memory of
  its earlier segments). A document's segment j, its "piece", spans at most two of the row's
  segments; `local_attention` and `packed_memory_attention` follow pieces across them.

Key/value heads may be grouped (kv_n_heads < n_heads): each kv head has one memory, read by its
group of query heads, each with its own gate.

`InfiniAttention` (at the end) is the shared decoder's Attention with this recurrence as its
kernel; MPT's model installs it in every block when its config has `infini`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.models.layers.attention import AttentionMask
from llmfoundry.models.layers.decoder import Attention, DecoderSpec
from llmfoundry.models.layers.kv_cache import InfiniState
from llmfoundry.models.layers.position import positions_in_document

if TYPE_CHECKING:
    from llmfoundry.models.mpt.config import InfiniConfig

LocalFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], torch.Tensor]


def sigma(x: torch.Tensor) -> torch.Tensor:
    """The memory's feature map, ELU + 1 (positive, so the normaliser is positive)."""
    return F.elu(x) + 1.0


def document_segments(sequence_id: torch.Tensor, segment_len: int) -> tuple[torch.Tensor, ...]:
    """(position in document, position in the document's segment, piece id), each [B, T].

    A piece is one document's segment: positions [j * segment_len, (j + 1) * segment_len) counted
    from the document's first token. Piece ids number the pieces of a row from 1; padding (ids
    < 0, which the flash kernel drops) keeps -1.
    """
    pos = positions_in_document(sequence_id)
    within = pos % segment_len
    piece = torch.cumsum(within == 0, dim=1)
    return pos, within, torch.where(sequence_id < 0, -1, piece)


class PieceLayout:
    """How `local_attention` runs packed rows: two foldings into segment-sized windows.

    The first window set is the row's own segments, masked by piece id: right for every piece
    that starts in its row segment. A piece that started in the previous row segment (a document
    that began mid-segment, in its second or later segment) gets its whole self in one window of
    the second set, which starts each window at the start of the piece that holds the row
    segment's first token; its queries take their output from there. Built once per forward.
    """

    def __init__(self, mask: AttentionMask, segment_len: int) -> None:
        sid = mask.sequence_id
        batch, seq_len = sid.shape
        n_seg = -(-seq_len // segment_len)
        pad = n_seg * segment_len - seq_len
        _, within, piece = document_segments(sid, segment_len)
        piece = F.pad(piece, (0, pad), value=-1)
        t = torch.arange(n_seg * segment_len, device=sid.device)
        start = t - F.pad(within, (0, pad))  # where each position's piece starts
        cross = start.view(batch, n_seg, segment_len)[:, :, 0]  # [B, n_seg]
        window = cross[:, :, None] + torch.arange(segment_len, device=sid.device)
        rows = torch.arange(batch, device=sid.device)[:, None]
        self.window_index = (window.view(batch, -1) + rows * n_seg * segment_len).reshape(-1)
        self.segments = mask.with_sequence_id(piece.view(batch * n_seg, segment_len))
        self.windows = mask.with_sequence_id(
            piece.gather(1, window.view(batch, -1)).view(batch * n_seg, segment_len)
        )
        seg = t // segment_len
        crossing = cross[:, seg]  # [B, n_seg * segment_len]
        self.take_window = (start == crossing) & (crossing < seg * segment_len)
        offset = (t - crossing).clamp(0, segment_len - 1)
        self.window_output = ((rows * n_seg + seg) * segment_len + offset).reshape(-1)


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
    token, so causality keeps real queries from seeing it; padded queries are cut off. Packed rows
    (`sequence_id`) attend within pieces, the documents' own segments (`PieceLayout`): two kernel
    calls instead of one.
    """
    batch, _, seq_len, _ = q.shape
    n_seg = -(-seq_len // segment_len)
    pad = n_seg * segment_len - seq_len

    def padded(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0, 0, pad)) if pad else t

    def fold(t: torch.Tensor) -> torch.Tensor:
        heads, dim = t.shape[1], t.shape[-1]
        t = padded(t).reshape(batch, heads, n_seg, segment_len, dim).transpose(1, 2)
        return t.reshape(batch * n_seg, heads, segment_len, dim)

    def unfold(out: torch.Tensor) -> torch.Tensor:
        heads, dim = out.shape[1], out.shape[-1]
        out = out.reshape(batch, n_seg, heads, segment_len, dim).transpose(1, 2)
        return out.reshape(batch, heads, n_seg * segment_len, dim)

    if mask.sequence_id is None:
        seg_mask = mask.cached(("infini_segments", segment_len, seq_len), lambda: mask)
        return unfold(local(fold(q), fold(k), fold(v), seg_mask))[:, :, :seq_len]

    layout = mask.cached(("infini_pieces", segment_len), lambda: PieceLayout(mask, segment_len))

    def window(t: torch.Tensor) -> torch.Tensor:
        heads, dim = t.shape[1], t.shape[-1]
        flat = padded(t).transpose(1, 2).reshape(-1, heads, dim)
        picked = flat.index_select(0, layout.window_index)
        return picked.view(batch * n_seg, segment_len, heads, dim).transpose(1, 2)

    out = unfold(local(fold(q), fold(k), fold(v), layout.segments))
    crossing = local(window(q), window(k), window(v), layout.windows)
    heads, dim = crossing.shape[1], crossing.shape[-1]
    crossing = crossing.transpose(1, 2).reshape(-1, heads, dim)
    crossing = crossing.index_select(0, layout.window_output)
    crossing = crossing.view(batch, n_seg * segment_len, heads, dim).transpose(1, 2)
    out = torch.where(layout.take_window[:, None, :, None], crossing, out)
    return out[:, :, :seq_len]


def read_memory(
    sq: torch.Tensor, memory: torch.Tensor, norm: torch.Tensor, eps: float
) -> torch.Tensor:
    """A_mem = sigma(Q) M / (sigma(Q) z + eps) for sigma(Q) [B, kv_heads, groups, S, D]."""
    retrieved = torch.einsum("bkgsd,bkde->bkgse", sq, memory)
    scale = torch.einsum("bkgsd,bkd->bkgs", sq, norm)[..., None] + eps
    return retrieved / scale


def memory_update(
    sk: torch.Tensor,
    v: torch.Tensor,
    memory: torch.Tensor,
    norm: torch.Tensor,
    update: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What a segment with sigma(K) `sk` [B, kv_heads, S, D] and values `v` adds to (M, z)."""
    if update == "delta":
        known = (sk @ memory) / ((sk @ norm[..., None]) + eps)
        v = v - known
    return sk.transpose(-2, -1) @ v, sk.sum(dim=-2)


def write_memory(
    sk: torch.Tensor,
    v: torch.Tensor,
    memory: torch.Tensor,
    norm: torch.Tensor,
    update: str,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M_s, z_s) after a segment with sigma(K) `sk` [B, kv_heads, S, D] and values `v`."""
    add_memory, add_norm = memory_update(sk, v, memory, norm, update, eps)
    return memory + add_memory, norm + add_norm


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
        if sequence_id is not None:
            args = (sq, sk, vf, sequence_id, segment_len, update, eps, truncate_every)
            return packed_memory_attention(*args)
        memory = sq.new_zeros(batch, kv_heads, dim, v.shape[-1])
        norm = sq.new_zeros(batch, kv_heads, dim)
        outputs = []
        for index, start in enumerate(range(0, seq_len, segment_len)):
            end = min(start + segment_len, seq_len)
            q_s, k_s, v_s = sq[..., start:end, :], sk[:, :, start:end], vf[:, :, start:end]
            retrieved = read_memory(q_s, memory, norm, eps)
            outputs.append(retrieved.reshape(batch, n_heads, end - start, -1))
            memory, norm = write_memory(k_s, v_s, memory, norm, update, eps)
            if truncate_every is not None and (index + 1) % truncate_every == 0:
                memory, norm = memory.detach(), norm.detach()
        return torch.cat(outputs, dim=2)


def packed_memory_attention(
    sq: torch.Tensor,
    sk: torch.Tensor,
    vf: torch.Tensor,
    sequence_id: torch.Tensor,
    segment_len: int,
    update: str,
    eps: float,
    truncate_every: int | None,
) -> torch.Tensor:
    """`memory_attention` of packed rows, from sigma(Q) [B, kv, groups, T, D], sigma(K), V.

    Each piece (a document's own segment) reads the memory of its document's earlier pieces and
    writes relative to it, as if the document were alone. A row segment holds, in order: the end
    of the piece its first token belongs to, maybe the next piece of that document (from where
    that document's segment boundary falls), documents that start and end inside it (a first
    piece: they read an empty memory, and nothing reads what they write), and the start of the
    document that runs on. The state between row segments is the memory the open piece reads
    (`memory`, `norm`) and what that piece has written so far (`pending`), kept apart so that a
    piece split across two row segments writes relative to one memory, as alone.
    """
    batch, kv_heads, groups, seq_len, dim = sq.shape
    n_heads = kv_heads * groups
    pos, within, piece = document_segments(sequence_id, segment_len)
    memory = sq.new_zeros(batch, kv_heads, dim, vf.shape[-1])
    norm = sq.new_zeros(batch, kv_heads, dim)
    pending = (torch.zeros_like(memory), torch.zeros_like(norm))

    def per_row(flags: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return flags.to(t.dtype).view(batch, *([1] * (t.dim() - 1)))

    outputs = []
    for index, start in enumerate(range(0, seq_len, segment_len)):
        end = min(start + segment_len, seq_len)
        q_s, k_s, v_s = sq[..., start:end, :], sk[:, :, start:end], vf[:, :, start:end]
        p = piece[:, start:end]
        # The open piece is complete if a piece starts here; it is forgotten if a document does.
        closes, same_doc = within[:, start] == 0, pos[:, start] != 0
        memory = (memory + pending[0] * per_row(closes, memory)) * per_row(same_doc, memory)
        norm = (norm + pending[1] * per_row(closes, norm)) * per_row(same_doc, norm)
        pending = tuple(t * per_row(~closes, t) for t in pending)
        first = p == p[:, :1]
        nxt = (p == p[:, :1] + 1) & (pos[:, start:end] >= segment_len)  # same document
        retrieved = read_memory(q_s * first[:, None, None, :, None], memory, norm, eps)
        add = memory_update(k_s * first[:, None, :, None], v_s, memory, norm, update, eps)
        pending = (pending[0] + add[0], pending[1] + add[1])
        # The document's next piece starts inside this row segment: the first one is complete.
        has_next = nxt.any(dim=1)
        memory = memory + pending[0] * per_row(has_next, memory)
        norm = norm + pending[1] * per_row(has_next, norm)
        pending = tuple(t * per_row(~has_next, t) for t in pending)
        retrieved = retrieved + read_memory(q_s * nxt[:, None, None, :, None], memory, norm, eps)
        add = memory_update(k_s * nxt[:, None, :, None], v_s, memory, norm, update, eps)
        pending = (pending[0] + add[0], pending[1] + add[1])
        # A document that starts in this row segment and runs on: its first piece is open.
        fresh = ~(first | nxt)[:, -1]
        last = (p == p[:, -1:])[:, None, :, None]
        empty = (torch.zeros_like(memory), torch.zeros_like(norm))
        started = memory_update(k_s * last, v_s, *empty, update, eps)
        memory, norm = (t * per_row(~fresh, t) for t in (memory, norm))
        pending = tuple(
            torch.where(per_row(fresh, a).bool(), b, a)
            for a, b in zip(pending, started, strict=True)
        )
        outputs.append(retrieved.reshape(batch, n_heads, end - start, -1))
        if truncate_every is not None and (index + 1) % truncate_every == 0:
            memory, norm = memory.detach(), norm.detach()
            pending = tuple(t.detach() for t in pending)
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
    earlier positions `state` summarises (a KV cache, `layers/kv_cache.py`). The new positions are cut where
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


class InfiniAttention(Attention):
    """Attention with infini-attention's compressive memory across segments (`MPTConfig.infini`).

    The projections are Attention's; `gate` holds each head's mixing logit beta, in its own
    optimizer group (its own lr, no weight decay: `own_param_groups`, read by
    `llmfoundry.optim.build_param_groups`). With a cache (decoding), the cache is the layer's
    `InfiniState`, stepped by `infini_attention_step`.
    """

    def __init__(self, spec: DecoderSpec, infini: InfiniConfig) -> None:
        super().__init__(spec)
        self.infini = infini
        self.gate = nn.Parameter(torch.empty(spec.n_heads))
        overrides = {"weight_decay": 0.0}
        if infini.gate_lr is not None:
            overrides["lr"] = infini.gate_lr
        self.own_param_groups = {"gate": ("infini_gate", overrides)}

    def kernel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        cfg = self.infini
        return infini_attention(
            q, k, v, mask, self.gate, cfg.segment_len, cfg.update, cfg.eps, cfg.truncate_every,
            local=super().kernel,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rope: None = None,  # MPTConfig refuses rope with infini
        cache: InfiniState | None = None,
    ) -> torch.Tensor:
        if cache is None:
            return super().forward(x, mask)
        q, k, v = self.project(x)
        cfg = self.infini
        y = infini_attention_step(
            q, k, v, mask, self.gate, cfg.segment_len, cfg.update, cfg.eps,
            local=super().kernel, state=cache,
        )  # fmt: skip
        batch, _, q_len, _ = q.shape
        return self.out_proj(y.transpose(1, 2).reshape(batch, q_len, -1))
