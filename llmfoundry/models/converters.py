"""Model converters: named transforms of the built model, applied before it is parallelized.

A converter swaps modules of a built model for others that compute the same function another
way (low-precision LayerNorm, torchao's Float8Linear), the shape of torchtitan's
``model.converters``. The run names them in its ``converters`` group (conf/converters/,
``converters=[low_precision_layernorm]``, ``converters=[float8]``); `llmfoundry.build` builds
each from its node and `convert_model` applies them in that order to the model `build_model`
made, still on the meta device, before the strategy materializes and wraps it. So FSDP shards,
DDP replicates and the optimizer sees the converted modules, and a converter never deals with
sharded parameters.

A converter keeps every parameter's name (it reuses the parameters, or makes new ones of the
same name): checkpoints of a converted run load into an unconverted model and back. It may need
to know how the model will train (fp8 needs a CUDA device and low-precision autocast): the
`ConversionContext` says. A model a converter finds nothing to convert in is refused, since the
run would otherwise silently train without what the config asked for.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from llmfoundry.models.families import family_of
from llmfoundry.models.norms import LayerNorm
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConversionContext:
    """How the converted model will train: `precision` ("fp32", "amp_bf16", "amp_fp16"; the
    trainer's, so never "amp_fp8": see `resolve_precision`) and the `device` the strategy puts
    it on."""

    precision: str
    device: torch.device


@runtime_checkable
class ModelConverter(Protocol):
    """A transform of the built (meta-device) model, in place."""

    def convert(self, model: nn.Module, context: ConversionContext) -> list[str]:
        """Convert `model`'s modules in place; return the names of those converted."""
        ...


def convert_model(
    model: nn.Module, converters: Mapping[str, object], context: ConversionContext
) -> nn.Module:
    """Apply `converters` (by config name, in order) to `model`; returns `model`.

    Each value must be a `ModelConverter`; another object (an algorithm put in the converters
    group, say) is refused by its name before any converter runs.
    """
    for name, converter in converters.items():
        if not isinstance(converter, ModelConverter):
            raise UserError(
                f"converters.{name}: {type(converter).__name__} is not a model converter (it has "
                "no convert(model, context)); put it in its own group (algorithms, callbacks) "
                "or point _target_ at a class in llmfoundry.models.converters"
            )
    for name, converter in converters.items():
        converted = converter.convert(model, context)
        log.info("converter %s: %d modules converted", name, len(converted))
    return model


def to_low_precision(module: nn.LayerNorm) -> LayerNorm:
    """A low-precision LayerNorm computing what `module` does, on the same parameters."""
    with torch.device("meta"):
        swapped = LayerNorm(module.normalized_shape, module.bias is not None, low_precision=True)
    swapped.eps = module.eps
    swapped.weight = module.weight
    swapped.bias = module.bias
    return swapped


class LowPrecisionLayerNorm:
    """Run every affine LayerNorm in the autocast dtype (bf16/fp16) instead of float32.

    Autocast computes LayerNorm in float32 for accuracy; for LLM pretraining the low-precision
    version trains as well and saves the casts and float32 activations around every norm (MPT's
    ``low_precision_layernorm``, here for any model without a change to its config). Each
    `nn.LayerNorm` with a weight, of any family, becomes `llmfoundry.models.norms.LayerNorm`
    with ``low_precision=True`` on the same parameters; outside autocast it computes exactly
    what the original did. LayerNorms without a weight (``elementwise_affine=False``) and those
    already in low precision are left as they are.

    RMSNorm is not converted: Llama's computes in float32 and casts back, as transformers'
    LlamaRMSNorm does, which its greedy decoding parity with transformers relies on; a model
    with no LayerNorm (Llama) is refused.
    """

    def convert(self, model: nn.Module, context: ConversionContext) -> list[str]:
        norms = {
            name: module
            for name, module in model.named_modules()
            if name and isinstance(module, nn.LayerNorm) and module.weight is not None
        }
        if not norms:
            raise UserError(
                f"converters.low_precision_layernorm: {type(model).__name__} has no LayerNorm "
                "with a weight to convert (RMSNorm stays in float32); remove the converter"
            )
        if context.precision == "fp32":
            warnings.warn(
                "converters.low_precision_layernorm has no effect with precision=fp32 (there is "
                "no autocast dtype); use precision=amp_bf16 or remove the converter",
                stacklevel=2,
            )
        targets = [
            name
            for name, module in norms.items()
            if not (isinstance(module, LayerNorm) and module.low_precision)
        ]
        for name in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, to_low_precision(getattr(parent, child)))
        return targets


# torch._scaled_mm, which Float8Linear multiplies with, has float8 kernels from Ada (8.9) on.
FLOAT8_CAPABILITY = (8, 9)
# Both dims of each float8 matmul operand must be multiples of 16 (cuBLASLt's float8 kernels).
FLOAT8_DIM_MULTIPLE = 16


def float8_refusal(device: torch.device) -> str | None:
    """Why float8 matmuls cannot run on `device` (one line), or None when they can: they need a
    CUDA GPU of compute capability 8.9 or newer (Ada: L4, L40S, RTX 4090; Hopper: H100, H200;
    Blackwell)."""
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if capability >= FLOAT8_CAPABILITY:
            return None
        found = f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
    else:
        found = f"this run is on {device.type} (no CUDA GPU)"
    return (
        f"fp8 training needs a CUDA GPU of compute capability >= 8.9 (H100, H200, L4, RTX 4090) "
        f"and {found}; use precision=amp_bf16 without converters=[float8]"
    )


class Float8Training:
    """Train the blocks' matmuls in float8: torchao's Float8Linear (dynamic tensorwise scaling).

    Each `nn.Linear` inside the family's plan blocks (`ParallelPlan.blocks`: attention's and the
    MLP's projections) whose in and out features are both multiples of 16 becomes a
    `torchao.float8.Float8Linear` on the same parameters. Its forward and backward cast the
    input, the weight and the output gradient to float8 (e4m3, gradients e5m2), each with one
    scale from its current absolute maximum, and multiply with ``torch._scaled_mm``; weights,
    gradients and the optimizer state stay in the parameters' dtype. Parameter names do not
    change, so checkpoints move between fp8 and bf16 runs. Left as they are:

    - Linears with in or out features that are not multiples of 16: the float8 kernels take no
      other shapes (torchao would fail at the first forward). They are logged.
    - The output head, which is outside the blocks: MPT's is the token embedding (tied), and
      Llama's ``lm_head`` (or its tied embedding) stays in bf16 as torchtitan keeps it: the
      logits go straight into the softmax, and their gradient is the loss's.
    - Everything outside the blocks (embeddings, norms) and Linears already in float8.

    The weight gradient multiplies over the tokens (grad_output^T @ input), so the float8
    kernels also need the tokens of a microbatch in multiples of 16, which padded finetuning
    batches need not be: a converted Linear given another count pads its input with zero rows
    to the next multiple (they add nothing to any sum) and drops their outputs
    (`_any_token_count`). torchao's ``pad_inner_dim`` would pad inside every float8 matmul
    instead, copying both operands (and the weight twice) even when the count is a multiple.

    float8 pays on large matmuls (d_model of 2048 and up) and with torch.compile, which fuses
    the amax and casts; eager small models run slower than in bf16. Under FSDP the weights are
    all-gathered in their own dtype (torchao's float8 all-gather is not turned on).

    Args:
        emulate: run the float8 casts and matmuls emulated (torchao's ``emulate``: dequantized
            and multiplied in higher precision) on any device, without the GPU check. For tests
            of the conversion on CPU; no speedup.
    """

    def __init__(self, emulate: bool = False) -> None:
        self.emulate = emulate

    def convert(self, model: nn.Module, context: ConversionContext) -> list[str]:
        if not self.emulate and (reason := float8_refusal(context.device)):
            raise UserError(f"converters.float8: {reason}")
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            from torchao.float8.float8_linear import Float8Linear
        except ImportError:
            raise UserError(
                "converters.float8 needs torchao: pip install 'llmfoundry[fp8]' (torchao>=0.17)"
            ) from None
        names = {module: name for name, module in model.named_modules()}
        linears = {
            name: module
            for block in family_of(model).parallelize(model).blocks
            for name, module in block.named_modules(prefix=names[block])
            if isinstance(module, nn.Linear) and not isinstance(module, Float8Linear)
        }
        targets = [
            name
            for name, module in linears.items()
            if module.in_features % FLOAT8_DIM_MULTIPLE == 0
            and module.out_features % FLOAT8_DIM_MULTIPLE == 0
        ]
        if not targets:
            raise UserError(
                f"converters.float8: {type(model).__name__} has no Linear in its blocks with "
                "in and out features that are multiples of 16 (float8 matmuls need them); "
                "make d_model and the MLP width multiples of 16, or remove the converter"
            )
        if skipped := [name for name in linears if name not in targets]:
            log.warning(
                "converters.float8: %d Linears stay in the autocast dtype (in or out features "
                "not multiples of 16): %s",
                len(skipped),
                ", ".join(skipped),
            )
        chosen = set(targets)
        convert_to_float8_training(
            model,
            module_filter_fn=lambda module, name: name in chosen,
            config=Float8LinearConfig(emulate=self.emulate),
        )
        for name in targets:
            linear = model.get_submodule(name)
            linear.forward = functools.partial(_any_token_count, linear.forward)
        return targets


def _any_token_count(forward: Callable, x: torch.Tensor) -> torch.Tensor:
    """`forward` (a Float8Linear's) of `x` [..., in_features] whatever its number of tokens:
    unless it is a multiple of 16 (float8 matmuls need one: `Float8Training`), `forward` gets
    the tokens as rows with zero rows added up to the next multiple, and their outputs are
    dropped. A zero row changes neither the weight gradient nor the float8 scales (each from an
    absolute maximum), so the result is what unpadded float8 matmuls would give."""
    width = x.shape[-1]
    tokens = x.numel() // width
    missing = -tokens % FLOAT8_DIM_MULTIPLE
    if missing == 0:
        return forward(x)
    rows = F.pad(x.reshape(tokens, width), (0, 0, 0, missing))
    return forward(rows)[:tokens].reshape(*x.shape[:-1], -1)


def resolve_precision(
    precision: str, converters: Mapping[str, object]
) -> tuple[str, dict[str, object]]:
    """The trainer's precision and the converters of a run's `precision` setting.

    ``precision=amp_fp8`` is spelled out here as ``precision=amp_bf16 converters=[float8]``,
    the one place it is: float8 is not a third autocast dtype. Float8Linear casts to float8
    inside the converted matmuls only; attention, norms, the loss and the unconverted matmuls
    run in bf16 autocast, as in an amp_bf16 run. So both spellings build the same run: the
    trainer, its callbacks and checkpoints see amp_bf16 (MFU is measured against the bf16 peak,
    so fp8's gain shows as a higher MFU), and a converters list that already holds a
    `Float8Training` (with options of its own) gets no second one. The Trainer itself takes
    no amp_fp8, since a model handed to it unconverted would train in bf16 without a word.
    Any other precision passes through unchanged.
    """
    if precision != "amp_fp8":
        return precision, dict(converters)
    if any(isinstance(converter, Float8Training) for converter in converters.values()):
        return "amp_bf16", dict(converters)
    return "amp_bf16", {**converters, "float8": Float8Training()}
