import functools
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from llmfoundry.config.preflight import check
from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
from llmfoundry.optim import DecoupledAdamW, DecoupledLionW, build_param_groups
from llmfoundry.optim.param_groups import DECOUPLED_DECAY, NORM_BIAS_EMBEDDING
from llmfoundry.trainer import Trainer
from tests.trainer.conftest import tiny_model, token_batches

CONF = Path(__file__).resolve().parents[2] / "conf"


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.rms = nn.RMSNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: listed once, as an embedding


def group_names(groups):
    return {g[NORM_BIAS_EMBEDDING]: g["param_names"] for g in groups}


def test_param_groups_split_norms_biases_embeddings():
    names = group_names(build_param_groups(Mixed()))
    assert names == {
        False: ["proj.weight"],
        True: ["emb.weight", "proj.bias", "ln.weight", "ln.bias", "rms.weight"],
    }


def test_param_groups_of_mpt_cover_every_parameter_once():
    config = MPTConfig(
        d_model=32, n_heads=2, n_layers=2, max_seq_len=16, vocab_size=64, no_bias=False
    )
    model = MPTForCausalLM(config)
    groups = build_param_groups(model)
    listed = [id(p) for g in groups for p in g["params"]]
    assert sorted(listed) == sorted(id(p) for p in model.parameters())
    exempt = group_names(groups)[True]
    assert "transformer.wte.weight" in exempt
    assert "transformer.blocks.0.attn.Wqkv.bias" in exempt and "transformer.norm_f.weight" in exempt
    assert all(name.endswith("weight") for name in group_names(groups)[False])


def zero_grad_step(optimizer_cls, **kwargs):
    """One step with zero gradients: only the decoupled decay moves the weights."""
    model = Mixed()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    opt = optimizer_cls(build_param_groups(model), **kwargs)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


@pytest.mark.parametrize("optimizer_cls", [DecoupledAdamW, DecoupledLionW])
def test_no_decay_switch_exempts_norms_biases_embeddings(optimizer_cls):
    model, opt = zero_grad_step(
        optimizer_cls, lr=1e-3, weight_decay=0.1, no_decay_norm_bias_embedding=True
    )
    assert {g[NORM_BIAS_EMBEDDING]: g[DECOUPLED_DECAY] for g in opt.param_groups} == {
        False: 0.1,
        True: 0.0,
    }
    torch.testing.assert_close(model.proj.weight, torch.full((4, 4), 0.9))
    for p in (model.proj.bias, model.emb.weight, model.ln.weight, model.ln.bias, model.rms.weight):
        torch.testing.assert_close(p, torch.ones_like(p))
    model, _ = zero_grad_step(optimizer_cls, lr=1e-3, weight_decay=0.1)
    torch.testing.assert_close(model.ln.weight, torch.full((4,), 0.9))


def test_no_decay_switch_needs_the_groups():
    with pytest.raises(ValueError, match="build_param_groups"):
        DecoupledAdamW(Mixed().parameters(), no_decay_norm_bias_embedding=True)


def test_group_weight_decay_overrides_and_torch_decay_stays_zero():
    model = Mixed()
    groups = [{"params": [model.proj.weight], "weight_decay": 0.5}, {"params": [model.proj.bias]}]
    opt = DecoupledAdamW(groups, lr=1e-3, weight_decay=0.1)
    assert [g[DECOUPLED_DECAY] for g in opt.param_groups] == [0.5, 0.1]
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        DecoupledAdamW(model.parameters(), weight_decay=-1.0)


def test_adamw_update_is_torch_adam_plus_schedule_scaled_decay():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(5)), nn.Parameter(torch.randn(5))
    with torch.no_grad():
        b.copy_(a)
    ours = DecoupledAdamW([a], lr=1e-2, weight_decay=0.2)
    reference = torch.optim.Adam([b], lr=1e-2, betas=(0.9, 0.95))
    for step, lr in enumerate([1e-2, 5e-3, 2.5e-3]):
        grad = torch.randn(5)
        a.grad, b.grad = grad.clone(), grad.clone()
        ours.param_groups[0]["lr"] = reference.param_groups[0]["lr"] = lr
        with torch.no_grad():
            b.mul_(1 - 0.2 * lr / 1e-2)
        ours.step()
        reference.step()
        torch.testing.assert_close(a, b, msg=f"step {step}")


def lion_reference(param, grads, lrs, initial_lr, betas, weight_decay):
    """Lion as written in the paper (Chen et al. 2023, Algorithm 2), with decoupled decay."""
    p, m = param.clone(), torch.zeros_like(param)
    for g, lr in zip(grads, lrs, strict=True):
        c = betas[0] * m + (1 - betas[0]) * g
        p = p * (1 - weight_decay * lr / initial_lr) - lr * torch.sign(c)
        m = betas[1] * m + (1 - betas[1]) * g
    return p


def test_lion_matches_the_paper_update():
    torch.manual_seed(1)
    start = torch.randn(6)
    grads = [torch.randn(6) for _ in range(4)]
    lrs = [1e-2, 1e-2, 5e-3, 1e-3]
    param = nn.Parameter(start.clone())
    opt = DecoupledLionW([param], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.3)
    for grad, lr in zip(grads, lrs, strict=True):
        param.grad = grad.clone()
        opt.param_groups[0]["lr"] = lr
        opt.step()
    expected = lion_reference(start, grads, lrs, 1e-2, (0.9, 0.99), 0.3)
    torch.testing.assert_close(param.detach(), expected)


def test_lion_state_dict_resumes_identically():
    torch.manual_seed(2)
    grads = [torch.randn(3) for _ in range(4)]
    a = nn.Parameter(torch.ones(3))
    opt_a = DecoupledLionW([a], lr=1e-2, weight_decay=0.1)
    for g in grads[:2]:
        a.grad = g.clone()
        opt_a.step()
    b = nn.Parameter(a.detach().clone())
    opt_b = DecoupledLionW([b], lr=1e-2, weight_decay=0.1)
    opt_b.load_state_dict(opt_a.state_dict())
    for g in grads[2:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs,message",
    [({"lr": 0.0}, "lr must be positive"), ({"betas": (0.9, 1.0)}, "betas must be two numbers")],
)
def test_lion_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecoupledLionW([nn.Parameter(torch.ones(2))], **kwargs)


@pytest.mark.parametrize("name", ["decoupled_adamw", "decoupled_lionw"])
def test_optimizer_configs_train_with_the_switch_on(tmp_path, name):
    check(CONF, [f"optimizer={name}", "optimizer.no_decay_norm_bias_embedding=true"])
    node = OmegaConf.load(CONF / "optimizer" / f"{name}.yaml")
    node.no_decay_norm_bias_embedding = True
    node.weight_decay = 0.1
    trainer = Trainer(
        model=tiny_model(),
        train_dataloader=token_batches(2, 2),
        max_duration="2ba",
        optimizer=instantiate(node),
        run_dir=tmp_path,
    )
    before = trainer.state.model.transformer.norm_f.weight.detach().clone()
    state = trainer.fit()
    decay = {g[NORM_BIAS_EMBEDDING]: g[DECOUPLED_DECAY] for g in state.optimizer.param_groups}
    assert decay == {False: 0.1, True: 0.0}
    assert not torch.equal(before, state.model.transformer.norm_f.weight)  # still trained


def test_plain_torch_optimizers_accept_the_groups(tmp_path):
    trainer = Trainer(
        model=tiny_model(),
        train_dataloader=token_batches(1, 2),
        max_duration="1ba",
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
        run_dir=tmp_path,
    )
    state = trainer.fit()
    assert [g[NORM_BIAS_EMBEDDING] for g in state.optimizer.param_groups] == [False, True]
    assert all("initial_lr" in g for g in state.optimizer.param_groups)


def test_adamw_fuses_on_cpu_by_default_and_matches_the_unfused_update():
    torch.manual_seed(0)
    fused_model, plain_model = Mixed(), Mixed()
    plain_model.load_state_dict(fused_model.state_dict())
    fused = DecoupledAdamW(build_param_groups(fused_model), lr=1e-2, weight_decay=0.1)
    plain = DecoupledAdamW(build_param_groups(plain_model), lr=1e-2, weight_decay=0.1, fused=False)
    assert fused.defaults["fused"] is True and not plain.defaults["fused"]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in fused_model.parameters()]
        for model, opt in ((fused_model, fused), (plain_model, plain)):
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g.clone()
            opt.step()
    for got, want in zip(fused_model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_adamw_does_not_fuse_parameters_torch_cannot():
    with torch.device("meta"):
        model = Mixed()
    assert not DecoupledAdamW(build_param_groups(model), lr=1e-3).defaults["fused"]


def test_fused_adamw_skips_decay_and_update_on_an_overflowed_scaled_step():
    model = Mixed()
    opt = DecoupledAdamW(build_param_groups(model), lr=1e-2, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(sum(p.sum() for p in model.parameters())).backward()
    model.proj.weight.grad[0, 0] = float("inf")
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    for got, want in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(got.detach(), want)
    assert scaler.get_scale() == 2.0  # the overflow was seen
    opt.zero_grad()
    scaler.scale(sum(p.sum() for p in model.parameters())).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    assert not torch.equal(model.proj.weight.detach(), before[1])  # a finite step moves
