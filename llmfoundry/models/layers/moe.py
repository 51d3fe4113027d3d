"""The mixture-of-experts feed-forward layer (Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert).

Read top to bottom: `MoESpec` (the numbers), `GroupedExperts` (E SwiGLU experts as three stacked
weights, one grouped matrix multiply per projection), `Router` (a linear layer to E logits),
`MoE` (route, sort the token copies by expert, run the experts, weight, add back), the router
losses (`router_losses`: the load-balancing loss in transformers' form per layer and ST-MoE's
z-loss over every MoE layer's last training forward) and `RouterLossMeter`, through which a
model adds them to its loss and logs them.

Routing is dropless: every token goes to its top_k experts whatever the load; the experts see
their token copies as one sorted [N, d] tensor and a count per expert, which is the seam expert
parallelism cuts at (it moves the sorted copies to the ranks owning their experts and back).

The grouped multiply is `torch._grouped_mm` where it runs (its row strides must be multiples of
16 bytes, each device and dtype is tried once against the loop it replaces, under autocast it
computes in autocast's dtype as F.linear would, and under torch.compile only bfloat16 traces:
such a block compiles whole); elsewhere a loop over the experts computes the same thing
(reading the counts on the host). Hand-written because torch has no public grouped GEMM and the
libraries that have one (megablocks, grouped_gemm) are CUDA-only builds.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.core.metrics import DeviceScalar
from llmfoundry.models.layers.ffn import GLU
from llmfoundry.utils.errors import UserError


@dataclass(frozen=True)
class MoESpec:
    """The numbers and choices of one MoE feed-forward layer; `DecoderSpec.moe` holds it."""

    n_experts: int
    top_k: int
    expert_hidden: int
    # top-k weights renormalised to sum 1 (Mixtral; Qwen3-MoE's norm_topk_prob)
    renormalize: bool = True
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


_GROUPED_MM_RUNS: dict[tuple[str, torch.dtype], bool] = {}


@torch.compiler.assume_constant_result  # torch.compile reads the answer, not the probe
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward on this device and dtype and equals
    a loop of matmuls there: tried once (CUDA before sm90 and some builds lack it)."""
    key = (device_type, dtype)
    if key not in _GROUPED_MM_RUNS:
        cuda = device_type == "cuda"
        device = torch.device(device_type, torch.cuda.current_device() if cuda else None)
        # In a thread of its own, which has grad mode on and no saved-tensor hooks or dispatch
        # modes (all thread-local): the first call comes from a forward, which may run under
        # no_grad (evaluation: the probe's backward would fail, and take the loop for good) or
        # inside activation checkpointing (which would count the probe's ops as the layer's
        # and miss them on recompute).
        with ThreadPoolExecutor(max_workers=1) as thread:
            _GROUPED_MM_RUNS[key] = thread.submit(_grouped_mm_probe, device, dtype).result()
    return _GROUPED_MM_RUNS[key]


def _grouped_mm_probe(device: torch.device, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=generator).to(device, dtype).requires_grad_()
    w = torch.randn(3, 16, 16, generator=generator).to(device, dtype).requires_grad_()
    counts = [2, 0, 4]
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
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


def _linear_dtype(t: torch.Tensor, device_type: str) -> torch.dtype:
    """The dtype F.linear computes `t` in: under autocast on `device_type` its lower precision
    (autocast casts every floating operand but float64), else t's own."""
    if (
        torch.is_autocast_enabled(device_type)
        and t.is_floating_point()
        and t.dtype != torch.float64
    ):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


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

    @torch.no_grad()
    def init_weights(self, std: float | None) -> None:
        """As a model initialises its nn.Linear weights, per expert: N(0, std), or without a
        std kaiming-normal over each expert's fan_in (torch's kaiming_normal_ would read a 3-d
        weight's fan_in as E-wide convolution channels)."""
        for weight in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(weight, std=(2 / weight.shape[-1]) ** 0.5 if std is None else std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, d]: token copies sorted by expert, counts [E_local] (int64, sum N) -> [N, d]."""
        if self._grouped(x):
            # torch._grouped_mm is no autocast op: cast as autocast casts F.linear's operands
            # (a no-op outside autocast), so amp_bf16 runs the experts in bf16 as the loop would.
            dtype = _linear_dtype(x, x.device.type)
            x = x.to(dtype)
            w_gate, w_up, w_down = (w.to(dtype) for w in (self.w_gate, self.w_up, self.w_down))
            offsets = counts.cumsum(0).to(torch.int32)
            hidden = F.silu(_grouped_linear(x, w_gate, offsets))
            hidden = hidden * _grouped_linear(x, w_up, offsets)
            out = _grouped_linear(hidden, w_down, offsets)
            if out.requires_grad:
                out.register_hook(_contiguous_grad)
            return out
        return self.looped(x, counts)

    def _grouped(self, x: torch.Tensor) -> bool:
        """Whether forward takes the grouped multiply, in the dtype F.linear would compute in."""
        hidden, device = self.w_gate.shape[1], x.device.type
        dtype = _linear_dtype(x, device)
        return (
            dtype == _linear_dtype(self.w_gate, device)
            # torch.compile's shape function for _grouped_mm takes bfloat16 only (2.11, 2.13)
            and (dtype == torch.bfloat16 or not torch.compiler.is_compiling())
            and _rows_aligned(x.shape[-1], dtype)
            and _rows_aligned(hidden, dtype)
            and grouped_mm_runs(device, dtype)
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


def pipeline_refusal(spec: MoESpec) -> str:
    """Why a model with these MoE layers cannot train as pipeline stages, "" when it can: the
    router losses are taken over every layer's routing of a microbatch at its loss, and a
    pipeline stage passes on only its activations (`ParallelPlan.pipeline_refusal`)."""
    if spec.aux_loss_weight > 0 or spec.z_loss_weight > 0:
        return (
            "the MoE router losses (aux_loss_weight, z_loss_weight > 0) need every stage's "
            "routing at the loss, which pipeline stages do not pass on; set both to 0"
        )
    return ""


# --- the router losses ----------------------------------------------------------------------


@dataclass(frozen=True)
class RouterLosses:
    """The unweighted router losses of one training forward over all its MoE layers."""

    # [] load balancing, the mean over layers of n_experts * sum_e load_e * mean_prob_e
    # (top_k when even)
    aux: torch.Tensor
    z: torch.Tensor  # [] mean over tokens and layers of logsumexp(router logits)^2
    counts: torch.Tensor  # [layers, E] int64: token copies each layer's experts got


def router_losses(layers: Iterable[MoE]) -> RouterLosses | None:
    """The losses over the MoE layers' last training forward (None when none kept stats).

    The load-balancing loss is transformers' `load_balancing_loss_func` taken per layer and
    averaged over the layers (as Switch, GShard, Megatron and torchtitan take it), not of the
    concatenation of every layer's logits that transformers' Mixtral and Qwen3-MoE pass it:
    pooled, an expert's load is averaged over the layers, so one layer overloading its expert e
    while another underloads its own e costs nothing and the router gets no gradient toward
    balance (bench/moe.py's MoE stayed 2.6-3x unbalanced per layer that way, its aux loss at
    its balanced value). Both are top_k at even routing, so `router_aux_loss_coef` means the
    same. The z-loss is switch_transformers' `router_z_loss_func`, the mean over every layer's
    tokens."""
    stats = [layer.stats for layer in layers if layer.stats is not None]
    if not stats:
        return None
    n_experts = stats[0].counts.numel()
    per_layer = [n_experts * (s.counts.float() * s.prob_sum).sum() / s.rows**2 for s in stats]
    aux = torch.stack(per_layer).mean()
    z = torch.stack([s.z_sum for s in stats]).sum() / sum(s.rows for s in stats)
    counts = torch.stack([s.counts for s in stats])
    return RouterLosses(aux, z, counts)


class RouterLossMeter:
    """What a model with MoE layers adds to its loss, and logs.

    `loss(model)`, called by the model's loss after each training forward, returns the weighted
    router losses to add (so under gradient accumulation each microbatch's router losses are
    weighted as its next-token loss is) and sums them and the expert loads on the device;
    `metrics()` returns the means since the last call as `DeviceScalar`s and starts over, so
    the loads cost no host sync until a logger writes them (one for all, `read_all`). They are
    this rank's tokens. Under pipeline parallelism (router loss weights 0, `pipeline_refusal`)
    only the last stage runs the loss, so rank 0, which logs, has none to log."""

    def __init__(self, spec: MoESpec) -> None:
        self.spec = spec
        self._sums: torch.Tensor | None = None  # [2]: aux, z summed over forwards
        self._counts: torch.Tensor | None = None  # [layers, E] summed over forwards
        self._forwards = 0

    def loss(self, model: nn.Module) -> torch.Tensor | None:
        """The weighted router losses of the training forward just run; None after an eval
        forward, or when both weights are 0 (nothing added, not even 0 * an overflowed z).
        Each layer's stats are read once."""
        layers = [m for m in model.modules() if isinstance(m, MoE)]
        losses = router_losses(layers)
        for layer in layers:
            layer.stats = None
        if losses is None:
            return None
        sums = torch.stack([losses.aux, losses.z]).detach()
        if self._sums is None or self._counts is None:
            self._sums, self._counts = sums, losses.counts
        else:
            self._sums, self._counts = self._sums + sums, self._counts + losses.counts
        self._forwards += 1
        weighted = [
            weight * loss
            for weight, loss in (
                (self.spec.aux_loss_weight, losses.aux),
                (self.spec.z_loss_weight, losses.z),
            )
            if weight > 0
        ]
        return sum(weighted[1:], weighted[0]) if weighted else None

    def metrics(self) -> dict[str, DeviceScalar]:
        """train/moe_aux_loss and train/moe_z_loss (unweighted, mean over the forwards since
        the last call), and the expert load imbalance: max / mean token copies per expert,
        1 when even, averaged over layers and the worst layer's."""
        if self._sums is None or self._counts is None:
            return {}
        means = self._sums / self._forwards
        counts = self._counts.float()
        imbalance = counts.amax(dim=-1) / counts.mean(dim=-1)
        self._sums, self._counts, self._forwards = None, None, 0
        return {
            "train/moe_aux_loss": DeviceScalar(means[0]),
            "train/moe_z_loss": DeviceScalar(means[1]),
            "train/moe_load_imbalance": DeviceScalar(imbalance.mean()),
            "train/moe_load_imbalance_max": DeviceScalar(imbalance.max()),
        }
