"""MPT decoder-only language model: config, model and Hugging Face export.

Names are imported on first use (`llmfoundry.utils.lazy`): the config check reads
`MPTConfig`'s fields without loading the model (and torch).
"""

from llmfoundry.utils.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".config": ("InfiniConfig", "MPTConfig"),
        ".model": ("MPTForCausalLM",),
    },
)
