"""attn_impl=flash: flash-attn 2, imported lazily, with ALiBi slopes, GQA and document masking.

flash-attn takes what the mask describes directly: `alibi_slopes` (its bias is
-slope * |i + k_len - q_len - j|, our relative ALiBi), `causal=True` (bottom-right aligned, as
our queries are), `window_size` for a sliding window, and key/value heads fewer than query heads.
Document masking is its variable-length form: the tokens of every row are packed into one
sequence, each document is one entry of `cu_seqlens` (cumulative lengths), and padding
(sequence_id -1, from the data loader) is dropped before the kernel and comes back as zeros.
With a KV cache (decoding left-padded prompts, or rows that joined a running batch: their
padding is a document of its own), queries and keys are packed separately
(`cu_seqlens_q` != `cu_seqlens_k`): a document's queries are its last positions, so the
kernel's bottom-right causal alignment holds in each. The layout is derived once per forward
and shared by every layer.

The kernel needs a CUDA device, fp16/bf16 tensors and `pip install 'llmfoundry[gpu]'`; each
missing piece is named in the error. The glue here is tested on CPU against the dense
reference with the kernel's documented semantics written out in torch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmfoundry.models.layers.attention import AttentionMask
from llmfoundry.utils.errors import MissingPackage, UserError

GPU_EXTRA = "pip install 'llmfoundry[gpu]'"


def missing_package() -> str | None:
    """Why attn_impl=flash cannot be used here, or None when flash-attn is installed."""
    if importlib.util.find_spec("flash_attn") is None:
        return (
            f"attn_impl='flash' needs the flash_attn package, which is not installed (on a CUDA "
            f"machine: {GPU_EXTRA}); otherwise use attn_impl=sdpa"
        )
    return None


def flash_functions() -> tuple[Callable, Callable]:
    """(flash_attn_func, flash_attn_varlen_func), imported on first use."""
    problem = missing_package()
    if problem is not None:
        raise MissingPackage(problem)
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func


def check_inputs(q: torch.Tensor) -> None:
    """flash-attn runs on CUDA in fp16/bf16 only; say so instead of failing inside it."""
    if q.device.type != "cuda":
        raise UserError(
            f"attn_impl='flash' needs a CUDA device, but the model runs on {q.device.type}; use "
            "attn_impl=sdpa here (same weights)"
        )
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise UserError(
            f"attn_impl='flash' needs fp16 or bf16 activations, got {q.dtype}; train with "
            "precision=amp_bf16"
        )


@dataclass(frozen=True)
class VarlenLayout:
    """Where each kept query and key goes in the packed sequences, and the documents' bounds.

    Document i is keys k_indices[cu_seqlens_k[i]:cu_seqlens_k[i + 1]] and the queries among
    them; with a cache, a document's queries are its last positions (queries are the tail of
    the row), so the kernel's bottom-right causal alignment holds within every document. A
    document without queries (left padding, or one the cached rows have finished) is an empty
    query range.
    """

    q_indices: torch.Tensor  # [n_queries] positions in the flattened [batch * q_len]
    k_indices: torch.Tensor  # [n_keys] positions in the flattened [batch * k_len]
    cu_seqlens_q: torch.Tensor  # int32 [n_docs + 1]
    cu_seqlens_k: torch.Tensor  # int32 [n_docs + 1]
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_layout(sequence_id: torch.Tensor, q_len: int | None = None) -> VarlenLayout:
    """Packed layout of `sequence_id` [batch, k_len] for queries at the last `q_len` positions
    (all of them by default): one sequence per run of equal ids per row.

    Tokens with id < 0 (padding) are left out, as keys and as queries. A few host syncs (the
    kept tokens, the documents, the longest one), once per forward.
    """
    batch, k_len = sequence_id.shape
    q_len = k_len if q_len is None else q_len
    flat = sequence_id.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::k_len] = True  # every row starts a document
    k_indices = torch.nonzero(flat >= 0).squeeze(1)
    doc_of_key = torch.cumsum(starts[k_indices], 0) - 1
    k_counts = torch.bincount(doc_of_key)
    column = k_indices % k_len
    is_query = column >= k_len - q_len
    q_counts = torch.bincount(doc_of_key[is_query], minlength=len(k_counts))
    q_indices = (k_indices // k_len * q_len + column - (k_len - q_len))[is_query]
    longest = [0, 0]
    if len(k_counts):
        longest = torch.stack([q_counts.max(), k_counts.max()]).tolist()
    return VarlenLayout(
        q_indices, k_indices, _cumulative(q_counts), _cumulative(k_counts), *longest
    )


def _cumulative(counts: torch.Tensor) -> torch.Tensor:
    """int32 [0, c0, c0 + c1, ...]: flash-attn's cu_seqlens of sequence lengths `counts`."""
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def prepare(mask: AttentionMask, q_len: int, k_len: int) -> None:
    """Derive the packed layout of a forward with documents before the blocks run
    (`AttentionMasks.forward`): of each run of queries when they are at given positions."""
    if mask.query_positions is not None:
        for first, end, key_end in mask.query_runs():
            prepare(_run_mask(mask, key_end), end - first, key_end)
    elif mask.sequence_id is not None:
        _layout(mask, q_len, k_len)


def _run_mask(mask: AttentionMask, key_end: int) -> AttentionMask:
    """The mask of a run of queries that ends at key `key_end`, over the keys before it: the
    run is their last positions (bottom-right aligned, as the kernel's causal mode)."""
    sid = mask.sequence_id
    return mask.cached(
        ("flash_run", key_end),
        lambda: mask.with_sequence_id(None if sid is None else sid[:, :key_end]),
    )


def _layout(mask: AttentionMask, q_len: int, k_len: int) -> VarlenLayout:
    """`varlen_layout` of the mask's documents, once per forward."""
    return mask.cached(
        "flash_varlen", lambda: varlen_layout(mask.sequence_id, q_len), (q_len, k_len)
    )


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """The `AttnFn` for attn_impl=flash (see attention.py for the contract). Queries at given
    positions (a context-parallel rank's two chunks) run once per contiguous run, over the
    keys up to the run's end, where the kernel's bottom-right alignment puts them."""
    check_inputs(q)
    if mask.query_positions is None:
        return _flash(q, k, v, mask, dropout_p, scale)
    runs = [
        _flash(q[:, :, first:end], k[:, :, :key_end], v[:, :, :key_end],
               _run_mask(mask, key_end), dropout_p, scale)
        for first, end, key_end in mask.query_runs()
    ]  # fmt: skip
    return torch.cat(runs, dim=2)


def _flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """flash-attn on queries that are the last of the keys: dense, or varlen with documents."""
    dense_fn, varlen_fn = flash_functions()
    window = mask.source.window
    window_size = (-1, -1) if window is None else (window - 1, 0)
    options = dict(
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=True,
        window_size=window_size,
        alibi_slopes=mask.alibi_slopes,
    )
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, seq, heads, head_dim]
    if mask.sequence_id is None:
        return dense_fn(q, k, v, **options).transpose(1, 2)
    batch, q_len, n_heads, head_dim = q.shape
    k_len = k.shape[1]
    layout = _layout(mask, q_len, k_len)
    packed_q = q.reshape(batch * q_len, n_heads, head_dim)[layout.q_indices]
    packed_k, packed_v = (
        t.reshape(batch * k_len, t.shape[2], head_dim)[layout.k_indices] for t in (k, v)
    )
    out = varlen_fn(
        packed_q,
        packed_k,
        packed_v,
        cu_seqlens_q=layout.cu_seqlens_q,
        cu_seqlens_k=layout.cu_seqlens_k,
        max_seqlen_q=layout.max_seqlen_q,
        max_seqlen_k=layout.max_seqlen_k,
        **options,
    )
    full = out.new_zeros(batch * q_len, n_heads, head_dim).index_copy(0, layout.q_indices, out)
    return full.view(batch, q_len, n_heads, head_dim).transpose(1, 2)
