"""Causal self-attention every family shares: the mask description and the torch/sdpa kernels.

The seam between a block and a kernel is one call,

    ATTN_IMPLS[name](q, k, v, mask, dropout_p, scale) -> [batch, n_heads, q_len, head_dim]

with q shaped [batch, n_heads, q_len, head_dim] and k, v [batch, kv_n_heads, k_len, head_dim]
(kv_n_heads divides n_heads: grouped-query attention; 1 is multi-query). `mask` is an
`AttentionMask`: a description of what each query may see (causality, ALiBi slopes when the
family's position scheme is ALiBi (position.py), sliding window, document ids), not a tensor.
Each kernel turns it into what it consumes (a dense additive bias for `torch` and `sdpa`, a
`score_mod` and `BlockMask` for `flex`, `alibi_slopes` and `cu_seqlens` for `flash`) through
`mask.cached(key, build, lengths)`, so the product is built once per forward and shared by every
layer; the part that does not depend on the batch is cached across forwards by the
`AttentionMasks` module that made the mask. The model gives that module the forward's lengths,
and the kernel's `prepare` (kernels.PREPARE) builds the products then, before the blocks run:
compiled blocks only read them, so they compile once more for a second sequence length (with
dynamic shapes) and not for a third. RoPE rotates q and k before the kernel; the mask never sees it.

`sdpa` runs one SDPA backend per call, chosen by `sdpa_plan` from the mask and the shapes:
flash (grouped-query heads as they are) for plain causal attention and a decoding step's
single query, which need no bias; the memory-efficient kernel, key/value heads expanded, for
any bias (ALiBi, a sliding window, documents, several queries after a cache); math only where
neither fits. On CUDA the call may use that backend alone, so a wrong plan fails instead of
silently falling back to math's [B, H, L, L] scores. MPT's ALiBi is always a bias, so MPT never
reaches sdpa's flash backend: its fast path is `flex`.

Positions: queries are the last `q_len` of the `k_len` key positions (bottom-right aligned, as
flash-attn's causal mode). A full forward has q_len == k_len; a decoding step with a cache of
past keys passes only the new queries and every key, and ALiBi, causality and document masking
line up without another argument. ALiBi is relative (-slope * (i - j)), so left padding does not
shift it either. Document ids (`sequence_id`, [batch, k_len]) cover the key positions; a query's
id is the one of its own position. A context-parallel rank's queries are not the last: its
mask carries their positions among the keys (`query_positions`, global positions, two runs),
and each kernel builds its product for those rows only: the dense bias's rows, a BlockMask
reading positions through them, flash-attn once per run with the keys cut at the run's end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmfoundry.models.layers.position import ALiBi, causal_alibi_bias

AttnFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "AttentionMask", float, float], torch.Tensor
]
# A kernel's preparation of a forward's mask for (q_len, k_len): see `AttentionMasks.forward`.
Prepare = Callable[["AttentionMask", int, int], None]


@dataclass(eq=False)
class AttentionMask:
    """What each query may attend to: causal, with the source's `alibi` bias (or none), sliding
    window (its `window`: keys at most window - 1 positions back) and document masking.

    Made once per model forward by `AttentionMasks` (its `source`) and passed to every layer.
    `sequence_id` is [batch, k_len] (None: every row is one document); `dtype` is the dtype the
    scores are computed in (autocast's). Kernels memoise what they derive from it with `cached`.
    `query_positions` [q_len] (ascending) are the queries' positions among the keys; None: the
    last q_len (the module docstring).
    """

    source: AttentionMasks
    sequence_id: torch.Tensor | None
    device: torch.device
    dtype: torch.dtype
    query_positions: torch.Tensor | None = None
    _built: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def alibi_slopes(self) -> torch.Tensor | None:
        """float32 [heads] on the mask's device (the source's `heads`), or None without ALiBi."""
        return self.source.slopes(self.device)

    def cached(
        self, key: Any, build: Callable[[], Any], lengths: tuple[int, int] | None = None
    ) -> Any:
        """`build()` the first time `key` is asked for in this forward, the same object after.

        A kernel's product for (q_len, k_len) passes those `lengths`: it is rebuilt when asked
        at others. They are compared, not part of the key: inside a compiled block, a dict
        lookup keyed by a length makes torch.compile specialise (and recompile) the block for
        every sequence length, while comparing stored lengths with the current ones holds for
        all of them once the lengths are dynamic.
        """
        entry = self._built.get(key)
        if entry is None or entry[0] != lengths:
            entry = self._built[key] = (lengths, build())
        return entry[1]

    def with_sequence_id(self, sequence_id: torch.Tensor | None) -> AttentionMask:
        """The same mask for other rows (e.g. a sequence cut into segments, or the keys up to
        a run of queries), its queries the last of them, with its own memo."""
        return AttentionMask(self.source, sequence_id, self.device, self.dtype)

    def query_sequence_id(self, q_len: int) -> torch.Tensor | None:
        """Document id of each query position: the last `q_len` columns of `sequence_id` (or
        those of `query_positions`)."""
        if self.sequence_id is None:
            return None
        if self.query_positions is not None:
            return self.sequence_id[:, self.query_positions]
        return self.sequence_id[:, -q_len:]

    def query_runs(self) -> list[tuple[int, int, int]]:
        """The contiguous runs of `query_positions` as (first query, end query, end key):
        queries [first, end) sit at key positions [end key - (end - first), end key). One host
        sync, once per forward (flash-attn's glue, which runs per run)."""

        def build() -> list[tuple[int, int, int]]:
            positions = self.query_positions.tolist()
            runs, first = [], 0
            for index in range(1, len(positions) + 1):
                if index == len(positions) or positions[index] != positions[index - 1] + 1:
                    runs.append((first, index, positions[index - 1] + 1))
                    first = index
            return runs

        return self.cached("query_runs", build)

    def is_plain(self) -> bool:
        """Causality alone: no ALiBi, no sliding window, no documents, queries last."""
        src = self.source
        plain = src.alibi is None and src.window is None and self.sequence_id is None
        return plain and self.query_positions is None

    def needs_bias(self, q_len: int, k_len: int) -> bool:
        """Whether a kernel without masks of its own needs `dense_bias`: not for plain causal
        attention whose queries are every key position (is_causal) or only the last one (a
        decoding step sees every key: no mask at all)."""
        return not (self.is_plain() and q_len in (k_len, 1))

    def dense_bias(self, q_len: int, k_len: int) -> torch.Tensor | None:
        """Additive float bias broadcastable to [batch, n_heads, q_len, k_len], or None.

        It holds ALiBi, causality (-inf for future keys), the sliding window and the document
        mask (-inf across documents). None means plain causal attention with q_len == k_len
        and nothing else, which lets `sdpa` take its fastest (is_causal) path. Its strides
        are multiples of 8 elements (the cache's side is; a document mask's rows are padded),
        so SDPA's memory-efficient kernel takes it without the aligned copy it would make in
        every layer.
        """
        if self.is_plain() and q_len == k_len:
            return None
        return self.cached("dense", lambda: self._dense(q_len, k_len), (q_len, k_len))

    def _dense(self, q_len: int, k_len: int) -> torch.Tensor:
        if self.query_positions is None:
            full = self.source.causal_bias(k_len, self.device, self.dtype)
            bias = full[..., k_len - q_len : k_len, :k_len]
        else:  # only these rows, never the L x L cache (a context-parallel rank's)
            bias = self.source.causal_bias_rows(self.query_positions, k_len, self.dtype)
        if self.sequence_id is not None:
            q_sid = self.query_sequence_id(q_len)
            other_doc = q_sid[:, None, :, None] != self.sequence_id[:, None, None, :]
            rows = (other_doc.shape[0], bias.shape[1], q_len, _aligned(k_len))
            aligned = bias.new_empty(rows)[..., :k_len].copy_(bias)
            bias = aligned.masked_fill_(other_doc, float("-inf"))
        return bias


def _aligned(n: int) -> int:
    """`n` rounded up to a multiple of 8, the row alignment SDPA's efficient kernel needs of a
    bias (torch copies an unaligned one into an aligned buffer on every call)."""
    return -(-n // 8) * 8


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

    `prepare` is the model's kernel's preparation (kernels.PREPARE): given the forward's
    lengths, `forward` builds what the kernel will ask of the mask before any block runs.
    """

    def __init__(
        self,
        n_heads: int,
        max_seq_len: int,
        alibi: ALiBi | None = None,
        window: int | None = None,
        prepare: Prepare | None = None,
    ) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.window = window
        self.max_seq_len = max_seq_len
        self.alibi = alibi
        self.prepare = prepare
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
        max_seq_len rounded up to a multiple of 8 (`dense_bias`; the memory planner counts
        it)."""
        size = _aligned(max(seq_len, self.max_seq_len))
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

    def causal_bias_rows(
        self, queries: torch.Tensor, k_len: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The rows `queries` (positions among `k_len` keys) of the causal bias, [1, len(heads)
        or 1, len(queries), k_len] (row-aligned as `dense_bias` says), built anew: equal to the
        full bias's rows, without building or caching the full one."""
        bias_max = None if self.alibi is None else self.alibi.bias_max
        aligned = causal_alibi_bias(
            self.n_heads, _aligned(k_len), bias_max, queries.device, dtype, self.window,
            self.heads, queries,
        )  # fmt: skip
        return aligned[..., :k_len]

    def shared_cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """Like `AttentionMask.cached`, but kept across forwards (for batch-free products)."""
        if key not in self._shared:
            self._shared[key] = build()
        return self._shared[key]

    def forward(
        self,
        sequence_id: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
        lengths: tuple[int, int] | None = None,
        query_positions: torch.Tensor | None = None,
    ) -> AttentionMask:
        """This forward's mask (its queries at `query_positions` among the keys, None: the
        last ones); with the `lengths` (q_len, k_len) its attention will have, the
        kernel's products (a dense bias, a BlockMask, a packed layout) are built now, in the
        model's forward, outside the compiled blocks: built inside one, they would be traced
        into it (inductor's CPU lowering refuses FlexAttention's), and looked up there in a
        cache keyed by length, they would recompile it per length."""
        mask = AttentionMask(self, sequence_id, device, dtype, query_positions)
        if self.prepare is not None and lengths is not None:
            self.prepare(mask, *lengths)
        return mask


def prepare_dense(mask: AttentionMask, q_len: int, k_len: int) -> None:
    """The `Prepare` of the torch and sdpa kernels: the forward's dense bias, when the mask
    needs one (a plain decoding step needs none, nor its causal cache)."""
    if mask.needs_bias(q_len, k_len):
        mask.dense_bias(q_len, k_len)


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


@dataclass(frozen=True)
class SdpaPlan:
    """How `sdpa_attention` calls F.scaled_dot_product_attention for one mask and shape.

    `kernel`: the one SDPA backend allowed ("flash", "efficient" or "math"; on CUDA it runs
    under `sdpa_kernel` of that backend alone, so a case it cannot take fails loudly instead of
    falling back to math). `bias`: the mask goes in as `dense_bias`; otherwise `causal` says
    whether it is is_causal or nothing at all (a decoding step's one query sees every key).
    `expand_kv`: the key/value heads are repeated to the query heads first, for the efficient
    kernel, which takes no grouped-query heads (torch 2.11 to 2.13).
    """

    kernel: str
    bias: bool
    causal: bool
    expand_kv: bool = False


SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_plan(
    mask: AttentionMask,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    dtype: torch.dtype,
    dropout_p: float = 0.0,
    device_type: str = "cuda",
    capability: tuple[int, int] = (9, 0),
) -> SdpaPlan:
    """The best fused SDPA backend `mask` permits for q [B, H, Lq, D], k [B, Hkv, Lk, D] in
    `dtype`, on a CUDA device of compute `capability` (torch's sdp_utils rules).

    Flash (sm80+, fp16/bf16, head_dim <= 256, grouped-query heads as they are) takes no bias:
    only plain causal attention (is_causal) and a decoding step's single query (no mask). Any
    bias (ALiBi, a sliding window, documents, several queries after a cache) goes to the
    memory-efficient kernel with key/value heads expanded to the query heads, which costs
    [B, H, Lk, D] copies instead of math's [B, H, Lq, Lk] scores. Math is left for head dims
    the efficient kernel cannot take. MPT's ALiBi always needs the bias, so MPT on sdpa never
    reaches flash: attn_impl=flex is MPT's fast path. On CPU, torch's flash kernel takes any
    bias and grouped heads but no dropout (nothing is enforced there).
    """
    n_heads, q_len, head_dim = q_shape[1], q_shape[2], q_shape[3]
    kv_heads, k_len = k_shape[1], k_shape[2]
    bias = mask.needs_bias(q_len, k_len)
    causal = not bias and q_len == k_len
    if device_type != "cuda":
        return SdpaPlan("flash" if dropout_p == 0 else "math", bias, causal)
    half = dtype in (torch.float16, torch.bfloat16)
    if not bias and half and capability >= (8, 0) and head_dim <= _flash_head_dim(capability):
        return SdpaPlan("flash", bias, causal)
    # The efficient kernel: sm50+, bf16 from sm80; head_dim a multiple of the GEMM alignment.
    alignment = 8 if half else (4 if capability >= (8, 0) else 1)
    dtype_ok = dtype != torch.bfloat16 or capability >= (8, 0)
    if capability >= (5, 0) and dtype_ok and head_dim % alignment == 0:
        return SdpaPlan("efficient", bias, causal, expand_kv=kv_heads != n_heads)
    return SdpaPlan("math", bias, causal)


def _flash_head_dim(capability: tuple[int, int]) -> int:
    """The largest head_dim SDPA's flash kernel trains with: 192 on sm86-89 and sm12x (torch
    refuses (192, 256] there when gradients are needed), else 256."""
    return 192 if (8, 6) <= capability <= (8, 9) or capability[0] == 12 else 256


@torch.compiler.assume_constant_result
def _capability_number(device: torch.device) -> int:
    """A CUDA `device`'s compute capability as major * 10 + minor, a constant to torch.compile.
    An int, not the (major, minor) tuple: torch 2.11's dynamo fails (InternalTorchDynamoError)
    comparing a tuple such a function returned, which broke compiled blocks on sdpa on a GPU."""
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA `device`, (0, 0) elsewhere; safe to call
    inside compiled blocks."""
    if device.type != "cuda":
        return (0, 0)
    number = _capability_number(device)
    return (number // 10, number % 10)


def plan_for(q: torch.Tensor, k: torch.Tensor, mask: AttentionMask, dropout_p: float) -> SdpaPlan:
    """`sdpa_plan` of these tensors on their device, in the dtype the scores will have."""
    capability = device_capability(q.device)
    return sdpa_plan(mask, q.shape, k.shape, compute_dtype(q), dropout_p, q.device.type, capability)


def sdpa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """PyTorch's fused scaled_dot_product_attention on the backend `sdpa_plan` chooses; the
    dense bias, when the plan needs one, goes in as its attn_mask."""
    plan = plan_for(q, k, mask, dropout_p)
    bias = mask.dense_bias(q.shape[-2], k.shape[-2]) if plan.bias else None
    if plan.expand_kv:
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    only = sdpa_kernel(SDPA_BACKENDS[plan.kernel]) if q.is_cuda else contextlib.nullcontext()
    with only:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=bias,
            dropout_p=dropout_p,
            is_causal=plan.causal,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
