"""Model definitions. Each knows nothing of the trainer or of parallelism; each family's
parallelization plan lives beside it (plan.py)."""

from torch import nn

from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
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


__all__ = ["MPTConfig", "MPTForCausalLM", "ParallelPlan", "parallel_plan"]
