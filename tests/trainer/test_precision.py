"""Precision: fp32, amp_bf16 (autocast, fp32 master weights), amp_fp16 with a grad scaler (CUDA)."""

import functools
import logging
import math

import pytest
import torch

from llmfoundry.core.precision import Precision
from llmfoundry.distributed import SingleDevice
from llmfoundry.trainer import Callback, Trainer

from .conftest import tiny_model, token_batches


class Dtypes(Callback):
    def __init__(self):
        self.outputs, self.params = [], []

    def after_forward(self, state, logger):
        self.outputs.append(state.outputs.dtype)
        self.params.append({p.dtype for p in state.model.parameters()})


def train(tmp_path, precision, device="cpu", callbacks=()):
    dtypes = Dtypes()
    trainer = Trainer(
        model=tiny_model(),
        train_dataloader=token_batches(3, 4),
        max_duration="3ba",
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        run_dir=tmp_path,
        precision=precision,
        strategy=SingleDevice(device),
        callbacks=[dtypes, *callbacks],
    )
    return trainer, trainer.fit(), dtypes


def test_fp32_runs_without_autocast(tmp_path):
    _, _, dtypes = train(tmp_path, "fp32")
    assert set(dtypes.outputs) == {torch.float32}


def test_bf16_computes_in_bf16_keeps_fp32_weights_and_tracks_fp32(tmp_path):
    _, bf16, dtypes = train(tmp_path, "amp_bf16")
    assert set(dtypes.outputs) == {torch.bfloat16}
    assert all(params == {torch.float32} for params in dtypes.params)
    _, fp32, _ = train(tmp_path, "fp32")
    assert math.isfinite(bf16.train_loss)
    assert bf16.train_loss == pytest.approx(fp32.train_loss, rel=0.02)
    assert bf16.train_loss != fp32.train_loss  # autocast really changed the arithmetic


def test_unknown_precision_and_cpu_fp16_are_errors():
    with pytest.raises(ValueError, match="precision='fp64' is not one of"):
        Precision("fp64", torch.device("cpu"))
    with pytest.raises(ValueError, match="amp_fp16 needs a CUDA device"):
        Precision("amp_fp16", torch.device("cpu"))
    assert Precision("amp_bf16", torch.device("cpu")).state_dict() == {}


@pytest.mark.cuda  # amp_fp16 needs CUDA
def test_fp16_scales_the_loss_and_unscales_before_the_step(tmp_path):
    seen = []

    class Grads(Callback):
        def after_train_batch(self, state, logger):
            seen.append(max(p.grad.abs().max().item() for p in state.model.parameters()))

    trainer, state, _ = train(tmp_path, "amp_fp16", device="cuda", callbacks=[Grads()])
    assert math.isfinite(state.train_loss)
    assert trainer.precision.state_dict()["scale"] > 1.0
    assert all(0 < g < 100 for g in seen)  # unscaled: not multiplied by the 65536 scale


def test_fp16_leaves_loss_scaling_to_an_engine_that_scales_itself(matmul_precision):
    """DeepSpeed (`Strategy.scales_loss`) runs backward and the step with its own loss scaler:
    a GradScaler here would unscale gradients it never scaled (AssertionError at step 1)."""
    precision = Precision("amp_fp16", torch.device("cuda"), grad_scaler=False)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = model(torch.ones(1, 2)).sum()
    precision.backward(loss)
    precision.unscale(optimizer)
    assert torch.equal(model.weight.grad, torch.ones(1, 2))  # neither scaled nor unscaled
    assert precision.state_dict() == {}


@pytest.fixture
def matmul_precision():
    """Set by a Precision on a CUDA device; restored for the other tests."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize(
    "capability, resolved, matmuls", [((9, 0), "amp_bf16", "high"), ((7, 0), "fp32", "highest")]
)
def test_auto_is_amp_bf16_on_a_gpu_with_bf16_tensor_cores_else_fp32(
    monkeypatch, caplog, matmul_precision, capability, resolved, matmuls
):
    """The default (no GPU here: its compute capability is faked). An H100/H200 (9.0) trains
    in bf16 with TF32 for autocast's fp32 leftovers; a V100 (7.0) only emulates bf16."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.version, "hip", None)
    torch.set_float32_matmul_precision("medium")  # neither: the precision sets it
    with caplog.at_level(logging.INFO, logger="llmfoundry"):
        precision = Precision("auto", torch.device("cuda", 0))
    assert precision.name == resolved
    assert torch.get_float32_matmul_precision() == matmuls
    major, minor = capability
    assert caplog.messages == [
        f"precision=auto: {resolved} on cuda:0 (compute capability {major}.{minor})"
    ]


def test_fp32_on_a_gpu_is_ieee_even_after_an_amp_run_in_the_process(matmul_precision):
    Precision("amp_bf16", torch.device("cuda", 0))
    assert torch.get_float32_matmul_precision() == "high"
    Precision("fp32", torch.device("cuda", 0))
    assert torch.get_float32_matmul_precision() == "highest"


def test_auto_trains_in_fp32_on_cpu_and_says_so_once(tmp_path, caplog, matmul_precision):
    torch.set_float32_matmul_precision("medium")
    with caplog.at_level(logging.INFO, logger="llmfoundry"):
        trainer = Trainer(  # the default precision
            model=tiny_model(),
            train_dataloader=token_batches(1, 2),
            max_duration="1ba",
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            run_dir=tmp_path,
            strategy=SingleDevice("cpu"),
        )
    assert trainer.precision.name == "fp32"
    assert [m for m in caplog.messages if "precision=auto" in m] == ["precision=auto: fp32 on cpu"]
    assert torch.get_float32_matmul_precision() == "medium"  # a CPU run leaves it alone


@pytest.mark.cuda  # this GPU's own compute capability
def test_auto_on_this_gpu_and_fp32_after_it(tmp_path, matmul_precision):
    trainer, _, dtypes = train(tmp_path, "auto", device="cuda")
    bf16 = torch.cuda.get_device_capability() >= (8, 0)
    assert trainer.precision.name == ("amp_bf16" if bf16 else "fp32")
    assert set(dtypes.outputs) == {torch.bfloat16 if bf16 else torch.float32}
    assert torch.get_float32_matmul_precision() == ("high" if bf16 else "highest")
    _, _, dtypes = train(tmp_path, "fp32", device="cuda")
    assert set(dtypes.outputs) == {torch.float32}
    assert torch.get_float32_matmul_precision() == "highest"
