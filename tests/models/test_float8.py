"""fp8 training (`Float8Training` in llmfoundry/models/converters.py, precision=amp_fp8): which
Linears become torchao's Float8Linear and which stay, unchanged parameter names, the refusal
on a machine without a GPU of compute capability 8.9+, a step with the float8 matmuls
emulated on CPU (torchao's ``emulate``), and a backward over a token count that is not a
multiple of 16 through CPU float8 kernels held to CUDA's shape rules. The speed on a GPU:
bench/gpu.sh."""

import math
from pathlib import Path

import pytest
import torch

from llmfoundry.build import build_trainer
from llmfoundry.config.preflight import check, compose_config
from llmfoundry.distributed.base import materialize
from llmfoundry.models.converters import (
    ConversionContext,
    Float8Training,
    LowPrecisionLayerNorm,
    convert_model,
    float8_refusal,
    resolve_precision,
)
from llmfoundry.models.families import build_model
from llmfoundry.utils.errors import UserError
from tests.e2e.test_build import TINY, write_dataset
from tests.models.test_llama import tiny as tiny_llama
from tests.trainer.conftest import tiny_model

Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

CONF = Path(__file__).resolve().parents[2] / "conf"
CPU = torch.device("cpu")
BF16 = ConversionContext("amp_bf16", CPU)
EMULATED = Float8Training(emulate=True)
MPT_LINEARS = ["attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj"]


def in_float8(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


def test_mpt_converts_every_block_linear_and_keeps_the_tied_head():
    model = tiny_model()  # d_model 32: Wqkv 32 -> 96, MLP 32 -> 128 -> 32
    weights = {name: p for name, p in model.named_parameters()}
    converted = EMULATED.convert(model, BF16)
    expected = [f"transformer.blocks.{i}.{name}" for i in range(2) for name in MPT_LINEARS]
    assert converted == expected and in_float8(model) == expected
    # The same Parameter objects under the same names: the tied embedding stays an Embedding.
    assert dict(model.named_parameters()) == weights
    assert type(model.transformer.wte) is torch.nn.Embedding


def test_llama_skips_dims_that_are_not_multiples_of_16_and_the_output_head(caplog):
    """An MLP 72 wide cannot run float8 kernels; the untied lm_head is outside the blocks."""
    model = build_model(tiny_llama(ffn_hidden_size=72), init_device="meta")
    converted = EMULATED.convert(model, BF16)
    attention = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"]
    assert converted == [f"transformer.blocks.{i}.{name}" for i in range(2) for name in attention]
    assert in_float8(model) == converted
    assert type(model.lm_head) is torch.nn.Linear
    assert "6 Linears stay in the autocast dtype" in caplog.text
    assert "transformer.blocks.1.ffn.down_proj" in caplog.text
    with pytest.raises(UserError, match="no Linear in its blocks with in and out features"):
        EMULATED.convert(build_model(tiny_llama(d_model=40, n_heads=4), init_device="meta"), BF16)


def test_the_state_dict_is_the_same_so_checkpoints_move_between_fp8_and_bf16():
    plain = materialize(build_model(tiny_llama(), init_device="meta"), CPU)
    converted = convert_model(build_model(tiny_llama(), init_device="meta"), {"f": EMULATED}, BF16)
    materialize(converted, CPU)
    assert in_float8(converted)
    assert list(converted.state_dict()) == list(plain.state_dict())
    converted.load_state_dict(plain.state_dict(), strict=True)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(converted.state_dict()[name], tensor), name
    plain.load_state_dict(converted.state_dict(), strict=True)


def test_without_a_float8_gpu_the_run_is_refused_in_one_line_before_any_work():
    model = tiny_model()
    with pytest.raises(UserError) as err:
        Float8Training().convert(model, BF16)
    message = str(err.value)
    assert message.startswith("converters.float8: fp8 training needs a CUDA GPU of compute ")
    assert "capability >= 8.9" in message and "this run is on cpu (no CUDA GPU)" in message
    assert message.endswith("use precision=amp_bf16 without converters=[float8]")
    assert "\n" not in message and not in_float8(model)
    # train.py's preflight says it before anything is built, for either spelling.
    spellings = {"precision": "precision=amp_fp8", "converters.float8": "converters=[float8]"}
    for key, override in spellings.items():
        with pytest.raises(UserError, match=rf"^{key}: fp8 training needs a CUDA GPU"):
            check(CONF, ["model.vocab_size=64", override])


def test_amp_fp8_is_bf16_autocast_with_the_float8_converter():
    norms = LowPrecisionLayerNorm()
    precision, converters = resolve_precision("amp_fp8", {"norms": norms})
    assert precision == "amp_bf16" and list(converters) == ["norms", "float8"]
    assert converters["norms"] is norms and isinstance(converters["float8"], Float8Training)
    assert resolve_precision("amp_fp8", {"mine": EMULATED}) == ("amp_bf16", {"mine": EMULATED})
    assert resolve_precision("amp_bf16", {}) == ("amp_bf16", {})


def test_an_emulated_fp8_run_trains_near_its_bf16_twin(tmp_path):
    """train.py's path with precision=amp_fp8 (its converter emulated): the trainer runs bf16
    autocast over the Float8Linears; the losses (of the same seeded weights) are within fp8's
    rounding of a bf16 run's, but not equal to them (the matmuls did go through float8). e4m3
    rounds each element by up to 2^-4 of itself; over dot products of 32 to 128 terms the errors
    average out, and the loss moves by about 1e-4 of itself (measured): 1% is a wide margin."""
    data = write_dataset(tmp_path / "data", 1)
    losses = {}
    for run, overrides in (
        ("fp8", ["precision=amp_fp8", "converters=[float8]", "converters.float8.emulate=true"]),
        ("bf16", ["precision=amp_bf16"]),
    ):
        cfg = compose_config(CONF, [*TINY, f"data.remote={data}", *overrides])
        trainer = build_trainer(cfg, tmp_path / run)
        assert trainer.state.precision.name == "amp_bf16"
        assert len(in_float8(trainer.state.model)) == (8 if run == "fp8" else 0)
        weight = trainer.state.model.transformer.blocks[0].ffn.up_proj.weight
        before = weight.detach().clone()
        losses[run] = trainer.fit().train_loss
        assert weight.dtype == torch.float32 and not torch.equal(weight, before)  # it trains
    assert math.isfinite(losses["fp8"])
    assert losses["fp8"] != losses["bf16"]
    assert math.isclose(losses["fp8"], losses["bf16"], rel_tol=0.01)


def _scaled_mm_with_cuda_shape_rules(real):
    """torch._scaled_mm as CUDA runs it: cuBLASLt's float8 kernels take an inner dimension
    (mat1's columns) and mat2's columns only in multiples of 16 (torch's own check, worded as
    it words it); the CPU kernel takes any shape, so on CPU the rule is checked here."""

    def scaled_mm(mat1, mat2, *args, **kwargs):
        if mat1.shape[1] % 16 or mat2.shape[0] % 16 or mat2.shape[1] % 16:
            raise RuntimeError(
                f"mat1 shape {tuple(mat1.shape)} and mat2 shape {tuple(mat2.shape)} must be "
                "divisible by 16 (cuBLASLt float8)"
            )
        return real(mat1, mat2, *args, **kwargs)

    return scaled_mm


@pytest.mark.parametrize("seq_len", [12, 16])
def test_float8_backward_takes_a_token_count_that_is_not_a_multiple_of_16(monkeypatch, seq_len):
    """The weight gradient's float8 matmul multiplies over the tokens (grad_output^T @ input),
    so a microbatch of 2 x 12 tokens (a padded finetuning batch) would fail in backward on a
    GPU. The converted Linears pad the tokens to a multiple of 16 with zeros (which change no
    sum) when they are not, so forward and backward give what the emulated matmuls give."""
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_with_cuda_shape_rules(torch._scaled_mm))
    monkeypatch.setattr("llmfoundry.models.converters.float8_refusal", lambda device: None)
    torch.manual_seed(0)
    x = torch.randn(2, seq_len, 32, dtype=torch.bfloat16)
    weights = materialize(tiny_model(), CPU).state_dict()
    grads = {}
    for emulate in (False, True):
        model = materialize(tiny_model(), CPU)
        model.load_state_dict(weights)
        Float8Training(emulate=emulate).convert(model, BF16)
        linear = model.transformer.blocks[0].ffn.up_proj  # 32 -> 128
        inputs = x.clone().requires_grad_()
        out = linear(inputs)
        assert out.shape == (2, seq_len, 128) and out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        grads[emulate] = (out, inputs.grad, linear.weight.grad)
    for got, want in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=1e-2)


@pytest.mark.cuda
@pytest.mark.skipif(
    float8_refusal(torch.device("cuda")) is not None, reason="needs a GPU of capability 8.9+"
)
def test_float8_on_the_gpu_trains_a_token_count_that_is_not_a_multiple_of_16():
    """The same on cuBLASLt itself: 2 x 12 tokens through a converted Linear, forward and
    backward, close to bf16."""
    cuda = torch.device("cuda")
    model = materialize(tiny_model(), cuda)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    Float8Training().convert(model, ConversionContext("amp_bf16", cuda))
    linear = model.transformer.blocks[0].ffn.up_proj
    x = torch.randn(2, 12, 32, device=cuda, requires_grad=True)
    with torch.autocast("cuda", torch.bfloat16):
        out = linear(x)
    out.float().square().sum().backward()
    weight = reference["transformer.blocks.0.ffn.up_proj.weight"]
    want = torch.nn.functional.linear(x.detach().bfloat16(), weight.bfloat16()).float()
    assert ((out.float() - want).norm() / want.norm()).item() < 0.1  # e4m3: ~2^-4 per element
    assert linear.weight.grad is not None and torch.isfinite(linear.weight.grad).all()
