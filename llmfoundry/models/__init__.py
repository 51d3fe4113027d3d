"""Model definitions. Each knows nothing of the trainer or of parallelism; each family's
parallelization plan lives beside it (plan.py, plans.py).

Names are imported on first use (`llmfoundry.utils.lazy`): the config check reads
`MPTConfig` without loading torch.
"""

from llmfoundry.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".mpt.config": ("MPTConfig",),
        ".mpt.model": ("MPTForCausalLM",),
        ".plan": ("ParallelPlan",),
        ".plans": ("find_plan", "parallel_plan"),
    },
)
