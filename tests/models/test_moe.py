"""The MoE layer: grouped experts against their loop, routing against a per-token reference,
the block against transformers' Qwen3-MoE, Mixtral and Qwen2-MoE blocks, the router losses
against transformers'; and in the shared decoder: its init, loss, metrics, active flops, the
pipeline refusal, and a training run that reads nothing from the device between log intervals."""

import dataclasses
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch.utils.checkpoint import checkpoint
from transformers.models.mixtral.modeling_mixtral import (
    MixtralSparseMoeBlock,
    load_balancing_loss_func,
)
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
from transformers.models.switch_transformers.modeling_switch_transformers import (
    router_z_loss_func,
)

import llmfoundry.models.layers.moe as moe_layer
from llmfoundry.core.loss import next_token_loss
from llmfoundry.distributed.pipeline import check_pipeline_split
from llmfoundry.loggers import JSONLLogger
from llmfoundry.models.decoder_plan import decoder_plan
from llmfoundry.models.layers.decoder import DecoderLM, DecoderSpec
from llmfoundry.models.layers.moe import (
    GroupedExperts,
    MoE,
    MoESpec,
    RouterLosses,
    RouterLossMeter,
    grouped_mm_runs,
    router_losses,
)
from llmfoundry.trainer import Callback, Trainer
from llmfoundry.utils.errors import UserError
from llmfoundry.utils.jsonl import read_jsonl

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


def test_grouped_experts_compute_in_the_autocast_dtype():
    """Under autocast (amp_bf16: float32 weights) the experts compute in bfloat16 as F.linear
    would, taking the grouped multiply, equal to the loop (which autocast casts itself), and
    the gradient reaches the float32 weights."""
    torch.manual_seed(0)
    experts = GroupedExperts(4, D, 32)
    counts = torch.tensor([3, 0, 5, 2])
    x = torch.randn(10, D, requires_grad=True)
    results = []
    for path in (experts.forward, experts.looped):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert experts._grouped(x)
            out = path(x, counts)
        out.float().square().sum().backward()
        results.append((out, [p.grad.clone() for p in (x, *experts.parameters())]))
        x.grad = None
        experts.zero_grad()
    (grouped, grads), (looped, loop_grads) = results
    assert grouped.dtype == looped.dtype == torch.bfloat16
    _close(grouped, looped, 2e-2)
    for grad, loop_grad, param in zip(grads, loop_grads, (x, *experts.parameters()), strict=True):
        assert grad.dtype == param.dtype == torch.float32
        _close(grad, loop_grad, 2e-2)


def test_the_grouped_mm_probe_does_not_depend_on_the_callers_grad_mode(monkeypatch):
    """The first MoE forward of a process may be an evaluation's or generate's (no_grad,
    inference_mode): the probe still runs its backward, so every later forward takes the path
    the device supports, not the one the first caller's grad mode allowed."""
    from llmfoundry.models.layers import moe

    answers = []
    for mode in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        monkeypatch.setattr(moe, "_GROUPED_MM_RUNS", {})
        with mode():
            answers.append(grouped_mm_runs("cpu", torch.float32))
    assert answers == [True] * 3  # torch 2.13's CPU kernel runs float32


def test_grouped_experts_fall_back_on_unaligned_rows():
    """Rows whose stride is not a multiple of 16 bytes take the loop (the kernel refuses them)."""
    experts = GroupedExperts(2, 6, 10)
    x = torch.randn(3, 6)
    assert not experts._grouped(x)
    with pytest.raises(RuntimeError):
        torch._grouped_mm(x, experts.w_gate.transpose(-2, -1), offs=torch.tensor([1, 3]).int())
    _close(experts(x, torch.tensor([1, 2])), experts.looped(x, torch.tensor([1, 2])))


@pytest.mark.parametrize("std", [0.5, None])
def test_grouped_experts_init_per_expert(std):
    """N(0, std), or kaiming-normal with each expert's fan_in (d for w_gate, hidden for w_down)."""
    torch.manual_seed(0)
    experts = GroupedExperts(8, 64, 256)
    experts.init_weights(std)
    for weight, fan_in in ((experts.w_gate, 64), (experts.w_down, 256)):
        expected = std if std is not None else (2 / fan_in) ** 0.5
        assert weight.std().item() == pytest.approx(expected, rel=0.02)


def test_grouped_experts_take_the_loop_where_the_kernel_fails(monkeypatch):
    """A device and dtype whose _grouped_mm raises (CUDA before sm90, say) is tried once and
    then takes the loop, with the same result."""

    def refuse(*args, **kwargs):
        raise RuntimeError("grouped gemm is not supported on this device")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    monkeypatch.setattr(moe_layer, "_GROUPED_MM_RUNS", {})
    experts = GroupedExperts(2, D, 16)
    x, counts = torch.randn(5, D), torch.tensor([2, 3])
    assert not experts._grouped(x) and moe_layer._GROUPED_MM_RUNS == {("cpu", torch.float32): False}
    _close(experts(x, counts), experts.looped(x, counts))


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


def _layers(n: int, spec: MoESpec) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(MoE(D, spec) for _ in range(n))
    with torch.no_grad():
        for layer in layers:  # logits far from uniform, so the loads differ
            layer.router.gate.weight.mul_(4)
    return layers


def test_router_losses_equal_transformers():
    """Over two layers: the load-balancing loss is the mean of transformers'
    load_balancing_loss_func over each layer's logits, and the z-loss switch_transformers'
    router_z_loss_func over all of them, values and the router's gradients."""
    spec = MoESpec(n_experts=4, top_k=2, expert_hidden=16, aux_loss_weight=1, z_loss_weight=1)
    layers = _layers(2, spec)
    xs = [torch.randn(3, 5, D), torch.randn(3, 5, D)]
    for layer, x in zip(layers, xs, strict=True):
        layer(x)
    ours = router_losses(layers)
    logits = [layer.router.gate(x.reshape(-1, D)) for layer, x in zip(layers, xs, strict=True)]
    per_layer = [load_balancing_loss_func((x,), num_experts=4, top_k=2) for x in logits]
    theirs_aux = torch.stack(per_layer).mean()
    theirs_z = router_z_loss_func(torch.cat(logits)[None])
    _close(ours.aux, theirs_aux)
    _close(ours.z, theirs_z)
    assert ours.counts.tolist() != [[15] * 4] * 2 and ours.counts.sum() == 2 * 15 * 2
    weights = [layer.router.gate.weight for layer in layers]
    for ours_loss, theirs_loss in ((ours.aux, theirs_aux), (ours.z, theirs_z)):
        got = torch.autograd.grad(ours_loss, weights, retain_graph=True)
        expected = torch.autograd.grad(theirs_loss, weights, retain_graph=True)
        for g, e in zip(got, expected, strict=True):
            _close(g, e)


def test_the_aux_loss_balances_each_layer():
    """Two layers each sending every token to one expert, layer 0 to expert 0 and layer 1 to
    expert 1: pooled over the layers (transformers' concatenation) the loads look even, the
    loss sits at its balanced value (top_k) and the routers get no gradient; per layer the loss
    is above it, and a step down its gradient lowers each layer's favourite's probability."""
    spec = MoESpec(n_experts=2, top_k=1, expert_hidden=16, aux_loss_weight=1)
    layers = _layers(2, spec)
    x = torch.randn(4, 8, D)
    with torch.no_grad():
        for favourite, layer in enumerate(layers):  # logits +-mean(x), all one way
            sign = torch.tensor([1.0, -1.0] if favourite == 0 else [-1.0, 1.0])
            layer.router.gate.weight.copy_(sign[:, None].expand(2, D) / D)
        x = x.abs()  # mean(x) > 0 for every token
    for layer in layers:
        layer(x)
    assert router_losses(layers).counts.tolist() == [[32, 0], [0, 32]]
    aux = router_losses(layers).aux
    assert aux > 1.2  # top_k = 1 when even
    weights = [layer.router.gate.weight for layer in layers]
    grads = torch.autograd.grad(aux, weights)
    before = [torch.softmax(layer.router(x.reshape(-1, D)), -1).mean(0) for layer in layers]
    with torch.no_grad():
        for weight, grad in zip(weights, grads, strict=True):
            assert grad.abs().sum() > 0
            weight.sub_(0.1 * grad)
    for favourite, (layer, prob) in enumerate(zip(layers, before, strict=True)):
        after = torch.softmax(layer.router(x.reshape(-1, D)), -1).mean(0)
        assert after[favourite] < prob[favourite]


def test_meter_weights_losses_and_averages_metrics():
    """loss() adds aux_loss_weight * aux + z_loss_weight * z and reads each forward once;
    metrics() averages the forwards since the last call and starts over."""
    spec = MoESpec(n_experts=4, top_k=2, expert_hidden=16, aux_loss_weight=0.01, z_loss_weight=1e-3)
    layers = _layers(2, spec)
    meter = RouterLossMeter(spec)
    seen = []
    for _ in range(2):
        for layer in layers:
            layer(torch.randn(2, 6, D))
        losses = router_losses(layers)
        seen.append(RouterLosses(losses.aux.detach(), losses.z.detach(), losses.counts))
        _close(meter.loss(layers), 0.01 * losses.aux + 1e-3 * losses.z)
        assert meter.loss(layers) is None  # read once
    metrics = {key: float(value) for key, value in meter.metrics().items()}
    counts = (seen[0].counts + seen[1].counts).float()
    imbalance = counts.amax(-1) / counts.mean(-1)
    assert metrics == pytest.approx(
        {
            "train/moe_aux_loss": float(seen[0].aux + seen[1].aux) / 2,
            "train/moe_z_loss": float(seen[0].z + seen[1].z) / 2,
            "train/moe_load_imbalance": float(imbalance.mean()),
            "train/moe_load_imbalance_max": float(imbalance.max()),
        }
    )
    assert metrics["train/moe_load_imbalance_max"] > 1
    assert meter.metrics() == {}


def test_router_loss_gradients_survive_activation_checkpointing():
    """The stats a checkpointed forward keeps still carry the router's gradient (the repo's
    activation checkpointing is non-reentrant)."""
    spec = MoESpec(n_experts=4, top_k=2, expert_hidden=16, aux_loss_weight=0.1, z_loss_weight=0.1)
    x = torch.randn(2, 6, D)
    grads = []
    for checkpointed in (False, True):
        layers = _layers(1, spec)
        out = checkpoint(layers[0], x, use_reentrant=False) if checkpointed else layers[0](x)
        (out.square().mean() + RouterLossMeter(spec).loss(layers)).backward()
        grads.append(layers[0].router.gate.weight.grad)
    _close(grads[1], grads[0])


# --- in the shared decoder --------------------------------------------------------------------

MOE = MoESpec(n_experts=3, top_k=2, expert_hidden=16, aux_loss_weight=0.01, z_loss_weight=1e-3)


@dataclasses.dataclass
class SpecConfig:
    """The least a family config gives the decoder: its spec and where to build."""

    spec: DecoderSpec
    init_device: str = "cpu"

    def decoder_spec(self) -> DecoderSpec:
        return self.spec


def decoder_spec(**overrides) -> DecoderSpec:
    fields = dict(d_model=32, n_layers=2, vocab_size=64, max_seq_len=16, n_heads=2, n_kv_heads=2)
    fields |= dict(head_dim=16, ffn="moe", moe=MOE, init_std=0.1)
    return DecoderSpec(**(fields | overrides))


def moe_decoder(init_device: str = "cpu", **overrides) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(SpecConfig(decoder_spec(**overrides), init_device))


def test_the_decoder_builds_inits_and_trains_its_moe():
    """ffn='moe' builds the MoE under HF's names; init draws the experts as the other matrices
    (down projections scaled by 1/sqrt(2 n_layers)); a training forward's loss adds the
    weighted router losses, an eval forward's does not; train_metrics logs them."""
    model = moe_decoder(moe=dataclasses.replace(MOE, shared_expert_hidden=16))
    keys = [k for k in model.state_dict() if k.startswith("transformer.blocks.0.ffn.")]
    assert keys == [
        f"transformer.blocks.0.ffn.{name}"
        for name in ("router.gate.weight", "experts.w_gate", "experts.w_up", "experts.w_down")
        + tuple(f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down"))
    ]
    ffn = model.transformer.blocks[0].ffn
    assert ffn.experts.w_gate.std().item() == pytest.approx(0.1, rel=0.1)
    assert ffn.experts.w_down.std().item() == pytest.approx(0.05, rel=0.1)  # 0.1 / sqrt(4)
    assert ffn.shared_expert.down_proj.weight.std().item() == pytest.approx(0.05, rel=0.15)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    losses = router_losses(m for m in model.modules() if isinstance(m, MoE))
    loss = model.loss(logits, ids)
    _close(loss, next_token_loss(logits, ids) + 0.01 * losses.aux + 1e-3 * losses.z)
    loss.backward()
    assert ffn.router.gate.weight.grad.abs().sum() > 0
    metrics = model.train_metrics()
    assert float(metrics["train/moe_aux_loss"]) == pytest.approx(losses.aux.item())
    assert set(metrics) == {
        "train/moe_aux_loss",
        "train/moe_z_loss",
        "train/moe_load_imbalance",
        "train/moe_load_imbalance_max",
    }
    with torch.no_grad():
        logits = model.eval()(ids)
        assert torch.equal(model.loss(logits, ids), next_token_loss(logits, ids))
    assert model.train_metrics() == {}


def test_a_spec_refuses_moe_numbers_without_ffn_moe():
    with pytest.raises(UserError, match="goes with ffn='moe' and only with it"):
        decoder_spec(ffn="glu", ffn_hidden=32)
    with pytest.raises(UserError, match="goes with ffn='moe' and only with it"):
        decoder_spec(moe=None)


def test_flops_count_the_active_parameters():
    """A tiny MoE (3 experts of 16, top 2, router 32 x 3) has the active parameters of a dense
    GLU of 2 * 16 + 1 = 33 hidden units: the same flops per token (the speed monitor's MFU
    reads them), while it holds more parameters."""
    moe = moe_decoder("meta")
    dense = DecoderLM(SpecConfig(decoder_spec(ffn="glu", ffn_hidden=33, moe=None), "meta"))
    assert moe.num_params(active=True) == dense.num_params()
    assert moe.flops_per_token(16) == dense.flops_per_token(16)
    experts = 2 * 3 * 3 * 32 * 16
    assert moe.num_params() == moe.num_params(active=True) + experts // 3


def test_pipeline_stages_refuse_router_losses():
    check_pipeline_split(decoder_plan(moe_decoder("meta", moe=dataclasses.replace(
        MOE, aux_loss_weight=0.0, z_loss_weight=0.0))), pp=2)  # fmt: skip
    with pytest.raises(UserError, match=r"parallelism.pp=2: the MoE router losses .* set both"):
        check_pipeline_split(decoder_plan(moe_decoder("meta")), pp=2)


BENCH = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "host_sync.py"))


def test_training_reads_the_expert_loads_only_when_it_logs(tmp_path):
    """Between log intervals a training step of an MoE reads nothing from the device (the
    grouped experts take the counts on the device; the load statistics stay there); the
    router metrics reach the logger every batch."""
    counter = BENCH["Counter"]()

    class Reads(Callback):
        reads: list[int] = []

        def batch_start(self, state, logger) -> None:
            counter.active, counter.reads = True, 0

        def batch_end(self, state, logger) -> None:
            self.reads.append(counter.reads)
            counter.active = False

    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 16), generator=generator)
        batches.append({"input_ids": ids, "labels": ids})
    trainer = Trainer(
        model=moe_decoder("meta"),
        train_dataloader=batches,
        max_duration="4ba",
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        precision="fp32",
        device_train_microbatch_size=1,
        run_dir=tmp_path,
        callbacks=[Reads()],
        loggers=[JSONLLogger(flush_interval="4ba")],
    )
    with BENCH["instrumented"](counter):
        trainer.fit()
    assert Reads.reads[:3] == [0, 0, 0], Reads.reads
    records = [r.get("metrics", {}) for _, r in read_jsonl(str(tmp_path / "metrics.jsonl"))]
    aux = [r["train/moe_aux_loss"] for r in records if "train/moe_aux_loss" in r]
    assert len(aux) == 4 and all(2 * 0.99 < a < 2 * 3 for a in aux)  # top 2 of 3: >= k


def test_gradient_accumulation_weights_each_microbatchs_router_losses_as_its_loss(tmp_path):
    """With two microbatches the trainer's step is SGD on sum_i share_i * (CE_i + router_i),
    share_i microbatch i's fraction of the loss tokens: each microbatch's router losses taken
    over its own tokens and weighted as its next-token loss (not one router loss over the
    whole batch, which differs: the load-balancing loss is a product of batch means)."""
    spec = dataclasses.replace(MOE, aux_loss_weight=1.0, z_loss_weight=0.1)
    model = moe_decoder(moe=spec)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :10] = -100  # position t predicts label t + 1: 6 and 15 of the 21 loss tokens
    batch = {"input_ids": ids, "labels": labels}

    def stepped(losses) -> list[torch.Tensor]:
        reference = moe_decoder(moe=spec)
        total = sum(w * reference.loss(reference(r), r) for w, r in losses(batch))
        total.backward()
        return [(p - 0.1 * p.grad).detach() for p in reference.parameters()]

    def per_microbatch(batch):
        for row, share in ((0, 6 / 21), (1, 15 / 21)):
            yield share, {k: v[row : row + 1] for k, v in batch.items()}

    Trainer(
        model=model,
        train_dataloader=[batch],
        max_duration="1ba",
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        precision="fp32",
        device_train_microbatch_size=1,
        run_dir=tmp_path,
    ).fit()
    for got, expected in zip(model.parameters(), stepped(per_microbatch), strict=True):
        _close(got, expected)
    whole = list(stepped(lambda batch: [(1.0, batch)]))
    assert not all(torch.allclose(g, e) for g, e in zip(model.parameters(), whole, strict=True))


def test_the_grouped_mm_probe_runs_apart_from_activation_checkpointing(monkeypatch):
    """The probe runs in a thread of its own: a first forward inside activation checkpointing
    would otherwise count the probe's ops as the layer's and miss them on recompute ("a
    different number of tensors was saved")."""
    from llmfoundry.models.layers import moe as moe_layer

    monkeypatch.setattr(moe_layer, "_GROUPED_MM_RUNS", {})
    experts = GroupedExperts(2, D, 16)
    x = torch.randn(5, D, requires_grad=True)
    checkpoint(experts, x, torch.tensor([2, 3]), use_reentrant=False).sum().backward()
    assert x.grad is not None and moe_layer._GROUPED_MM_RUNS
