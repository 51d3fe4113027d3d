import math

import pytest
import torch
from torch import nn

from llmfoundry.algorithms import LowPrecisionLayerNorm
from llmfoundry.algorithms.low_precision_layernorm import to_low_precision
from llmfoundry.models.norms import LayerNorm

from .helpers import Metrics, make_trainer


def test_swap_at_init_keeps_parameters_and_optimizer(tmp_path):
    metrics = Metrics()
    trainer = make_trainer(
        tmp_path, precision="amp_bf16", algorithms=[LowPrecisionLayerNorm()], loggers=[metrics]
    )
    model = trainer.state.model
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 5 and all(isinstance(m, LayerNorm) and m.low_precision for m in norms)
    assert metrics.values("algorithms/low_precision_layernorms") == [5]
    optimized = {id(p) for g in trainer.state.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    before = model.transformer.norm_f.weight.detach().clone()
    state = trainer.fit()
    assert math.isfinite(state.train_loss)
    assert not torch.equal(before, model.transformer.norm_f.weight)  # the shared weight trains


def test_swapped_norm_runs_in_the_autocast_dtype_and_matches_in_fp32():
    torch.manual_seed(0)
    plain = nn.LayerNorm(8, eps=1e-6)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-0.5, 0.5)
    swapped = to_low_precision(plain)
    assert swapped.weight is plain.weight and swapped.bias is plain.bias and swapped.eps == 1e-6
    x = torch.randn(4, 8)
    assert torch.equal(swapped(x), plain(x))  # outside autocast: the same computation
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain(x).dtype == torch.float32
        out = swapped(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), plain(x), rtol=0.05, atol=0.05)


def test_fp32_run_warns_that_it_does_nothing(tmp_path):
    with pytest.warns(UserWarning, match="no effect with precision=fp32"):
        make_trainer(tmp_path, algorithms=[LowPrecisionLayerNorm()])
