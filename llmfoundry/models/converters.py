"""Model converters: named transforms of the built model, applied before it is parallelized.

A converter swaps modules of a built model for others that compute the same function another
way (low-precision LayerNorm now; torchao's Float8Linear next), the shape of torchtitan's
``model.converters``. The run names them in its ``converters`` group (conf/converters/,
``converters=[low_precision_layernorm]``); `llmfoundry.build` builds each from its node and
`convert_model` applies them in that order to the model `build_model` made, still on the meta
device, before the strategy materializes and wraps it. So FSDP shards, DDP replicates and the
optimizer sees the converted modules, and a converter never deals with sharded parameters.

A converter keeps every parameter's name (it reuses the parameters, or makes new ones of the
same name): checkpoints of a converted run load into an unconverted model and back. It may need
to know how the model will train (fp8 needs a CUDA device and low-precision autocast): the
`ConversionContext` says. A model a converter finds nothing to convert in is refused, since the
run would otherwise silently train without what the config asked for.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from llmfoundry.models.norms import LayerNorm
from llmfoundry.utils.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConversionContext:
    """How the converted model will train: `precision` ("fp32", "amp_bf16", "amp_fp16") and the
    `device` the strategy puts it on."""

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
