"""attn_impl=flash: flash-attn 2, imported lazily, with ALiBi slopes, GQA and document masking.

flash-attn takes what the mask describes directly: `alibi_slopes` (its bias is
-slope * |i + k_len - q_len - j|, our relative ALiBi), `causal=True` (bottom-right aligned, as
our queries are), `window_size` for a sliding window, and key/value heads fewer than query heads.
Document masking is its variable-length form: the tokens of every row are packed into one
sequence, each document is one entry of `cu_seqlens` (cumulative lengths), and padding
(sequence_id -1, from the data loader) is dropped before the kernel and comes back as zeros.
The layout is derived once per forward and shared by every layer.

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
        raise ImportError(problem)
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    return flash_attn_func, flash_attn_varlen_func


def check_inputs(q: torch.Tensor) -> None:
    """flash-attn runs on CUDA in fp16/bf16 only; say so instead of failing inside it."""
    if q.device.type != "cuda":
        raise RuntimeError(
            f"attn_impl='flash' needs a CUDA device, but the model runs on {q.device.type}; use "
            "attn_impl=sdpa here (same weights)"
        )
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(
            f"attn_impl='flash' needs fp16 or bf16 activations, got {q.dtype}; train with "
            "precision=amp_bf16"
        )


@dataclass(frozen=True)
class VarlenLayout:
    """Where each kept token goes in the packed sequence, and the documents' boundaries."""

    indices: torch.Tensor  # [n_kept] positions in the flattened [batch * seq]
    cu_seqlens: torch.Tensor  # int32 [n_docs + 1]
    max_seqlen: int


def varlen_layout(sequence_id: torch.Tensor) -> VarlenLayout:
    """Packed layout of `sequence_id` [batch, seq]: one sequence per run of equal ids per row.

    Tokens with id < 0 (padding) are left out. One host sync, for max_seqlen.
    """
    batch, seq_len = sequence_id.shape
    flat = sequence_id.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::seq_len] = True  # every row starts a document
    indices = torch.nonzero(flat >= 0).squeeze(1)
    doc_starts = torch.nonzero(starts[indices]).squeeze(1)
    total = torch.tensor([indices.numel()], device=flat.device)
    cu_seqlens = torch.cat([doc_starts, total]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if indices.numel() else 0
    return VarlenLayout(indices, cu_seqlens, max_seqlen)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """The `AttnFn` for attn_impl=flash (see attention.py for the contract)."""
    check_inputs(q)
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
    if k.shape[1] != q_len:
        raise NotImplementedError(
            "attn_impl='flash' with sequence_id needs queries for every key position (no cache)"
        )
    layout = mask.cached("flash_varlen", lambda: varlen_layout(mask.sequence_id))
    packed = [t.reshape(batch * q_len, t.shape[2], head_dim)[layout.indices] for t in (q, k, v)]
    out = varlen_fn(
        *packed,
        cu_seqlens_q=layout.cu_seqlens,
        cu_seqlens_k=layout.cu_seqlens,
        max_seqlen_q=layout.max_seqlen,
        max_seqlen_k=layout.max_seqlen,
        **options,
    )
    full = out.new_zeros(batch * q_len, n_heads, head_dim).index_copy(0, layout.indices, out)
    return full.view(batch, q_len, n_heads, head_dim).transpose(1, 2)
