"""MPT decoder-only language model: config, model and Hugging Face export.

Names are imported on first use (`llmfoundry.utils.lazy`): the config check reads
`MPTConfig`'s fields without loading the model (and torch).
"""

from typing import TYPE_CHECKING

from llmfoundry.utils.lazy import lazy_exports

if TYPE_CHECKING:
    from llmfoundry.models.mpt.config import InfiniConfig, MPTConfig
    from llmfoundry.models.mpt.model import MPTForCausalLM

__all__ = ["InfiniConfig", "MPTConfig", "MPTForCausalLM"]
__getattr__, __dir__ = lazy_exports(
    __name__, {"InfiniConfig": ".config", "MPTConfig": ".config", "MPTForCausalLM": ".model"}
)
