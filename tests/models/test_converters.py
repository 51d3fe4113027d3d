"""Model converters (llmfoundry/models/converters.py): applied in the build path before the
strategy prepares the model; which modules they convert; config errors (an unknown converter's
name: tests/config/test_config.py); state dicts unchanged.

(Low-precision LayerNorm was an algorithm applied at INIT, after the strategy had wrapped the
model; these replace tests/algorithms/test_low_precision_layernorm.py.)
"""

import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from llmfoundry.algorithms import EMA
from llmfoundry.build import build_trainer
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.distributed import SingleDevice
from llmfoundry.models import converters
from llmfoundry.models.converters import (
    ConversionContext,
    LowPrecisionLayerNorm,
    convert_model,
    to_low_precision,
)
from llmfoundry.models.families import build_model
from llmfoundry.models.norms import LayerNorm
from llmfoundry.utils.errors import UserError
from tests.e2e.test_build import TINY, write_dataset
from tests.models.test_llama import tiny as tiny_llama
from tests.trainer.conftest import tiny_model

CONF = Path(__file__).resolve().parents[2] / "conf"
BF16 = ConversionContext("amp_bf16", torch.device("cpu"))


def low_precision_norms(model: nn.Module) -> list[str]:
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, LayerNorm) and module.low_precision
    ]


def test_the_build_converts_before_the_strategy_prepares(tmp_path, monkeypatch):
    """train.py's path: the strategy is handed the converted model (FSDP would shard, DDP
    replicate, those modules), the optimizer holds their parameters, and they train."""
    seen = []
    prepare = SingleDevice.prepare

    def spy(self, model):
        seen.append(low_precision_norms(model))
        return prepare(self, model)

    monkeypatch.setattr(SingleDevice, "prepare", spy)
    data = write_dataset(tmp_path / "data", 1)
    overrides = [
        *TINY,
        f"data.remote={data}",
        "converters=[low_precision_layernorm]",
        "precision=amp_bf16",
    ]
    trainer = build_trainer(compose_config(CONF, overrides), tmp_path / "run")
    norms = ["transformer.blocks.0.norm_1", "transformer.blocks.0.norm_2"]
    norms += ["transformer.blocks.1.norm_1", "transformer.blocks.1.norm_2", "transformer.norm_f"]
    assert seen == [norms]
    model = trainer.state.model
    assert low_precision_norms(model) == norms
    optimized = {id(p) for g in trainer.state.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    before = model.transformer.norm_f.weight.detach().clone()
    assert math.isfinite(trainer.fit().train_loss)
    assert not torch.equal(before, model.transformer.norm_f.weight)  # the shared weight trains


def test_the_old_algorithms_spelling_selects_the_converter():
    """`algorithms=[low_precision_layernorm]` (README and configs before converters) keeps
    working: it composes to the converter, not to an algorithm."""
    for spelling in (
        "algorithms=[gradient_clipping,low_precision_layernorm]",
        "converters=[low_precision_layernorm]",
    ):
        cfg = compose_config(CONF, [spelling, "model.vocab_size=64", "precision=amp_bf16"])
        check(CONF, [spelling, "model.vocab_size=64", "precision=amp_bf16"])
        assert list(cfg.converters) == ["low_precision_layernorm"]
        assert "low_precision_layernorm" not in (cfg.get("algorithms") or {})
        assert isinstance(
            instantiate(cfg.converters.low_precision_layernorm), LowPrecisionLayerNorm
        )


def test_an_object_that_is_no_converter_is_refused_by_its_name():
    with pytest.raises(UserError, match=r"^converters.ema: EMA is not a model converter"):
        convert_model(tiny_model(), {"ema": EMA()}, BF16)


def test_which_norms_are_converted_and_which_skipped():
    """Affine LayerNorms of any class are converted on the same parameters; ones without a
    weight, ones already in low precision and other modules are left as they are."""
    model = nn.Sequential(
        nn.LayerNorm(8),  # a plain torch LayerNorm (not MPT's)
        nn.LayerNorm(8, elementwise_affine=False),
        LayerNorm(8, bias=True, low_precision=True),
        LayerNorm(8, bias=False, low_precision=False),
        nn.Linear(8, 8),
    )
    plain, no_weight, already, mpt, linear = list(model)
    converted = LowPrecisionLayerNorm().convert(model, BF16)
    assert converted == ["0", "3"]
    assert model[1] is no_weight and model[2] is already and model[4] is linear
    assert low_precision_norms(model) == ["0", "2", "3"]
    assert model[0].weight is plain.weight and model[0].bias is plain.bias
    assert model[3].weight is mpt.weight and model[3].bias is None


def test_the_state_dict_keys_are_unchanged():
    """Checkpoints of a converted run load into an unconverted model (strictly) and back."""
    plain, converted = tiny_model(), tiny_model()
    convert_model(converted, {"low_precision_layernorm": LowPrecisionLayerNorm()}, BF16)
    assert len(low_precision_norms(converted)) == 5
    assert list(converted.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(converted.state_dict(), strict=True, assign=True)


def test_a_model_without_layernorms_is_refused_in_one_line():
    """Llama normalizes with RMSNorm, which stays in float32 (transformers' parity)."""
    llama = build_model(tiny_llama(), init_device="meta")
    with pytest.raises(UserError, match="LlamaForCausalLM has no LayerNorm") as err:
        LowPrecisionLayerNorm().convert(llama, BF16)
    assert "\n" not in str(err.value)


def test_fp32_warns_that_it_does_nothing():
    with pytest.warns(UserWarning, match="no effect with precision=fp32"):
        LowPrecisionLayerNorm().convert(
            tiny_model(), ConversionContext("fp32", torch.device("cpu"))
        )


def test_the_swapped_norm_runs_in_the_autocast_dtype_and_matches_in_fp32():
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


def test_a_checkpoint_of_the_old_algorithm_loads_into_a_converted_run(tmp_path):
    """Runs before converters saved the algorithm's (empty) state by its class name and the
    swapped norms' weights under the same keys: both load into a run with the converter."""
    import functools

    from llmfoundry.algorithms import EMA
    from llmfoundry.checkpoint.state_dict import load_checkpoint, save_checkpoint
    from llmfoundry.trainer import Algorithm, Event, Trainer
    from tests.trainer.conftest import token_batches

    class LowPrecisionLayerNorm(Algorithm):  # the old algorithm: the swap at INIT
        def match(self, event, state):
            return event is Event.INIT

        def apply(self, event, state, logger):
            converters.LowPrecisionLayerNorm().convert(state.model, BF16)

    def trainer(run: str, model: nn.Module, algorithms: list) -> Trainer:
        return Trainer(
            model=model,
            train_dataloader=token_batches(2, 4),
            max_duration="2ba",
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
            run_dir=tmp_path / run,
            precision="amp_bf16",
            algorithms=algorithms,
        )

    old = trainer("old", tiny_model(), [LowPrecisionLayerNorm(), EMA(half_life="1ba")])
    old.fit()
    path = save_checkpoint(str(tmp_path / "ckpt"), old.state, old.logger)
    converted = convert_model(
        tiny_model(), {"low_precision_layernorm": converters.LowPrecisionLayerNorm()}, BF16
    )
    new = trainer("new", converted, [EMA(half_life="1ba")])
    load_checkpoint(path, new.state, new.logger)
    for name, tensor in old.state.model.state_dict().items():
        assert torch.equal(new.state.model.state_dict()[name], tensor), name
    for name, average in old.state.algorithms[1].averages.items():
        assert torch.equal(new.state.algorithms[0].averages[name], average), name
