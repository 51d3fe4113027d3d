"""Each model family's parallelization plan (its ``parallelize.py``), found by the model's type."""

from __future__ import annotations

from torch import nn

from llmfoundry.models.mpt import MPTForCausalLM
from llmfoundry.models.mpt.parallelize import parallelize_plan as _mpt_plan
from llmfoundry.models.plan import ParallelPlan

_PLANS = {MPTForCausalLM: _mpt_plan}


def parallel_plan(model: nn.Module) -> ParallelPlan:
    """The plan of `model`'s family, for strategies that shard or recompute per block."""
    for cls, plan in _PLANS.items():
        if isinstance(model, cls):
            return plan(model)
    known = ", ".join(cls.__name__ for cls in _PLANS)
    raise ValueError(
        f"no parallelization plan for {type(model).__name__} (plans exist for {known}); add "
        "one beside the model (see llmfoundry/models/plan.py) to use a sharding strategy"
    )
