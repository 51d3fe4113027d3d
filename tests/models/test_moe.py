"""The MoE layer: grouped experts against their loop, routing against a per-token reference,
and the block against transformers' Qwen3-MoE, Mixtral and Qwen2-MoE blocks."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from llmfoundry.models.layers.moe import GroupedExperts, MoE, MoESpec, grouped_mm_runs
from llmfoundry.utils.errors import UserError

D = 16


def _close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Relative to the tensor's scale (as the HF parity tests measure it)."""
    error = (actual.float() - expected.float()).abs().max()
    assert error <= rel * expected.float().abs().max(), (error, expected.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_their_loop(dtype):
    """The grouped multiply (taken here: torch 2.13's CPU kernel runs both dtypes) and the loop
    agree forward and backward, an expert with no tokens included."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, D, 32).to(dtype)
    assert experts._grouped(torch.empty(1, D, dtype=dtype)) and grouped_mm_runs("cpu", dtype)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, D, dtype=dtype, requires_grad=True)
    grouped = experts(x, counts)
    grouped.sum().backward()  # a broadcast gradient, which _grouped_mm's backward refuses raw
    grads = [p.grad.clone() for p in (x, *experts.parameters())]
    x.grad = None
    experts.zero_grad()
    looped = experts.looped(x, counts)
    looped.sum().backward()
    rel = 1e-5 if dtype == torch.float32 else 2e-2
    _close(grouped, looped, rel)
    for grad, param in zip(grads, (x, *experts.parameters()), strict=True):
        _close(grad, param.grad, rel)
    assert not experts.w_gate.grad[1].any()


def test_grouped_experts_fall_back_on_unaligned_rows():
    """Rows whose stride is not a multiple of 16 bytes take the loop (the kernel refuses them)."""
    experts = GroupedExperts(2, 6, 10)
    x = torch.randn(3, 6)
    assert not experts._grouped(x)
    with pytest.raises(RuntimeError):
        torch._grouped_mm(x, experts.w_gate.transpose(-2, -1), offs=torch.tensor([1, 3]).int())
    _close(experts(x, torch.tensor([1, 2])), experts.looped(x, torch.tensor([1, 2])))


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalise, the weighted sum of the chosen experts."""
    spec, experts = moe.spec, moe.experts
    outs = []
    for token in x.reshape(-1, x.shape[-1]):
        probs = torch.softmax(moe.router.gate.weight @ token, dim=-1)
        weights, chosen = probs.topk(spec.top_k)
        if spec.renormalize:
            weights = weights / weights.sum()
        out = torch.zeros_like(token)
        for weight, e in zip(weights, chosen.tolist(), strict=True):
            hidden = F.silu(experts.w_gate[e] @ token) * (experts.w_up[e] @ token)
            out = out + weight * (experts.w_down[e] @ hidden)
        if moe.shared_expert is not None:
            shared = moe.shared_expert(token)
            if moe.shared_expert_gate is not None:
                shared = torch.sigmoid(moe.shared_expert_gate(token)) * shared
            out = out + shared
        outs.append(out)
    return torch.stack(outs).reshape(x.shape)


@pytest.mark.parametrize(
    "spec",
    [
        MoESpec(n_experts=4, top_k=2, expert_hidden=32),
        MoESpec(n_experts=4, top_k=1, expert_hidden=32, renormalize=False),
        MoESpec(n_experts=6, top_k=3, expert_hidden=16, renormalize=False, shared_expert_hidden=24),
        MoESpec(
            n_experts=4, top_k=2, expert_hidden=32, shared_expert_hidden=24, shared_expert_gate=True
        ),
    ],
    ids=["top2-renorm", "top1", "top3-shared", "shared-gated"],
)
def test_moe_equals_per_token_reference(spec):
    torch.manual_seed(0)
    moe = MoE(D, spec)
    x = torch.randn(2, 5, D, requires_grad=True)
    out = moe(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    got = [p.grad.clone() for p in (x, *moe.parameters())]
    x.grad = None
    moe.zero_grad()
    expected = _reference(moe, x)
    expected.backward(grad)
    _close(out, expected)
    for name_grad, (name, param) in zip(got[1:], moe.named_parameters(), strict=True):
        assert param.grad is not None, name
        _close(name_grad, param.grad)
    _close(got[0], x.grad)


def _hf_config(cls, **fields):
    return cls(hidden_size=D, hidden_act="silu", **fields)


def _copy_into_hf(moe: MoE, block: torch.nn.Module) -> None:
    """transformers 5's fused expert layout: gate_up_proj [E, 2h, d] = [w_gate | w_up]."""
    with torch.no_grad():
        block.gate.weight.copy_(moe.router.gate.weight)
        block.experts.gate_up_proj.copy_(torch.cat([moe.experts.w_gate, moe.experts.w_up], 1))
        block.experts.down_proj.copy_(moe.experts.w_down)
        if moe.shared_expert is not None:
            block.shared_expert.load_state_dict(moe.shared_expert.state_dict())
        if moe.shared_expert_gate is not None:
            block.shared_expert_gate.load_state_dict(moe.shared_expert_gate.state_dict())


@pytest.mark.parametrize(
    ("block_cls", "config", "spec"),
    [
        (
            Qwen3MoeSparseMoeBlock,
            _hf_config(
                transformers.Qwen3MoeConfig,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=False,
            ),
            MoESpec(n_experts=8, top_k=2, expert_hidden=32, renormalize=False),
        ),
        (
            Qwen3MoeSparseMoeBlock,
            _hf_config(
                transformers.Qwen3MoeConfig,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
            ),
            MoESpec(n_experts=8, top_k=2, expert_hidden=32, renormalize=True),
        ),
        (
            MixtralSparseMoeBlock,
            _hf_config(
                transformers.MixtralConfig,
                num_local_experts=4,
                num_experts_per_tok=2,
                intermediate_size=32,
            ),
            MoESpec(n_experts=4, top_k=2, expert_hidden=32),
        ),
        (
            Qwen2MoeSparseMoeBlock,
            _hf_config(
                transformers.Qwen2MoeConfig,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                norm_topk_prob=False,
            ),
            MoESpec(
                n_experts=4,
                top_k=2,
                expert_hidden=32,
                renormalize=False,
                shared_expert_hidden=48,
                shared_expert_gate=True,
            ),
        ),
    ],
    ids=["qwen3-moe", "qwen3-moe-norm-topk", "mixtral", "qwen2-moe"],
)
def test_moe_block_parity_with_transformers(block_cls, config, spec):
    torch.manual_seed(0)
    moe = MoE(D, spec)
    block = block_cls(config).eval()
    _copy_into_hf(moe, block)
    x = torch.randn(2, 7, D)
    with torch.no_grad():
        _close(moe(x), block(x))


def test_training_forward_keeps_router_stats():
    """Training keeps the stats the losses read; evaluation keeps none."""
    torch.manual_seed(0)
    moe = MoE(D, MoESpec(n_experts=4, top_k=2, expert_hidden=32, aux_loss_weight=0.01))
    x = torch.randn(3, 4, D)
    with torch.no_grad():
        moe.eval()(x)
    assert moe.stats is None
    moe.train()(x)
    stats = moe.stats
    assert stats.rows == 12 and stats.counts.sum() == 24 and stats.counts.dtype == torch.int64
    assert stats.prob_sum.requires_grad and not stats.z_sum.requires_grad  # z weight is 0
    _close(stats.prob_sum.sum(), torch.tensor(12.0))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(top_k=5), "top_k must be in"),
        (dict(top_k=0), "top_k must be in"),
        (dict(expert_hidden=0), "expert_hidden >= 1"),
        (dict(shared_expert_gate=True), "set shared_expert_hidden > 0"),
        (dict(aux_loss_weight=-0.1), "loss weights must be >= 0"),
    ],
)
def test_moe_spec_refuses_bad_numbers(fields, message):
    with pytest.raises(UserError, match=message):
        MoESpec(**{"n_experts": 4, "top_k": 2, "expert_hidden": 8, **fields})
