"""Each model family's parallelization plan (its spec's ``parallelize``), found by the model's type."""

from __future__ import annotations

from torch import nn

from llmfoundry.models.custom import user_plan
from llmfoundry.models.families import FAMILIES, find_family
from llmfoundry.models.plan import ParallelPlan
from llmfoundry.utils.errors import UserError


def find_plan(model: nn.Module) -> ParallelPlan | None:
    """The plan of `model`'s family, or a user module's from its ``fsdp_blocks``
    (llmfoundry/models/custom.py), or None (nothing to apply)."""
    family = find_family(model)
    return user_plan(model) if family is None else family.parallelize(model)


def parallel_plan(model: nn.Module) -> ParallelPlan:
    """The plan of `model`'s family, for strategies that shard or recompute per block."""
    plan = find_plan(model)
    if plan is not None:
        return plan
    known = ", ".join(f.model_class.__name__ for f in FAMILIES.values())
    raise UserError(
        f"no parallelization plan for {type(model).__name__} (plans exist for {known}); for "
        "your own module name its block class: model.fsdp_blocks=[my_pkg.Block]"
    )
