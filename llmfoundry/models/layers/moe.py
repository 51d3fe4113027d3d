"""The mixture-of-experts feed-forward layer (Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert).

Read top to bottom: `MoESpec` (the numbers), `GroupedExperts` (E SwiGLU experts as three stacked
weights, one grouped matrix multiply per projection), `Router` (a linear layer to E logits),
`MoE` (route, sort the token copies by expert, run the experts, weight, add back), and the
router losses (`router_losses`: the load-balancing loss in transformers' form and ST-MoE's
z-loss over every MoE layer's last forward).

Routing is dropless: every token goes to its top_k experts whatever the load; the experts see
their token copies as one sorted [N, d] tensor and a count per expert, which is the seam expert
parallelism cuts at (it moves the sorted copies to the ranks owning their experts and back).

The grouped multiply is `torch._grouped_mm` where it runs (its row strides must be multiples of
16 bytes, and each device and dtype is tried once against the loop it replaces); elsewhere a
loop over the experts computes the same thing. Hand-written because torch has no public grouped
GEMM and the libraries that do (megablocks, grouped_gemm) are CUDA-only builds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.models.layers.ffn import GLU
from llmfoundry.utils.errors import UserError


@dataclass(frozen=True)
class MoESpec:
    """The numbers and choices of one MoE feed-forward layer; `DecoderSpec.moe` holds it."""

    n_experts: int
    top_k: int
    expert_hidden: int
    renormalize: bool = (
        True  # top-k weights renormalised to sum 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    )
    shared_expert_hidden: int = 0  # 0: none; > 0: a SwiGLU every token also goes through
    shared_expert_gate: bool = False  # Qwen2-MoE's sigmoid gate on the shared expert's output
    aux_loss_weight: float = 0.0  # load-balancing loss (transformers' load_balancing_loss_func)
    z_loss_weight: float = 0.0  # router z-loss (ST-MoE)

    def __post_init__(self) -> None:
        if self.n_experts < 1 or self.expert_hidden < 1:
            raise UserError(
                f"MoESpec needs n_experts >= 1 and expert_hidden >= 1, got {self.n_experts} "
                f"and {self.expert_hidden}"
            )
        if not 1 <= self.top_k <= self.n_experts:
            raise UserError(
                f"MoESpec.top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}"
            )
        if self.shared_expert_hidden < 0:
            raise UserError(
                f"MoESpec.shared_expert_hidden must be >= 0 (0: no shared expert), "
                f"got {self.shared_expert_hidden}"
            )
        if self.shared_expert_gate and not self.shared_expert_hidden:
            raise UserError(
                "MoESpec.shared_expert_gate gates the shared expert: set shared_expert_hidden > 0 "
                "or drop the gate"
            )
        if self.aux_loss_weight < 0 or self.z_loss_weight < 0:
            raise UserError(
                f"MoESpec loss weights must be >= 0, got aux_loss_weight={self.aux_loss_weight} "
                f"and z_loss_weight={self.z_loss_weight}"
            )


# --- the experts ---------------------------------------------------------------------------


def _rows_aligned(width: int, dtype: torch.dtype) -> bool:
    """torch._grouped_mm wants every row stride a multiple of 16 bytes."""
    return width * dtype.itemsize % 16 == 0


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward on this device and dtype and equals
    a loop of matmuls there: tried once (CUDA before sm90 and some builds lack it)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=generator).to(device_type, dtype).requires_grad_()
    w = torch.randn(3, 16, 16, generator=generator).to(device_type, dtype).requires_grad_()
    counts = [2, 0, 4]
    offsets = torch.tensor(counts, device=device_type).cumsum(0).to(torch.int32)
    try:
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError):
        return False
    loop = torch.cat(
        [xe @ we.T for xe, we in zip(x.detach().split(counts), w.detach(), strict=True)]
    )
    tolerance = 1e-2 if dtype.itemsize < 4 else 1e-5
    return torch.allclose(out.detach().float(), loop.float(), rtol=tolerance, atol=tolerance)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, in] (rows grouped by expert, group e ending at offsets[e]) @ weight[e].T."""
    return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


def _contiguous_grad(grad: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm's backward refuses a broadcast or strided gradient (`out.sum()`'s)."""
    return grad.contiguous()


class GroupedExperts(nn.Module):
    """E SwiGLU experts as three stacked weights (the EP seam shards dim 0):
    w_gate [E, hidden, d], w_up [E, hidden, d], w_down [E, d, hidden]; expert e computes
    w_down[e] @ (silu(w_gate[e] @ x) * (w_up[e] @ x)), nn.Linear's layout per expert."""

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default per expert: uniform within 1 / sqrt(fan_in)."""
        for weight in (self.w_gate, self.w_up, self.w_down):
            bound = weight.shape[-1] ** -0.5
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, d]: token copies sorted by expert, counts [E_local] (int64, sum N) -> [N, d]."""
        if self._grouped(x):
            offsets = counts.cumsum(0).to(torch.int32)
            hidden = F.silu(_grouped_linear(x, self.w_gate, offsets))
            hidden = hidden * _grouped_linear(x, self.w_up, offsets)
            out = _grouped_linear(hidden, self.w_down, offsets)
            if out.requires_grad:
                out.register_hook(_contiguous_grad)
            return out
        return self.looped(x, counts)

    def _grouped(self, x: torch.Tensor) -> bool:
        hidden = self.w_gate.shape[1]
        return (
            x.dtype == self.w_gate.dtype
            and _rows_aligned(x.shape[-1], x.dtype)
            and _rows_aligned(hidden, x.dtype)
            and grouped_mm_runs(x.device.type, x.dtype)
        )

    def looped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same as forward, one expert at a time (reads counts on the host)."""
        outs = [
            F.linear(F.silu(F.linear(xe, gate)) * F.linear(xe, up), down)
            for xe, gate, up, down in zip(
                x.split(counts.tolist()), self.w_gate, self.w_up, self.w_down, strict=True
            )
        ]
        return torch.cat(outs)


# --- routing ------------------------------------------------------------------------------


class Router(nn.Module):
    """`gate`: d_model -> E logits, no bias (transformers' `mlp.gate`)."""

    def __init__(self, d_model: int, n_experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)


@dataclass
class RouterStats:
    """One training forward's routing, what the router losses and the load metric read."""

    counts: torch.Tensor  # [E] int64: token copies each expert got (no grad)
    prob_sum: torch.Tensor  # [E] float32: router probabilities summed over tokens
    z_sum: torch.Tensor  # [] float32: logsumexp(logits)^2 summed over tokens
    rows: int  # tokens routed


class MoE(nn.Module):
    """Top-k routed experts, plus an optional shared expert: [B, L, d] -> [B, L, d].

    A training forward keeps its `RouterStats` in `self.stats` for the model's loss to read
    (`router_losses`); evaluation and generation keep nothing."""

    def __init__(self, d_model: int, spec: MoESpec) -> None:
        super().__init__()
        self.spec = spec
        self.router = Router(d_model, spec.n_experts)
        self.experts = GroupedExperts(spec.n_experts, d_model, spec.expert_hidden)
        self.shared_expert = (
            GLU(d_model, spec.shared_expert_hidden, bias=False, act="silu")
            if spec.shared_expert_hidden
            else None
        )
        self.shared_expert_gate = (
            nn.Linear(d_model, 1, bias=False) if spec.shared_expert_gate else None
        )
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)

        # Dropless dispatch: every (token, choice) copy, sorted by expert.
        flat_chosen = chosen.reshape(-1)
        order = flat_chosen.argsort(stable=True)
        token_of_copy = order // self.spec.top_k
        counts = torch.zeros(self.spec.n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_chosen, torch.ones_like(flat_chosen))
        expert_out = self.experts(x[token_of_copy], counts)
        expert_out = expert_out * weights.reshape(-1)[order].to(x.dtype).unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, token_of_copy, expert_out)

        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        if self.training:
            self.stats = self._stats(logits, probs, counts)
        return out.reshape(shape)

    def _stats(
        self, logits: torch.Tensor, probs: torch.Tensor, counts: torch.Tensor
    ) -> RouterStats:
        """The reductions the losses need; kept out of the graph when their weight is 0."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.spec.aux_loss_weight > 0):
            prob_sum = probs.sum(dim=0)
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.spec.z_loss_weight > 0):
            z_sum = torch.logsumexp(logits.float(), dim=-1).square().sum()
        return RouterStats(counts.detach(), prob_sum, z_sum, rows=logits.shape[0])
