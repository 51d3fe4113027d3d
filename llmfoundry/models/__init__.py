"""Model definitions. Each knows nothing of the trainer or of parallelism; each family's
parallelization plan lives beside it (plan.py, plans.py).

Names are imported on first use (`llmfoundry.utils.lazy`): the config check reads
`MPTConfig` without loading torch.
"""

from typing import TYPE_CHECKING

from llmfoundry.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from llmfoundry.models.mpt import MPTConfig, MPTForCausalLM
    from llmfoundry.models.plan import ParallelPlan
    from llmfoundry.models.plans import parallel_plan

__all__ = ["MPTConfig", "MPTForCausalLM", "ParallelPlan", "parallel_plan"]
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "MPTConfig": ".mpt.config",
        "MPTForCausalLM": ".mpt.model",
        "ParallelPlan": ".plan",
        "parallel_plan": ".plans",
    },
)
