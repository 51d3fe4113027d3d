"""Run LayerNorm in the autocast dtype (bf16/fp16) instead of float32.

Autocast computes LayerNorm in float32 for accuracy; for LLM pretraining the low-precision
version trains as well and saves the casts and float32 activations around every norm (MPT's
`low_precision_layernorm`). This algorithm applies it to any model, without a config change to
the model: at INIT it replaces each affine `nn.LayerNorm` by MPT's low-precision LayerNorm,
sharing the same weight and bias parameters, so the optimizer (already built) and checkpoints
see no difference. Outside autocast (precision=fp32) the replacement computes exactly what the
original did.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from llmfoundry.core.engine import Algorithm, Logger
from llmfoundry.core.events import Event
from llmfoundry.core.state import State
from llmfoundry.distributed import unwrap_model
from llmfoundry.models.norms import LayerNorm


def to_low_precision(module: nn.LayerNorm) -> LayerNorm:
    """A low-precision LayerNorm computing what `module` does, on the same parameters."""
    with torch.device("meta"):
        swapped = LayerNorm(module.normalized_shape, module.bias is not None, low_precision=True)
    swapped.eps = module.eps
    swapped.weight = module.weight
    swapped.bias = module.bias
    return swapped


class LowPrecisionLayerNorm(Algorithm):
    """Swap every affine LayerNorm for one that runs in the autocast dtype (at INIT).

    LayerNorms without a weight (``elementwise_affine=False``) are left as they are. The number
    of swapped modules is logged as ``algorithms/low_precision_layernorms``.
    """

    def match(self, event: Event, state: State) -> bool:
        return event is Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if state.precision.name == "fp32":
            warnings.warn(
                "LowPrecisionLayerNorm has no effect with precision=fp32 (there is no autocast "
                "dtype); use precision=amp_bf16 or remove the algorithm",
                stacklevel=2,
            )
        model = unwrap_model(state.model)
        targets = [
            name
            for name, module in model.named_modules()
            if name and isinstance(module, nn.LayerNorm) and module.weight is not None
        ]
        for name in targets:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, to_low_precision(getattr(parent, child)))
        logger.log_metrics({"algorithms/low_precision_layernorms": len(targets)})
